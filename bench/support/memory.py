"""Peak memory of one training step, the way each backend can measure it honestly.

The meters themselves are ``vlft.measure``'s (the memory plan's tests use
them too): ``SavedTensorMeter`` for ``step_memory`` on the CPU,
``LiveTensorMeter`` for ``measured_step_peak`` on the CPU.
"""

from __future__ import annotations

import torch

from bench.support.env import BenchEnv
from bench.support.training import Trainer
from vlft.measure import LiveTensorMeter, SavedTensorMeter


def _tensor_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def step_memory(env: BenchEnv, tr: Trainer, host_batch: dict, device_batch: dict) -> dict:
    """Peak memory of one training step, the way this backend can measure it honestly.

    Accelerators: the backend's memory reader after resetting the device's
    peak counter: ``peak_bytes`` is the allocator's true peak during the
    step (weights included), ``step_bytes`` the part above what was resident
    before it. CPU has no allocator statistics (``ru_maxrss`` only grows, so
    it cannot tell variants apart in one process); there ``peak_bytes`` is
    counted: weights and buffers + every tensor autograd saves for backward
    (caught with ``saved_tensors_hooks``, each storage once) + gradients +
    optimizer state. That is deterministic and counts what differs between
    methods; it leaves out short-lived temporaries inside single operations.
    """
    module = env.device_module()
    if module is not None and hasattr(module, "reset_peak_memory_stats") and hasattr(module, "memory_allocated"):
        env.synchronize()
        tr.optimizer.zero_grad(set_to_none=True)
        before = int(module.memory_allocated(env.device))
        module.reset_peak_memory_stats(env.device)
        tr.step(host_batch, device_batch)
        env.synchronize()
        peak = env.memory_reader().peak_bytes
        return {
            "measure": f"{env.device.type} allocator peak (backend memory reader)",
            "peak_bytes": peak,
            "step_bytes": peak - before if peak is not None else None,
            "resident_bytes": before,
        }
    meter = SavedTensorMeter(tr.model)
    with meter.hooks():
        tr.step(host_batch, device_batch)
    weights = _tensor_bytes(list(tr.model.parameters()) + list(tr.model.buffers()))
    trainable = [p for g in tr.optimizer.param_groups for p in g["params"]]
    grads = sum(p.numel() * p.element_size() for p in trainable)  # set to None after the step; were this size
    state = _tensor_bytes(v for s in tr.optimizer.state.values() for v in s.values())
    peak = weights + meter.bytes + grads + state
    return {
        "measure": "counted: weights + autograd-saved tensors + grads + optimizer state",
        "peak_bytes": peak,
        "activation_bytes": meter.bytes,
        "weight_bytes": weights,
        "grad_bytes": grads,
        "optimizer_bytes": state,
    }


def measured_step_peak(env: BenchEnv, session, group: list[dict]) -> dict:
    """Peak memory of one real ``train_step_on`` of a prepared session (optimizer state already made).

    Accelerators: the allocator's peak through the backend's memory reader.
    CPU: every tensor storage alive at once, followed through the dispatcher
    (``vlft.measure.LiveTensorMeter``), with the resident weights and optimizer
    state counted from the start; transients inside the step are included.
    """

    module = env.device_module()
    if module is not None and hasattr(module, "reset_peak_memory_stats"):
        env.synchronize()
        before = int(module.memory_allocated(env.device))
        module.reset_peak_memory_stats(env.device)
        session.train_step(group)
        env.synchronize()
        peak = env.memory_reader().peak_bytes
        return {
            "measure": f"{env.device.type} allocator peak",
            "peak_bytes": peak,
            "step_bytes": peak - before,
            "resident_bytes": before,
        }
    resident = [
        *session.model.parameters(),
        *session.model.buffers(),
        *(v for st in session.optimizer.state.values() for v in st.values()),
    ]
    with LiveTensorMeter(resident) as meter:
        session.train_step(group)
    return {
        "measure": "live tensor storages, followed through the dispatcher",
        "peak_bytes": meter.peak,
        "step_bytes": meter.peak - meter.start_bytes,
        "resident_bytes": meter.start_bytes,
    }
