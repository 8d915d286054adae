"""``--init-adapter RUN_OR_DIR``: a run that starts from an existing adapter (an SFT run's, before DPO).

Found and checked before any weight is loaded: the folder holds an adapter of the run's method, on the
modules the plan adapts, trained with the same method options; otherwise the error says which flags to pass.
"""

from __future__ import annotations

import json

from vlft.config import RunConfig
from vlft.errors import ConfigError
from vlft.models.adapter_folders import AdapterSource, locate_adapter
from vlft.registry import Registry

# options of the run that trained the adapter that change what the adapter is
SHAPING = ("adapter", "train_merger")


def init_adapter_source(registry: Registry, config: RunConfig) -> AdapterSource | None:
    """The adapter ``--init-adapter`` names, of the run's method; None without the flag."""
    if not config.init_adapter:
        return None
    source = locate_adapter(registry, config.init_adapter, flag="--init-adapter")
    if source.method != config.method:
        raise ConfigError(
            f"--init-adapter {config.init_adapter}: holds a {source.method} adapter, and this run's "
            f"method is {config.method}; pass --method {source.method}"
        )
    return source


def matches(name: str, patterns: list[str]) -> bool:
    """PEFT's rule for a list of ``target_modules``: the module's name, or a dotted suffix of it (PEFT saves the
    shortest suffixes that tell the targets apart)."""
    return name in patterns or any(name.endswith(f".{p}") for p in patterns)


def check_init_adapter(config: RunConfig, targets: list[str], source: AdapterSource, module_names: list[str]) -> str:
    """The adapter covers exactly the modules the plan adapts (``targets``; ``module_names``: every module of the
    model) and was trained with this run's method options (where its run folder tells); its folder."""
    where = config.init_adapter
    try:
        saved = json.loads((source.adapter_dir / "adapter_config.json").read_text()).get("target_modules")
    except (OSError, ValueError) as e:
        raise ConfigError(f"--init-adapter {where}: cannot read its adapter_config.json ({e})") from None
    adapted = {n for n in module_names if matches(n, saved)} if isinstance(saved, list) else set(targets)
    if adapted != set(targets):
        extra, missing = sorted(adapted - set(targets)), sorted(set(targets) - adapted)
        raise ConfigError(
            f"--init-adapter {where}: adapts {len(adapted)} modules, this run plans {len(targets)}"
            + (f" (only in the adapter: {extra[0]}, ...)" if extra else "")
            + (f" (only in the plan: {missing[0]}, ...)" if missing else "")
            + "; pass the --targets and --vision-last-n of the run that trained it"
        )
    if source.run_config:
        differ = [k for k in SHAPING if source.run_config.get(k) != getattr(config, k)]
        if differ:
            said = ", ".join(
                f"{k.replace('_', '-')} {source.run_config.get(k)!r} there, {getattr(config, k)!r} here" for k in differ
            )
            raise ConfigError(
                f"--init-adapter {where}: trained with other method options ({said}); pass the "
                f"options of the run that trained it"
            )
    return str(source.adapter_dir)
