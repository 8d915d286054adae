"""Meters and counters shared by the memory plan, the tests and the benchmarks: one copy for all.

- ``SavedTensorMeter`` counts what autograd saves for backward (the memory
  plan's tracer uses it on the meta device; ``tests/test_memory.py`` and
  bench's CPU step memory on real tensors);
- ``LiveTensorMeter`` follows the peak of live tensors during a real step,
  where a device has no allocator statistics to ask (bench's memory group,
  ``bench/device_scale.py`` on the CPU);
- ``CopiedBytes`` counts the bytes tensor copies write (``clone``, ``copy_``) while active: the
  non-finite guard's cost (``tests/test_speed.py``, bench's train-step group);
- ``HookCallCounter`` names the plugin hooks called while active, through
  any registry (``tests/test_run.py``, bench's ``dispatch`` group).

Torch-free at import, like the rest of the top layer: torch and pluggy are
imported inside the methods that need them.
"""

from __future__ import annotations

from typing import Any


class SavedTensorMeter:
    """Bytes autograd keeps for backward: each saved tensor's storage once, parameters and buffers excluded.

    Works on real tensors (storages told apart by address) and on the meta
    device (no addresses: a view counts as its base tensor).
    """

    def __init__(self, model):
        self.exclude = {self._key(t) for t in (*model.parameters(), *model.buffers())}
        self.storages: dict[object, int] = {}

    @staticmethod
    def _key(t):
        if t.device.type == "meta":
            base = t._base if t._base is not None else t
            return ("meta", id(base))
        return t.untyped_storage().data_ptr()

    def pack(self, t):
        try:
            key = self._key(t)
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, ...)
            return t
        if key and key not in self.exclude and key not in self.storages:
            if t.device.type == "meta":
                base = t._base if t._base is not None else t
                self.storages[key] = base.numel() * base.element_size()
            else:
                self.storages[key] = t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class LiveTensorMeter:
    """The peak bytes of tensor storages alive at once while active, on any device (the CPU included).

    Every tensor an operation creates is followed through a weak reference to
    its storage until it is freed; ``resident`` tensors (weights, optimizer
    state) made before are counted from the start. This is what an
    allocator's peak statistic reports, less fragmentation, so the memory
    plan can be checked where there is no allocator to ask.
    """

    def __init__(self, resident=()):
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.live: dict[int, tuple[Any, int]] = {}  # data pointer -> (a StorageWeakRef, bytes)
        for t in resident:
            self._add(t)
        self.start_bytes = self.current
        self.peak = self.current

    def _add(self, t) -> None:
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = st.data_ptr()
        if not ptr:
            return
        known = self.live.get(ptr)
        if known is None or known[0].expired():
            self.live[ptr] = (self._ref(st), st.nbytes())

    @property
    def current(self) -> int:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            del self.live[k]
        return sum(n for _, n in self.live.values())

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        meter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    meter._add(t)
                meter.peak = max(meter.peak, meter.current)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


class CopiedBytes:
    """Bytes written by tensor copies (``aten.clone``, ``aten.copy_``) while active, as ``with CopiedBytes() as c``."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._mode = None

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self
        copies = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in copies and isinstance(out, torch.Tensor):
                    meter.bytes += out.numel() * out.element_size()
                    meter.calls += 1
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        assert self._mode is not None  # set by __enter__
        self._mode.__exit__(*exc)
        return False


class HookCallCounter:
    """Names of the plugin hooks of ``project`` called while active, in order, through any registry.

    pluggy's ``HookCaller`` is watched itself (its call methods, wrapped while
    active), so a call is seen whichever registry makes it: the one a run was
    given, the process-wide one, or one made on the spot. Calls to other
    projects' hooks (pytest's, say) are not counted. Entered again, the same
    counter keeps adding to ``calls``.
    """

    _CALL_METHODS = ("__call__", "call_extra", "call_historic")

    def __init__(self, project: str = "vlft"):
        self.project = project
        self.calls: list[str] = []
        self._real: dict[str, object] = {}

    def _watched(self, real):
        def watched(caller, *args, **kwargs):
            manager = getattr(caller._hookexec, "__self__", None)
            if getattr(manager, "project_name", None) == self.project:
                self.calls.append(caller.name)
            return real(caller, *args, **kwargs)

        return watched

    def __enter__(self):
        from pluggy import HookCaller

        self._real = {name: getattr(HookCaller, name) for name in self._CALL_METHODS}
        for name, real in self._real.items():
            setattr(HookCaller, name, self._watched(real))
        return self

    def __exit__(self, *exc):
        from pluggy import HookCaller

        for name, real in self._real.items():
            setattr(HookCaller, name, real)
        self._real = {}
