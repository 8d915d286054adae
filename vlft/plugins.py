"""The built-in plugins, registered directly with the plugin manager (as datasette and simonw/llm do).

Entry points (group ``vlft``) are for third-party plugins only: the built-ins are found here, so a checkout
that is not installed (``PYTHONPATH=/path/to/checkout python -m vlft ...``, a device machine's Python with
no setuptools) has its CPU backend, methods, model families, objectives and commands, and no install
metadata has to be written by hand. Each keeps the plugin name its entry point had, so
``VLFT_DISABLE_PLUGINS=lora`` and ``vlft plugins`` read as before.

The core's own (``vlft.builtin``) are listed below. The plugin packages are found, not listed, so the core
names no backend: each folder ``plugins/<name>/`` of the checkout is the top-level package
``vlft_<name>`` (pyproject.toml's ``[tool.setuptools.package-dir]`` installs it under that name; a test
checks the two agree). A package is one plugin, called ``<name>``, unless its ``__init__`` lists
``PLUGIN_MODULES``: then each of those submodules is a plugin, called by its module name
(``plugins/methods``: ``lora``, ``oft``).

Where vlft itself is imported from a checkout (a ``plugins/`` folder beside the ``vlft`` package),
:func:`serve_checkout` puts a finder first that maps each ``vlft_<name>`` to its folder in the same
checkout, so the built-ins always come from the tree vlft comes from (not from an install of another
checkout) and ``import vlft_models`` works without an install, in the parent process, in torchrun's
workers and in tests alike. An installed wheel has no ``plugins/`` beside it: its metadata lists the
packages (``top_level.txt``) and the install serves them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

# the core's own plugins: (plugin name, module)
CORE_PLUGINS: tuple[tuple[str, str], ...] = (
    ("commands", "vlft.builtin.commands"),
    ("sinks", "vlft.builtin.tensorboard"),
    ("cpu", "vlft.builtin.cpu"),
)
PACKAGE_PREFIX = "vlft_"
CHECKOUT = Path(__file__).resolve().parents[1]


def builtin_packages(root: Path = CHECKOUT) -> dict[str, Path | None]:
    """{top-level package: its folder in the checkout} of the built-in plugin packages; from an installed
    wheel (no checkout), {package: None} as the install's metadata lists them."""
    folder = root / "plugins"
    if folder.is_dir():
        return {PACKAGE_PREFIX + d.name: d for d in sorted(folder.iterdir()) if (d / "__init__.py").is_file()}
    try:
        top = importlib.metadata.distribution("vlft").read_text("top_level.txt") or ""
    except importlib.metadata.PackageNotFoundError:
        return {}
    return {name: None for name in sorted(top.split()) if name.startswith(PACKAGE_PREFIX)}


def builtin_plugins(root: Path = CHECKOUT) -> list[tuple[str, str]]:
    """(plugin name, module) of every built-in plugin, in the order they register. Imports each plugin
    package's ``__init__`` (light: a plugin module imports no torch at module level) to read
    ``PLUGIN_MODULES``; one that fails to import is still listed, so registering it reports the error."""
    found = list(CORE_PLUGINS)
    for package in builtin_packages(root):
        name = package[len(PACKAGE_PREFIX) :]
        try:
            modules = getattr(importlib.import_module(package), "PLUGIN_MODULES", None)
        except Exception:  # noqa: BLE001 - registering it again reports the failure as a broken plugin
            modules = None
        if modules:
            found += [(module, f"{package}.{module}") for module in modules]
        else:
            found.append((name, package))
    return found


class CheckoutPlugins(importlib.abc.MetaPathFinder):
    """Finds the built-in plugin packages in the checkout's ``plugins/`` folder by their installed names."""

    def __init__(self, root: Path = CHECKOUT):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE_PREFIX) or "." in fullname:
            return None  # submodules are found through the package's __path__ by the usual finders
        init = self.root / "plugins" / fullname[len(PACKAGE_PREFIX) :] / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def serve_checkout(root: Path = CHECKOUT) -> bool:
    """Serve the plugin packages from the checkout at ``root`` (idempotent). Returns whether a finder was
    added now."""
    if any(isinstance(f, CheckoutPlugins) for f in sys.meta_path):
        return False
    if not (root / "plugins").is_dir():  # an installed wheel: no checkout around it, the install serves them
        return False
    sys.meta_path.insert(0, CheckoutPlugins(root))
    return True
