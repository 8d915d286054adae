"""Making a loaded model trainable: activation checkpointing, fp32 trainable weights, adapters in autocast."""

from __future__ import annotations

import torch

from vlft.models.families import resolve_module


def enable_checkpointing(model, vision_adapted: bool, family) -> None:
    """Non-reentrant activation checkpointing in both towers, through transformers' own switch.

    Non-reentrant checkpointing needs no input that requires grad (reentrant
    would give vision adapters no gradient, peft issue 2880), so the input
    hooks transformers adds for the reentrant case are removed again: they
    would make the frozen vision tower build an autograd graph. Vision blocks
    are checkpointed only when some are adapted; otherwise nothing there is
    kept for backward anyway. ``family`` says where the vision tower is.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers releases before the rename
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.disable_input_require_grads()
    for cfg in (base.config, getattr(base.config, "text_config", None)):
        if cfg is not None:
            cfg.use_cache = False  # a KV cache is useless in training and incompatible with recomputation
    if not vision_adapted:
        roots = [resolve_module(base, r) for r in family.vision_side() if r]
        for module in (m for root in roots for m in root.modules()):
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = False


def upcast_trainable(model) -> list[str]:
    """Every trainable parameter in fp32 at least (PEFT upcasts its adapter layers only; an fp64 one, as the
    suite's float64 comparisons use, stays fp64); returns the names it cast.

    A half-precision trainable weight under a loss scaler fails in
    ``unscale_`` ("Attempting to unscale FP16 gradients"), and in bf16 its
    updates round away; the frozen base keeps its own dtype.
    """

    cast = []
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
            cast.append(name)
    return cast


def compute_adapters_in_autocast_dtype(model) -> int:
    """Let autocast, not PEFT, choose the adapters' matmul dtype; returns the layers switched.

    PEFT casts each adapter layer's input to the adapter weights' dtype (fp32)
    before autocast casts it back: under bf16/fp16 autocast that keeps an
    extra fp32 copy of every adapted layer's input for backward. Only for
    runs with autocast (half base weights always have it).
    """
    switched = 0
    for module in model.modules():
        if getattr(module, "cast_input_dtype_enabled", False):
            module.cast_input_dtype_enabled = False
            switched += 1
    return switched
