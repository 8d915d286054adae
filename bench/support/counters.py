"""Host-device synchronisations inside a step, counted in torch's dispatcher and attributed to who asked.

Hook calls are counted by ``vlft.measure.HookCallCounter``, which the tests
use too.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch


def _sync_ops():
    aten = torch.ops.aten
    scalar = {aten._local_scalar_dense.default, aten.equal.default}
    # ops whose output shape depends on the data: the host waits for the device to know it
    shaped = set()
    for name, overloads in (
        ("nonzero", ("default",)),
        ("masked_select", ("default",)),
        ("_unique2", ("default",)),
        ("unique_consecutive", ("default",)),
        ("unique_dim", ("default",)),
        ("repeat_interleave", ("Tensor",)),
    ):
        op = getattr(aten, name, None)
        for ov in overloads:
            if op is not None and hasattr(op, ov):
                shaped.add(getattr(op, ov))
    copies = {aten._to_copy.default, aten.copy_.default}
    return scalar, shaped, copies


# frames of bench's own support code (this counter, ``Trainer.step_counted``), never the site that asked:
# the whole bench/support/ package
_HERE = str(Path(__file__).resolve().parent) + "/"
# frames of the dispatch machinery itself, never the site of a synchronisation
_MACHINERY = ("torch/utils/_python_dispatch", "torch/_ops", "torch/_dynamo/", "torch/_compile", "torch/overrides")
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _site(frame) -> tuple[str, str]:
    """(innermost frame outside the dispatch machinery, innermost frame outside torch) as 'file:line func'."""
    site = caller = None
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_HERE) and not any(m in fn for m in _MACHINERY):
            where = _short(fn) + f":{f.f_lineno} {f.f_code.co_name}"
            if site is None:
                site = where
            if not fn.startswith(_TORCH_DIR):
                caller = where
                break
        f = f.f_back
    return site or "?", caller or "?"


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/vlft/", "/plugins/", "/bench/"):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker == "site-packages/" else marker.strip("/") + "/" + tail
    return filename


def _owner(where: str) -> str:
    path = where.split(":", 1)[0]
    for owner in ("vlft", "transformers", "peft", "bench", "plugins"):
        if path.startswith(owner + "/"):
            return owner
    if path.startswith("torch/optim"):
        return "torch.optim"
    if path.startswith("torch/"):
        return "torch"
    return "other"


def _owner_of(site: str, caller: str) -> str:
    """Who asked: the site's package, or for plain torch helpers the code that called them."""
    owner = _owner(site)
    return _owner(caller) if owner == "torch" else owner


def sync_counter(device: torch.device, host_tensors=()):
    """A TorchDispatchMode counting the operations that make the host wait for the device.

    Counted: scalar reads (``aten::_local_scalar_dense`` behind ``.item()``,
    ``float(t)``, ``bool(t)``; ``aten::equal``), ops whose output shape
    depends on the data (``nonzero``, ``masked_select``, ``unique``,
    ``repeat_interleave`` without ``output_size``), and blocking copies
    from the device to the host. On an accelerator only those touching a
    device tensor count; on CPU nothing truly synchronises, so every such
    operation is counted as the synchronisation it would be on a device
    (including reads of tensors that stay on the host there, such as
    AdamW's step counters; the report attributes each to its caller).
    Works on every device, since it sits in torch's dispatcher.
    ``host_tensors`` are tensors known to stay on the host on every backend
    (AdamW's step counters); reads of them are never counted.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar, shaped, copies = _sync_ops()
    on_cpu = device.type == "cpu"

    host_ptrs = {t.untyped_storage().data_ptr() for t in host_tensors if isinstance(t, torch.Tensor)}

    def on_device(t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type != "cpu"

    def would_be_on_device(t) -> bool:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in host_ptrs:
            return False
        return on_cpu or t.device.type != "cpu"

    class SyncCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.events: list[tuple[str, str, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            hit = False
            if func in scalar or func in shaped:
                hit = any(would_be_on_device(a) for a in args)
            elif func in copies:
                is_copy_ = func is torch.ops.aten.copy_.default
                blocking = not kwargs.get("non_blocking", args[2] if is_copy_ and len(args) > 2 else False)
                src = args[1] if is_copy_ else args[0]
                dst = args[0] if is_copy_ else out
                hit = blocking and on_device(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu"
            if hit:
                site, caller = _site(sys._getframe(1))
                self.events.append((func.name() if hasattr(func, "name") else str(func), site, caller))
            return out

        def summary(self) -> dict:
            by_op = Counter(e[0] for e in self.events)
            by_owner = Counter(_owner_of(e[1], e[2]) for e in self.events)
            by_site = Counter(f"{e[1]}  <- {e[2]}" if e[1] != e[2] else e[1] for e in self.events)
            return {
                "total": len(self.events),
                "vlft_own": by_owner.get("vlft", 0),
                "by_op": dict(by_op),
                "by_owner": dict(by_owner),
                "top_sites": dict(by_site.most_common(12)),
            }

    return SyncCounter()
