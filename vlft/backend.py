"""``hookimpl_for``: a ``hookimpl`` that answers only for the backends a plugin owns.

Every hook that takes ``backend`` is asked of every plugin, so each backend
hook used to open with ``if backend != NAME: return None``. This marker
writes that guard once::

    from vlft import hookimpl, hookimpl_for

    NAME = "mybackend"
    mybackend_hookimpl = hookimpl_for(NAME)       # or hookimpl_for("a", "b") for several names

    @hookimpl                                     # no backend argument: asked of every plugin
    def vlft_backends(): ...

    @mybackend_hookimpl                           # called for every backend; runs only for NAME
    def vlft_probe_backend(backend): ...

    @mybackend_hookimpl(tryfirst=True)            # any @hookimpl option: tryfirst, trylast,
    def vlft_attention_implementation(backend, config, model_config): ...   # hookwrapper, wrapper, ...

What pluggy registers is a plain function (or method) marked exactly as
``@hookimpl(...)`` would mark it, with the original name and parameters
(``functools.wraps``: pluggy reads the parameter names through
``__wrapped__``), so hook names, signatures and ``vlft.testing.check_plugin``
see no difference. For another backend it returns None without calling the
function; a wrapper (``hookwrapper=True`` or ``wrapper=True``) passes the
result through untouched instead. It works on module functions and on
methods of a plugin class alike.

Torch-free: importing it loads only pluggy (through ``vlft.hookspecs``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from vlft.hookspecs import hookimpl

__all__ = ["BackendHookimpl", "hookimpl_for"]


class BackendHookimpl:
    """A ``hookimpl`` marker whose functions run only when ``backend`` is one of ``names``.

    Use it bare (``@marker``) or with ``hookimpl`` options (``@marker(tryfirst=True)``);
    build it with ``hookimpl_for``.
    """

    def __init__(self, names: tuple[str, ...], options: dict[str, Any]):
        if not names or not all(isinstance(n, str) and n for n in names):
            raise TypeError(f"hookimpl_for needs one or more backend names (non-empty strings), got {names!r}")
        self.names = frozenset(names)
        self.options = options
        hookimpl(**options)  # an unknown option (a typo of tryfirst, say) fails here, not at registration

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"hookimpl_for({', '.join(map(repr, sorted(self.names)))}{options})"

    def __call__(self, function: Callable | None = None, **options: Any):
        if function is None:  # @marker(tryfirst=True): the same names, more options
            return BackendHookimpl(tuple(self.names), {**self.options, **options})
        if options:
            raise TypeError("pass hookimpl options without the function: @marker(tryfirst=True)")
        return hookimpl(_guarded(function, self.names, self.options), **self.options)


def hookimpl_for(*names: str, **options: Any) -> BackendHookimpl:
    """A ``hookimpl`` marker for hooks that answer only for the backends ``names``.

    ``options`` are ``hookimpl``'s own (``tryfirst``, ``trylast``, ``hookwrapper``,
    ``wrapper``, ``optionalhook``, ``specname``). Only hooks with a ``backend``
    parameter can be marked: others (``vlft_backends``, the method hooks) keep
    ``@hookimpl``, and marking one raises ``TypeError`` at import.
    """
    return BackendHookimpl(names, options)


def _guarded(function: Callable, names: frozenset[str], options: dict[str, Any]) -> Callable:
    """``function``, run only when its ``backend`` argument is in ``names``; None (or a pass-through) otherwise."""
    params = list(inspect.signature(function).parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "backend" not in [p.name for p in params]:
        raise TypeError(
            f"{function.__qualname__} has no 'backend' parameter: hookimpl_for guards only backend "
            "hooks; mark it with @hookimpl"
        )
    # pluggy passes hook arguments positionally, in parameter order (a bound method's call puts self first,
    # which the index counts); vlft.testing and direct calls pass them by keyword: read backend from either
    index = positional.index("backend") if "backend" in positional else None

    def owned(args: tuple, kwargs: dict) -> bool:
        if "backend" in kwargs:
            return kwargs["backend"] in names
        if index is not None and index < len(args):
            return args[index] in names
        return True  # no backend given at all: let the call fail with Python's own "missing argument"

    if options.get("hookwrapper") or options.get("wrapper"):
        if not inspect.isgeneratorfunction(function):
            raise TypeError(f"{function.__qualname__} is marked as a wrapper but is not a generator function")

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if owned(args, kwargs):
                return (yield from function(*args, **kwargs))
            # not ours: yield once and hand the result back unchanged (hookwrapper ignores the return)
            return (yield)

        return wrapper

    @functools.wraps(function)
    def guarded(*args, **kwargs):
        if owned(args, kwargs):
            return function(*args, **kwargs)
        return None

    return guarded
