"""Counting activation memory: what autograd saves for backward, for the memory plan.

``trace_activations`` runs every layer of an adapted model once on the meta
device (shapes only: no memory, no arithmetic) under ``saved_tensors_hooks``
and counts what autograd would keep. ``BatchShape`` (one micro-batch's
samples, tokens and image grids) is what it traces; the memory plan asks it
for the largest ones the sampler will draw.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface, AutoModelForImageTextToText
from transformers.vision_utils import get_vision_window_index

from vlft.measure import SavedTensorMeter
from vlft.models.loss import kept_loss_sum

if TYPE_CHECKING:
    from vlft.planning.trace import BatchShape


@dataclass
class BatchShape:
    """One micro-batch as the collator pads it: samples x tokens, plus every image's patch grid."""

    samples: int
    tokens: int
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    # positions per sample whose logits the loss needs (the most labelled tokens in a sample); None: all of them
    labelled: int | None = None

    @property
    def logit_positions(self) -> int:
        return self.tokens if self.labelled is None else max(1, min(self.labelled, self.tokens))

    @property
    def patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    def describe(self) -> dict:
        return {"samples": self.samples, "tokens_per_sample": self.tokens, "images": len(self.grids),
                "image_patches": self.patches, "logit_positions_per_sample": self.logit_positions}


FUSED_ATTENTION = "vlft_memory_trace_fused"


@dataclass
class Activations:
    """Bytes autograd saves for one micro-batch, with and without checkpointing."""

    full: int
    checkpointed: int
    per_layer_max: int


def _register_fused_attention() -> None:
    """An attention function with the memory of a fused kernel (flash, efficient SDPA), for tracing.

    Fused kernels keep q, k, v, the output and a log-sum-exp per row for
    backward, never the S x S probabilities; on the meta device SDPA would
    fall back to its math path and count those.
    """

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = torch.empty_like(q)
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover - tracing never runs backward
            q, k, v, _, _ = ctx.saved_tensors
            return grad, torch.zeros_like(k), torch.zeros_like(v)

    def fused(module, query, key, value, attention_mask, **kwargs):
        if key.shape[1] != query.shape[1]:  # grouped-query attention: repeat k/v heads as kernels do internally
            reps = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(reps, 1), value.repeat_interleave(reps, 1)
        return FusedAttention.apply(query, key, value).transpose(1, 2), None

    AttentionInterface.register(FUSED_ATTENTION, fused)


def skeleton(model_config, attention, dtype):
    """A weightless model on the meta device with the plan's attention per tower.

    Fused implementations (sdpa, flash) are traced with a stand-in that saves
    what a fused kernel saves; eager runs as it is.
    """


    _register_fused_attention()
    cfg = copy.deepcopy(model_config)

    def impl(name):
        return "eager" if name == "eager" else FUSED_ATTENTION

    impls = {"vision_config": impl(attention.vision), "text_config": impl(attention.text), "": impl(attention.text)}
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(cfg, attn_implementation=impls, dtype=dtype)


def _parts(model):
    """(vision tower, text model, lm_head) of a Qwen2-VL-style model, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    visual = next((m for m in base.modules() if hasattr(m, "blocks") and hasattr(m, "merger")), None)
    text = next(m for m in base.modules() if hasattr(m, "layers") and hasattr(m, "rotary_emb") and hasattr(m, "norm"))
    return visual, text, base.lm_head


def _trainable(module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _vision_seqlens(visual, grid):
    """(full-attention, window-attention) cumulative sequence lengths for ``grid``, as the tower makes them."""

    per_image = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    cu = torch.nn.functional.pad(per_image.cumsum(0, dtype=torch.int32), (1, 0))
    try:  # transformers >= 5.2x: a shared helper

        _, cu_window = get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                               window_size=visual.window_size, patch_size=visual.patch_size)
    except ImportError:  # earlier 5.x: a method of the tower
        _, cu_window = visual.get_window_index(grid)
    cu_window = torch.unique_consecutive(torch.as_tensor(cu_window, dtype=torch.int32))
    return cu, cu_window


def trace_activations(model, batch: BatchShape) -> Activations:
    """Run the adapted meta model's layers once on ``batch``'s shapes and count what autograd saves."""


    visual, text, lm_head = _parts(model)
    dtype = next(text.parameters()).dtype
    meter = SavedTensorMeter(model)
    inputs: list[int] = []  # per participating layer: bytes a checkpoint keeps (its input)
    layer_max = 0
    grad = False

    def run_layer(layer, fn):
        nonlocal grad, layer_max
        grad = grad or _trainable(layer)
        before = meter.bytes
        out = fn()
        if grad:
            layer_max = max(layer_max, meter.bytes - before)
        return out

    with meter.hooks():
        image_features = None
        if visual is not None and batch.grids:
            vc = visual.config
            cu, cu_window = _vision_seqlens(visual, torch.tensor(batch.grids))
            hidden = torch.empty(batch.patches, vc.hidden_size, device="meta", dtype=dtype)
            pos = torch.zeros(batch.patches, 2, dtype=torch.long, device="meta")
            pe = visual.rotary_pos_emb(hidden, pos)
            for i, block in enumerate(visual.blocks):
                seqlens = cu if i in visual.fullatt_block_indexes else cu_window
                if grad or _trainable(block):
                    inputs.append(hidden.numel() * hidden.element_size())
                hidden = run_layer(block, lambda b=block, h=hidden, s=seqlens: b(h, cu_seqlens=s,
                                                                                  position_embeddings=pe))
            image_features = run_layer(visual.merger, lambda h=hidden: visual.merger(h))
        hidden = torch.empty(batch.samples, batch.tokens, text.config.hidden_size, device="meta", dtype=dtype)
        if image_features is not None and image_features.requires_grad:
            hidden.requires_grad_(True)  # adapted vision: its features flow into the text model's input
        pos = torch.zeros(3, batch.samples, batch.tokens, dtype=torch.long, device="meta")
        pe = text.rotary_emb(hidden, pos)
        for layer in text.layers:
            if grad or _trainable(layer):
                inputs.append(hidden.numel() * hidden.element_size())
            hidden = run_layer(layer, lambda lay=layer, h=hidden: lay(h, attention_mask=None, position_embeddings=pe))
        # the head runs at the labelled positions only (``models.loss.batch_loss_sum``)
        kept = batch.logit_positions
        labels = torch.zeros(batch.samples, kept, dtype=torch.long, device="meta")
        head_before = meter.bytes
        normed = text.norm(hidden)
        if kept < batch.tokens:
            normed = torch.take_along_dim(normed, labels[..., None], dim=1)
        logits = lm_head(normed)
        kept_loss_sum(logits, labels)
        head = meter.bytes - head_before
    full = meter.bytes
    # non-reentrant checkpointing keeps each layer's input; backward recomputes one layer at a time
    checkpointed = sum(inputs) + layer_max + head
    return Activations(full=full, checkpointed=min(full, checkpointed), per_layer_max=layer_max)
