"""The plugin manager: plugins in, backends, methods, objectives, reward functions and scorers out.

The built-in plugins (``vlft.plugins``) register directly, so a checkout that is not
installed has them; third-party plugins register through the ``vlft`` entry-point group. A plugin that
fails to import is recorded as broken and skipped, so one bad package cannot take the others down;
``vlft plugins`` shows it with its error. ``VLFT_DISABLE_PLUGINS=name,...`` blocks plugins
by entry-point name. ``VLFT_PLUGINS=module,...`` loads importable modules as
plugins beside the installed ones, in every process the environment reaches
(torchrun's workers too), as ``PYTEST_PLUGINS`` does for pytest: a plugin tried
before it is packaged, or a test's own.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pluggy

from vlft import hookspecs
from vlft.contracts import CHANGES_DOC, PLUGIN_API, changed, changes_since
from vlft.contracts.backend import BackendInfo
from vlft.contracts.method import MethodInfo
from vlft.contracts.objective import ObjectiveInfo, OptionSpec, Reward, option_specs, resolve_options
from vlft.contracts.scorer import Scorer
from vlft.errors import ConfigError, VlftError
from vlft.plugins import builtin_plugins, serve_checkout

if TYPE_CHECKING:
    from vlft.contracts.objective import Objective

ENTRY_POINT_GROUP = "vlft"


DISABLE_ENV = "VLFT_DISABLE_PLUGINS"
PLUGINS_ENV = "VLFT_PLUGINS"


@dataclass
class Registry:
    """The plugin manager with what its plugins offer, checked for clashes."""

    pm: pluggy.PluginManager
    broken: dict[str, str] = field(default_factory=dict)  # entry-point name -> error
    disabled: list[str] = field(default_factory=list)
    backends: dict[str, BackendInfo] = field(default_factory=dict)
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    objectives: dict[str, ObjectiveInfo] = field(default_factory=dict)
    rewards: dict[str, Reward] = field(default_factory=dict)  # reward functions (``vlft_rewards``, scorers) by name
    scorers: dict[str, Scorer] = field(default_factory=dict)  # scorers (``vlft_scorers``) by name
    owners: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> plugin
    # plugin -> what it should know about the plugin API: written for another version, a hook that is gone
    notes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def hook(self):
        return self.pm.hook

    def refresh(self) -> Registry:
        """Collect backend, method, objective, reward and scorer names; two plugins claiming one name is an
        error. Every scorer is a reward too (``Scorer.as_reward``), so a scorer and a reward of one name clash."""
        self.backends.clear()
        self.methods.clear()
        self.objectives.clear()
        self.rewards.clear()
        self.scorers.clear()
        self.owners.clear()
        for kind, caller, table in (
            ("backend", self.pm.hook.vlft_backends, self.backends),
            ("method", self.pm.hook.vlft_methods, self.methods),
            ("objective", self.pm.hook.vlft_objectives, self.objectives),
            ("reward", self.pm.hook.vlft_rewards, self.rewards),
            ("scorer", self.pm.hook.vlft_scorers, self.scorers),
        ):
            for impl in caller.get_hookimpls():
                for info in impl.function() or []:  # pyright: ignore[reportGeneralTypeIssues]  # pluggy types results as object
                    key = (kind, info.name)
                    if key in self.owners:
                        raise VlftError(
                            f"two plugins offer the {kind} '{info.name}': '{self.owners[key]}' and "
                            f"'{impl.plugin_name}'. Uninstall one, or block it with "
                            f"{DISABLE_ENV}={impl.plugin_name}"
                        )
                    self.owners[key] = impl.plugin_name
                    table[info.name] = info
        for name, scorer in self.scorers.items():  # one function seen twice: every scorer is a reward
            owner = self.owners[("scorer", name)]
            if name in self.rewards:
                raise VlftError(
                    f"two plugins offer the reward '{name}': '{self.owners[('reward', name)]}' (a reward) and "
                    f"'{owner}' (a scorer, which is a reward too). Uninstall one, or block it with "
                    f"{DISABLE_ENV}={owner}"
                )
            self.rewards[name] = scorer.as_reward()
            self.owners[("reward", name)] = owner
        return self

    def backend(self, name: str) -> BackendInfo:
        if name not in self.backends:
            raise ConfigError(
                f"unknown backend '{name}'; valid backends: {', '.join(['auto', *sorted(self.backends)])}"
                + self._broken_hint()
            )
        return self.backends[name]

    def method(self, name: str) -> MethodInfo:
        if name not in self.methods:
            raise ConfigError(
                f"unknown method '{name}'; valid methods: {', '.join(sorted(self.methods))}" + self._broken_hint()
            )
        return self.methods[name]

    def objective(self, name: str) -> ObjectiveInfo:
        if name not in self.objectives:
            raise ConfigError(
                f"unknown objective '{name}'; valid objectives: {', '.join(sorted(self.objectives))}"
                + self._broken_hint()
            )
        return self.objectives[name]

    def objective_for(self, config) -> Objective:
        """The ``Objective`` of ``config.objective``: its options built from ``config.objective_options`` and
        checked, then asked of its plugin with the reward functions on offer."""
        info = self.objective(config.objective)
        owners = {name: [o for o, _ in declared] for name, declared in self.objective_options().items()}
        options = resolve_options(info.name, info.options, config.objective_options, owners)
        return self.first(
            "vlft_objective", objective=info.name, config=config, options=options, rewards=dict(self.rewards)
        )

    def objective_options(self) -> dict[str, list[tuple[str, OptionSpec]]]:
        """{option name: [(objective, its declaration)]} over every objective on offer: one ``vlft run`` flag
        and config-file key per name, which several objectives may share (``--beta``)."""
        out: dict[str, list[tuple[str, OptionSpec]]] = {}
        for info in sorted(self.objectives.values(), key=lambda i: i.name):
            for spec in option_specs(info.options):
                out.setdefault(spec.name, []).append((info.name, spec))
        return out

    def _broken_hint(self) -> str:
        if not self.broken:
            return ""
        return " (plugins that failed to load: " + ", ".join(sorted(self.broken)) + "; see `vlft plugins`)"

    def first(self, hook_name: str, **kwargs):
        """Call a firstresult hook and insist on an answer."""
        answer = getattr(self.pm.hook, hook_name)(**kwargs)
        if answer is None:
            subject = kwargs.get("backend") or kwargs.get("method") or kwargs.get("objective")
            raise VlftError(f"no plugin answers {hook_name} for '{subject}'; the plugin that offers it is incomplete")
        return answer


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("vlft")
    pm.add_hookspecs(hookspecs)
    return pm


def load_registry(load_entry_points: bool = True, plugins: tuple = (), builtins: bool | None = None) -> Registry:
    """A fresh registry: the built-in plugins and the entry-point plugins (unless ``load_entry_points`` is
    False; ``builtins`` follows it unless given) plus ``plugins`` (objects or modules)."""
    pm = new_plugin_manager()
    disabled = [n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()]
    registry = Registry(pm, disabled=disabled)
    for name in disabled:
        pm.set_blocked(name)
    if load_entry_points if builtins is None else builtins:
        _load_builtins(pm, registry)
    if load_entry_points:
        _load_entry_points(pm, registry)
        _load_env_plugins(pm, registry)
    for plugin in plugins:
        # a readable name for messages: the module's or the class's
        pm.register(plugin, name=getattr(plugin, "__name__", None) or type(plugin).__name__)
    registry.notes = api_notes(pm)
    return registry.refresh()


def api_notes(pm: pluggy.PluginManager) -> dict[str, list[str]]:
    """{plugin: lines} for plugins written for another plugin API: one that declares an older or newer version
    (``VLFT_PLUGIN_API = N`` in its module), one that answers a hook this vlft no longer has (pluggy would
    ignore it without a word). ``vlft plugins`` shows them; what breaks on an old field says so itself."""
    notes: dict[str, list[str]] = {}
    for name, plugin in pm.list_name_plugin():
        lines = []
        declared = getattr(plugin, "VLFT_PLUGIN_API", None)
        if isinstance(declared, int) and declared < PLUGIN_API:
            since = sorted({c.api for c in changes_since(declared)})
            lines.append(
                f"written for plugin API {declared}; this vlft's is {PLUGIN_API}: see "
                + ", ".join(f"{CHANGES_DOC}#plugin-api-{v}" for v in since)
                + " for what changed"
            )
        elif isinstance(declared, int) and declared > PLUGIN_API:
            lines.append(f"written for plugin API {declared}, newer than this vlft's ({PLUGIN_API}): upgrade vlft")
        for caller in pm.get_hookcallers(plugin) or []:
            if caller.has_spec():
                continue
            gone = changed("hook", caller.name)
            lines.append(
                gone.line()
                if gone is not None
                else f"answers {caller.name}, which is no hook of plugin API {PLUGIN_API} (docs/plugin-hooks.md "
                f"lists them)"
            )
        if lines:
            notes[name or repr(plugin)] = lines
    return notes


def _load_builtins(pm: pluggy.PluginManager, registry: Registry) -> None:
    """The built-in plugins, imported by module name (from the checkout where vlft is not installed)."""
    serve_checkout()
    for name, module_name in builtin_plugins():
        if pm.is_blocked(name) or pm.has_plugin(name):
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - a built-in that cannot import is broken, the others still load
            registry.broken[name] = f"{e.__class__.__name__}: {e}"
            continue
        pm.register(module, name=name)


def _load_entry_points(pm: pluggy.PluginManager, registry: Registry) -> None:
    """Third-party plugins through the ``vlft`` entry-point group (pluggy's ``load_setuptools_entrypoints``,
    with a failed import recorded instead of raised). An entry point naming a plugin already registered
    (an install of vlft made when the built-ins were entry points too) is skipped, not registered twice."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.is_blocked(ep.name) or pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as e:  # noqa: BLE001 - any import failure just marks the plugin broken
            registry.broken[ep.name] = f"{e.__class__.__name__}: {e}"
            continue
        if pm.is_registered(plugin):  # the same module under another name: a built-in an old install lists
            continue
        pm.register(plugin, name=ep.name)


def _load_env_plugins(pm: pluggy.PluginManager, registry: Registry) -> None:
    """The modules ``VLFT_PLUGINS`` names, each registered under its module name (broken ones recorded)."""
    for name in [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]:
        if pm.is_blocked(name) or pm.has_plugin(name):
            continue
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - as for entry points: marked broken, the others still load
            registry.broken[name] = f"{e.__class__.__name__}: {e} (from {PLUGINS_ENV})"
            continue
        if pm.is_registered(module):  # a built-in or an entry point already registered it
            continue
        pm.register(module, name=name)


_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _default
    if _default is None:
        _default = load_registry()
    return _default
