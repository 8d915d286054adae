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

import types

import torch

from vlft.hookspecs import hookimpl
from vlft.policies import PrecisionPolicy

# the logged loss: a float64 sum rounded once to float32 (relative error <= 2**-24), on each side
LOGGED_RTOL = 2 * 2.0**-24


def _widened(model):
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.double()
    float64_throughout(model)
    return model


# transformers computes these in float32 whatever the model's dtype: an RMSNorm's mean square and eager
# attention's softmax. Their float32 reductions round by the batch's shape (a packed row against padded ones)
# and by the thread count, so a float64 reference computes them in its own dtype instead.
NORMS = ("Qwen2_5_VLRMSNorm", "Qwen2RMSNorm", "Qwen3VLTextRMSNorm", "Qwen3VLMoeTextRMSNorm")


def _rms_norm(self, hidden_states):
    if hidden_states.dtype != torch.float64:
        return type(self).forward(self, hidden_states)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def float64_throughout(model):
    """``model``'s RMSNorms, and every eager attention of the Qwen-VL families, compute in float64 when given
    float64 (they stay as transformers has them otherwise): for a float64 reference that is float64 everywhere
    a reduction runs (what stays float32, the rotary cos/sin and the vision rotary, is element-wise)."""
    _patch_eager_attention()
    for module in model.modules():
        if type(module).__name__ in NORMS:
            module.forward = types.MethodType(_rms_norm, module)
    return model


def _float64_eager_attention(eager):
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if query.dtype != torch.float64:
            return eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        n = getattr(module, "num_key_value_groups", 1)
        key = key.repeat_interleave(n, dim=1) if n > 1 else key
        value = value.repeat_interleave(n, dim=1) if n > 1 else value
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.nn.functional.softmax(weights, dim=-1)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    attention.float64_reference = True
    return attention


def _patch_eager_attention():
    import importlib

    for name in ("qwen2_5_vl.modeling_qwen2_5_vl", "qwen3_vl.modeling_qwen3_vl", "qwen3_vl_moe.modeling_qwen3_vl_moe"):
        module = importlib.import_module(f"transformers.models.{name}")
        if not getattr(module.eager_attention_forward, "float64_reference", False):
            module.eager_attention_forward = _float64_eager_attention(module.eager_attention_forward)


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
    return PrecisionPolicy(
        "fp64",
        param_dtype="float64",
        reason="test plugin float64_reference: float64",
        param_reason="test plugin float64_reference: float64 weights",
    )
