"""The built-in plugins, registered directly with the plugin manager (as datasette and simonw/llm do).

Entry points (group ``vlft``) are for third-party plugins only: the built-ins are listed here, so a
checkout that is not installed (``PYTHONPATH=/path/to/checkout python -m vlft ...``, a device machine's
Python with no setuptools) has its CPU backend, methods, model families, objectives and commands, and no
install metadata has to be written by hand. Each keeps the plugin name its entry point had, so
``VLFT_DISABLE_PLUGINS=cuda`` and ``vlft plugins`` read as before.

The plugin packages outside ``vlft/`` (``plugins/cuda`` ...) are installed under top-level names
(``vlft_cuda`` ...) by pyproject.toml's ``[tool.setuptools.package-dir]``. Where vlft itself is
imported from a checkout (a ``plugins/`` folder beside the ``vlft`` package), :func:`serve_checkout`
puts a finder first that maps each of those names to its folder in the same checkout, so the built-ins
always come from the tree vlft comes from (not from an install of another checkout) and ``import
vlft_models`` works without an install, in the parent process, in torchrun's workers and in tests alike.
An installed wheel has no ``plugins/`` beside it: the install serves the names there.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

# (plugin name, module): the order they register in. The names are those the entry points had.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("commands", "vlft.builtin.commands"),
    ("sinks", "vlft.builtin.tensorboard"),
    ("cpu", "vlft.builtin.cpu"),
    ("cuda", "vlft_cuda"),
    ("ascend", "vlft_ascend"),
    ("lora", "vlft_methods.lora"),
    ("oft", "vlft_methods.oft"),
    ("models", "vlft_models"),
    ("sft", "vlft_objectives.sft"),
    ("dpo", "vlft_objectives.dpo"),
)

# top-level package -> its folder relative to the checkout root; pyproject.toml's package-dir says the same
# for an install (tests/test_plugins.py checks that the two agree)
BUILTIN_PACKAGES: dict[str, str] = {
    "vlft_cuda": "plugins/cuda",
    "vlft_ascend": "plugins/ascend",
    "vlft_methods": "plugins/methods",
    "vlft_models": "plugins/models",
    "vlft_objectives": "plugins/objectives",
}

CHECKOUT = Path(__file__).resolve().parents[1]


class CheckoutPlugins(importlib.abc.MetaPathFinder):
    """Finds the built-in plugin packages in the checkout's ``plugins/`` folder by their installed names."""

    def __init__(self, root: Path = CHECKOUT):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = BUILTIN_PACKAGES.get(fullname)
        if folder is None:
            return None  # submodules are found through the package's __path__ by the usual finders
        init = self.root / folder / "__init__.py"
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
