"""A test's own plugin: the CPU reference backend computing in float64. It refines the ``cpu`` backend's
precision policy with ``tryfirst`` (float64 base weights), and wraps whatever method applies or loads the
adapter to widen its trainable weights to float64 too (vlft keeps them fp32; PEFT computes an adapter in its
weights' dtype), as a third party may refine one concern of another plugin.

Two trainings that differ only in summation order (packed rows against padded ones, 2 processes against 1)
agree in float64 to ~1e-16 relative per operation; AdamW's normalised update can turn float32 rounding in
near-zero gradients into weight differences of the learning rate's size, which later steps carry, but
float64's cannot reach the logged loss's resolution. The logged loss is summed in float32 (the loop's
window), so two such runs log losses equal to float32 rounding: ``LOGGED_RTOL``.

Loaded in-process with ``load_registry(plugins=(float64_reference,))`` and in subprocesses (torchrun's
workers) through ``VLFT_PLUGINS=float64_reference`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

from vlft.hookspecs import hookimpl
from vlft.policies import PrecisionPolicy

# the logged loss: a float64 sum rounded once to float32 (relative error <= 2**-24), on each side
LOGGED_RTOL = 2 * 2.0 ** -24


def _widened(model):
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.double()
    return model


@hookimpl(wrapper=True)
def vlft_apply_adapter(method, model):
    return _widened((yield))


@hookimpl(wrapper=True)
def vlft_load_adapter(method, model):
    adapted = yield
    return _widened(adapted) if adapted is not None else None


@hookimpl(tryfirst=True)
def vlft_precision_policy(backend, config):
    if backend != "cpu":
        return None
    return PrecisionPolicy("fp64", param_dtype="float64", reason="test plugin float64_reference: float64",
                           param_reason="test plugin float64_reference: float64 weights")
