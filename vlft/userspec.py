"""A user's ``MODULE:NAME`` (a reward, a scorer): the module imported, a module beside the user found as
``python -m`` would find it, any import failure said as the option's error."""

from __future__ import annotations

import importlib
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
            if e.name != module_name.split(".")[0] or os.getcwd() in sys.path:
                raise
            sys.path.insert(0, os.getcwd())  # a module beside the user, as `python -m` would find it
            module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's: say so, with the error
        raise ConfigError(f"{option} {spec}: cannot import {module_name} ({e.__class__.__name__}: {e})") from None
    return module_name, attr, getattr(module, attr, None)
