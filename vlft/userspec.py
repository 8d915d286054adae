"""A user's ``MODULE:NAME`` (a reward, a scorer): the module imported, a module beside the user found as
``python -m`` would find it, any import failure said as the option's error."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys

from vlft.errors import ConfigError


def user_attribute(spec: str, option: str):
    """(module name, attribute name, the attribute or None) of ``spec`` = ``MODULE:NAME``, for ``option``'s
    error messages (``--reward``, ``--scorer``)."""
    module_name, _, attr = spec.rpartition(":")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name.split(".")[0]:
                raise
            module = import_beside_user(module_name, e)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's: say so, with the error
        raise ConfigError(f"{option} {spec}: cannot import {module_name} ({e.__class__.__name__}: {e})") from None
    return module_name, attr, getattr(module, attr, None)


def import_beside_user(module_name: str, missing: ModuleNotFoundError):
    """``module_name`` from the working folder, as ``python -m`` would find it, for a ``vlft`` started by its
    console script (whose ``sys.path`` lacks the folder). The folder is searched for this one module; it is not
    added to ``sys.path`` (a run changes no process-wide import state)."""
    top = module_name.split(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
    if spec is None or spec.loader is None:
        raise missing
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module  # its submodules (``pkg.rewards``) and its own imports of itself find it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[top]
        raise
    return importlib.import_module(module_name)
