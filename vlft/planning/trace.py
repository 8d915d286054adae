"""Counting activation memory: what autograd saves for backward, for the memory plan.

``trace_activations`` runs every layer of an adapted model once on the meta
device (shapes only: no memory, no arithmetic) under ``saved_tensors_hooks``
and counts what autograd would keep. ``BatchShape`` (one micro-batch's
samples, tokens and image grids) is what it traces; the memory plan asks it
for the largest ones the sampler will draw.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface, AutoModelForImageTextToText
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vlft.measure import SavedTensorMeter
from vlft.models.families import base_model, resolve_module
from vlft.models.loss import kept_loss_sum
from vlft.models.segments import eager_attention

if TYPE_CHECKING:
    from vlft.planning.trace import BatchShape


@dataclass
class BatchShape:
    """One micro-batch as the collator pads it: samples x tokens, plus every image's patch grid (a packed one
    is planned as padded: ``memory.largest_batches``)."""

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
        return {
            "samples": self.samples,
            "tokens_per_sample": self.tokens,
            "images": len(self.grids),
            "image_patches": self.patches,
            "logit_positions_per_sample": self.logit_positions,
        }


FUSED_ATTENTION = "vlft_memory_trace_fused"
SPLIT_TRACE = "vlft_memory_trace_split"


@dataclass
class Activations:
    """Bytes autograd saves for one micro-batch, with and without checkpointing."""

    full: int
    checkpointed: int
    per_layer_max: int
    untraced: list = field(default_factory=list)  # what could not be traced (counted as 0), in words
    # backward's working space beyond what is saved: the gradient of a layer's largest saved tensor (eager
    # attention: the [B, heads, T, T] gradient of the probabilities, then of the scores, both alive at once,
    # while backward has freed part of what the layer saved). One such tensor is what the bench measures:
    # worst estimate/measured over its four models, fp32/bf16, checkpointing on/off: 0.62 without it (tiny
    # Qwen3-VL, where attention over 270 tokens dwarfs a 64-wide hidden state), 1.27 with two, 0.83 with one
    backward_transient: int = 0


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


META_EXPERTS = "vlft_memory_trace_experts"


def _register_meta_experts() -> None:
    """A fused-experts function for the meta device, where transformers' eager per-expert loop cannot run
    (it asks which experts got tokens: ``nonzero`` has no meta kernel). It routes every (token, slot) pair
    through one expert's weights, so it saves what the loop saves summed over experts: per pair the input
    row, the gate/up projections and the activation (tokens x top-k rows in all)."""
    # only when a MoE plan traces its experts
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    def per_pair(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.size(-1)
        rows = hidden_states.repeat_interleave(k, dim=0)

        def linear(x, weight):
            return x @ weight[0] if getattr(self, "is_transposed", False) else torch.nn.functional.linear(x, weight[0])

        if getattr(self, "has_gate", True):
            mid = linear(rows, self.gate_up_proj)
            mid = (
                self._apply_gate(mid)
                if hasattr(self, "_apply_gate")
                else self.act_fn(mid.chunk(2, -1)[0]) * mid.chunk(2, -1)[1]
            )
        else:
            mid = self.act_fn(linear(rows, self.up_proj))
        out = linear(mid, self.down_proj) * top_k_weights.reshape(-1, 1).to(mid.dtype)
        return out.view(-1, k, out.size(-1)).sum(dim=1).to(hidden_states.dtype)

    ALL_EXPERTS_FUNCTIONS.register(META_EXPERTS, per_pair)


def skeleton(model_config, attention, dtype, load_kwargs=None):
    """A weightless model on the meta device with the plan's attention per tower (and the family's
    ``load_kwargs`` for the run's parameter dtype, so it runs the experts implementation the run does).

    Fused implementations (sdpa, flash) are traced with a stand-in that saves
    what a fused kernel saves; eager runs as it is.
    """

    _register_fused_attention()
    cfg = copy.deepcopy(model_config)

    def impl(name):
        return "eager" if name == "eager" else FUSED_ATTENTION

    impls = {"vision_config": impl(attention.vision), "text_config": impl(attention.text), "": impl(attention.text)}
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            cfg, attn_implementation=impls, dtype=dtype, **(load_kwargs or {})
        )
    if (load_kwargs or {}).get("experts_implementation") == "eager":  # the eager loop has no meta kernel
        _register_meta_experts()
        model.set_experts_implementation(META_EXPERTS)
    return model


def _parts(model, family):
    """(vision tower or None, text model, lm_head), by the family's paths, PEFT-wrapped or not."""
    base = base_model(model)
    tower = resolve_module(base, family.towers.vision) if family.towers.vision else None
    text = resolve_module(base, family.towers.decoder_layers.rpartition(".")[0])
    return tower, text, resolve_module(base, family.towers.lm_head)


def _trainable(module) -> bool:
    return any(p.requires_grad for p in module.parameters())


@contextlib.contextmanager
def _split_attention(text, n: int):
    """The text model's attention as each process of a sequence split runs it, for tracing: the chunk's
    ``[B, H, L/N, D]`` queries, keys and values viewed as ``[B, H/N, L, D]`` (what the all-to-all gives it) and
    attended with the traced implementation, the output viewed back."""
    underlying = text.config._attn_implementation

    def attend(module, query, key, value, attention_mask, **kwargs):
        inner = eager_attention(module) if underlying == "eager" else ALL_ATTENTION_FUNCTIONS[underlying]
        b, h, t, d = query.shape
        q, k, v = (x.reshape(b, x.shape[1] // n, t * n, d) for x in (query, key, value))
        out, _ = inner(module, q, k, v, None, **kwargs)
        return out.reshape(b, t, h, d), None

    AttentionInterface.register(SPLIT_TRACE, attend)
    text.config._attn_implementation_internal = SPLIT_TRACE  # this config alone (not a vision sub-config)
    try:
        yield
    finally:
        text.config._attn_implementation_internal = underlying


@contextlib.contextmanager
def _autocast_accepts_meta():
    """``torch.autocast(device_type="meta", ...)`` raises ("unsupported scalarType"); PEFT's LoRA on fused expert
    weights (``target_parameters``) opens a disabled one around its weight update W + s*B@A, which on the meta
    device means nothing. For the trace only, a meta autocast is a no-op; every other device type is torch's."""
    real = torch.autocast

    def autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *args, **kwargs)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = real


def _position_embeddings(text, hidden, pos) -> list:
    """Each decoder layer's rotary (cos, sin), as the text model computes them: one table for all layers, or
    (transformers' convention for models whose rotary forward takes a ``layer_type``: sliding and full attention
    with their own rope parameters) one per ``config.layer_types`` entry."""
    rotary = text.rotary_emb
    n = len(text.layers)
    if "layer_type" not in inspect.signature(type(rotary).forward).parameters:
        pe = rotary(hidden, pos)
        return [pe] * n
    types = list(text.config.layer_types)
    tables = {t: rotary(hidden, pos, t) for t in set(types)}
    return [tables[t] for t in types[:n]]


def _untraceable_text(text) -> str:
    """Why the text model is not the decoder layout the tracer runs (``layers``, ``rotary_emb``, ``norm``), or
    "" where it is."""
    missing = [
        name for name in ("layers", "rotary_emb", "norm") if not isinstance(getattr(text, name, None), torch.nn.Module)
    ]
    if not missing:
        return ""
    return f"text activations ({type(text).__name__} has no {', '.join(missing)}: not the decoder layout traced)"


def trace_activations(model, batch: BatchShape, family, sequence: int = 1) -> Activations:
    """Run the adapted meta model's layers once on ``batch``'s shapes and count what autograd saves.

    ``sequence`` (``--sequence-parallel``): each process runs the text layers on 1/N of a sample's tokens and
    attends with 1/N of the heads over all of them (the vision tower and the head on all of them): the text
    layers are traced on 1/N of the tokens, their attention on the same tensors viewed as 1/N of the heads over
    every token (``_split_attention``: the shapes are what count here, and eager's ``[heads/N, L, L]`` scores
    are N times a chunk's own).

    The vision tower runs through the family's ``trace_vision`` (a family without one: its vision
    activations are not counted, and ``Activations.untraced`` says so); the text layers and the head run
    here, with 3-row positions where the family has a multimodal rope index."""

    tower, text, lm_head = _parts(model, family)
    dtype = next(text.parameters()).dtype
    meter = SavedTensorMeter(model)
    inputs: list[int] = []  # per participating layer: bytes a checkpoint keeps (its input)
    untraced: list[str] = []
    layer_max = 0
    largest_saved = 0  # the largest single tensor a layer on the gradient's path saves
    grad = False

    def run_layer(layer, fn):
        nonlocal grad, layer_max, largest_saved
        grad = grad or _trainable(layer)
        before, seen = meter.bytes, len(meter.storages)
        out = fn()
        if grad:
            layer_max = max(layer_max, meter.bytes - before)
            # the meter's dict keeps insertion order: this layer's storages are the ones after ``seen``
            largest_saved = max([largest_saved, *itertools.islice(meter.storages.values(), seen, None)])
        return out

    with meter.hooks(), _autocast_accepts_meta(), contextlib.ExitStack() as stack:
        image_features = None
        blocks = (
            set(map(id, resolve_module(base_model(model), family.towers.vision_blocks))) if tower is not None else set()
        )

        def run_vision(module, fn, block_input=None):
            """The tracer's wrapper per block/merger; a block's input is what a checkpoint keeps."""
            if block_input is not None and id(module) in blocks and (grad or _trainable(module)):
                inputs.append(block_input.numel() * block_input.element_size())
            return run_layer(module, fn)

        if tower is not None and batch.grids:
            trace_vision = family.image_inputs.trace if family.image_inputs is not None else None
            if trace_vision is None:
                untraced.append(f"vision activations of the {family.name} family (it gives no tracer)")
            else:
                image_features = family.call("image_inputs.trace", trace_vision, tower, batch.grids, dtype, run_vision)
        head = 0
        unrun = _untraceable_text(text)
        if unrun:  # a text model of another layout (a checkpoint read generically): said, counted as 0
            untraced.append(unrun)
        else:
            try:
                tokens = -(-batch.tokens // sequence)
                hidden = torch.empty(batch.samples, tokens, text.config.hidden_size, device="meta", dtype=dtype)
                if image_features is not None and image_features.requires_grad:
                    hidden.requires_grad_(True)  # adapted vision: its features flow into the text model's input
                rows = (family.positions.rows,) if family.positions is not None else ()
                pos = torch.zeros(*rows, batch.samples, tokens, dtype=torch.long, device="meta")
                pes = _position_embeddings(text, hidden, pos)
                if sequence > 1:
                    stack.enter_context(_split_attention(text, sequence))
                extra = (
                    family.call("trace_layer_kwargs", family.trace_layer_kwargs, text, hidden)
                    if family.trace_layer_kwargs is not None
                    else {}
                )
                for i, layer in enumerate(text.layers):
                    if grad or _trainable(layer):
                        inputs.append(hidden.numel() * hidden.element_size())
                    pe = pes[i]
                    hidden = run_layer(
                        layer,
                        lambda lay=layer, h=hidden, pe=pe: lay(h, attention_mask=None, position_embeddings=pe, **extra),
                    )
                # the head runs at the labelled positions only (``models.loss.batch_loss_sum``)
                kept = batch.logit_positions
                labels = torch.zeros(batch.samples, kept, dtype=torch.long, device="meta")
                head_before = meter.bytes
                normed = text.norm(hidden)
                if sequence > 1:  # the chunks gathered: the head reads the whole row
                    normed = torch.cat([normed] * sequence, dim=1)[:, : batch.tokens]
                if kept < batch.tokens:
                    normed = torch.take_along_dim(normed, labels[..., None], dim=1)
                logits = lm_head(normed)
                kept_loss_sum(logits, labels)
                head = meter.bytes - head_before
            except (RuntimeError, TypeError, ValueError) as e:  # a layer that wants more than the tracer gives
                untraced.append(f"text activations (a decoder layer did not run on the tracer's meta inputs: "
                                f"{type(e).__name__}: {str(e).splitlines()[0][:160]})")  # fmt: skip
                head = 0
    full = meter.bytes
    # non-reentrant checkpointing keeps each layer's input; backward recomputes one layer at a time
    checkpointed = sum(inputs) + layer_max + head
    return Activations(
        full=full,
        checkpointed=min(full, checkpointed),
        per_layer_max=layer_max,
        untraced=untraced,
        backward_transient=largest_saved,
    )
