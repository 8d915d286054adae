"""The memory plan: will the run fit its device? Answered before a weight is loaded.

Peak memory per process is estimated as

    base weights (per tower, at the parameter dtype)
  + adapter weights, gradients and AdamW state (fp32)
  + activations autograd keeps for backward, for the largest batch the run will draw
  + the logits' working set (the logits and their gradient, alive around the loss)
  + what the runtime reserves outside tensors (the backend's figure)

Activations are not guessed from a formula: every vision block, text decoder
layer, the merger and the head of the *adapted* model are run once on the
meta device (shapes only, no memory, no arithmetic) under
``saved_tensors_hooks``, so the estimate counts exactly the tensors autograd
would save for this architecture, attention implementation, adapter and
batch. Frozen layers before the first adapted one save nothing, as in a real
step. With activation checkpointing a layer keeps only its input, and one
layer at a time is recomputed during backward.

Measured against counted peaks on the CPU (``make bench``, memory group) the
estimate's error is stated in docs/memory-plan.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2 ** 30
HEADROOM = 0.05  # allocator fragmentation: plan to use at most 95% of the device
FUSED_ATTENTION = "vlft_memory_trace_fused"


def gib(n: int | float | None) -> str:
    """Bytes for a person: GiB from 1 GiB up, MiB below."""
    if n is None:
        return "unknown"
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2 ** 20:.1f} MiB"


@dataclass
class BatchShape:
    """One micro-batch as the collator pads it: samples x tokens, plus every image's patch grid."""

    samples: int
    tokens: int
    grids: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    def describe(self) -> dict:
        return {"samples": self.samples, "tokens_per_sample": self.tokens, "images": len(self.grids),
                "image_patches": self.patches}


@dataclass
class Activations:
    """Bytes autograd saves for one micro-batch, with and without checkpointing."""

    full: int
    checkpointed: int
    per_layer_max: int


@dataclass
class MemoryPlan:
    base_weights: dict[str, int]  # tower -> bytes
    base_dtype: str
    adapter_parameters: int
    adapter_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activations: Activations
    logits_bytes: int
    reserved_bytes: int
    batch: BatchShape
    checkpointing: bool = False
    checkpointing_reason: str = ""
    capacity_bytes: int | None = None
    capacity_source: str = ""
    fixes: list[str] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        return self.activations.checkpointed if self.checkpointing else self.activations.full

    def counted_bytes(self, checkpointing: bool | None = None) -> int:
        """Weights + adapter state + saved activations: what bench/ counts on the CPU."""
        ckpt = self.checkpointing if checkpointing is None else checkpointing
        act = self.activations.checkpointed if ckpt else self.activations.full
        return sum(self.base_weights.values()) + self.adapter_bytes + self.grad_bytes + self.optimizer_bytes + act

    def total_bytes(self, checkpointing: bool | None = None) -> int:
        return self.counted_bytes(checkpointing) + self.logits_bytes + self.reserved_bytes

    def fits(self, checkpointing: bool | None = None) -> bool | None:
        if self.capacity_bytes is None:
            return None
        return self.total_bytes(checkpointing) <= self.capacity_bytes * (1 - HEADROOM)

    def describe(self) -> dict:
        return {
            "base_weights_bytes": self.base_weights, "base_dtype": self.base_dtype,
            "adapter_parameters": self.adapter_parameters, "adapter_bytes": self.adapter_bytes,
            "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes, "activation_bytes_without_checkpointing": self.activations.full,
            "activation_bytes_with_checkpointing": self.activations.checkpointed,
            "logits_bytes": self.logits_bytes, "reserved_bytes": self.reserved_bytes,
            "batch": self.batch.describe(), "checkpointing": self.checkpointing,
            "estimate_bytes": self.total_bytes(), "capacity_bytes": self.capacity_bytes,
            "capacity_source": self.capacity_source, "usable_fraction": 1 - HEADROOM, "fits": self.fits(),
            "fixes": self.fixes,
        }

    def format(self) -> list[str]:
        return format_memory(self.describe())


def format_memory(d: dict) -> list[str]:
    """The plan's memory lines, from ``MemoryPlan.describe()`` (so dry-run JSON and text agree)."""
    w, batch = d["base_weights_bytes"], d["batch"]
    verdict = {True: "fits", False: "DOES NOT FIT", None: "capacity unknown (pass --device-memory)"}[d["fits"]]
    adapter = d["adapter_bytes"] + d["grad_bytes"] + d["optimizer_bytes"]
    lines = [
        f"memory       {gib(d['estimate_bytes'])} estimated per process; device {gib(d['capacity_bytes'])} "
        f"({d['capacity_source']}), {d['usable_fraction']:.0%} usable: {verdict}",
        f"             base weights {d['base_dtype']}: vision {gib(w.get('vision', 0))}, text {gib(w.get('text', 0))}",
        f"             adapter {d['adapter_parameters']:,} params, fp32 weights + grads + AdamW: {gib(adapter)}",
        f"             activations {gib(d['activation_bytes'])} (checkpointing {'on' if d['checkpointing'] else 'off'}; "
        f"on {gib(d['activation_bytes_with_checkpointing'])}, off {gib(d['activation_bytes_without_checkpointing'])})"
        f" for the largest batch: {batch['samples']} x {batch['tokens_per_sample']} tokens, "
        f"{batch['image_patches']} image patches",
        f"             logits {gib(d['logits_bytes'])}, runtime reserve {gib(d['reserved_bytes'])}",
    ]
    return lines + [f"fix          {f}" for f in d["fixes"]]


# -- counting what autograd saves -----------------------------------------------------------------

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


def _register_fused_attention() -> None:
    """An attention function with the memory of a fused kernel (flash, efficient SDPA), for tracing.

    Fused kernels keep q, k, v, the output and a log-sum-exp per row for
    backward, never the S x S probabilities; on the meta device SDPA would
    fall back to its math path and count those.
    """
    import torch
    from transformers import AttentionInterface

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
    import copy

    import torch
    from transformers import AutoModelForImageTextToText

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
    import torch

    per_image = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    cu = torch.nn.functional.pad(per_image.cumsum(0, dtype=torch.int32), (1, 0))
    try:  # transformers >= 5.2x: a shared helper
        from transformers.vision_utils import get_vision_window_index

        _, cu_window = get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                               window_size=visual.window_size, patch_size=visual.patch_size)
    except ImportError:  # earlier 5.x: a method of the tower
        _, cu_window = visual.get_window_index(grid)
    cu_window = torch.unique_consecutive(torch.as_tensor(cu_window, dtype=torch.int32))
    return cu, cu_window


def trace_activations(model, batch: BatchShape) -> Activations:
    """Run the adapted meta model's layers once on ``batch``'s shapes and count what autograd saves."""
    import torch

    from .train import token_loss_sum

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
        labels = torch.zeros(batch.samples, batch.tokens, dtype=torch.long, device="meta")
        head_before = meter.bytes
        logits = lm_head(text.norm(hidden))
        token_loss_sum(logits, labels)
        head = meter.bytes - head_before
    full = meter.bytes
    # non-reentrant checkpointing keeps each layer's input; backward recomputes one layer at a time
    checkpointed = sum(inputs) + layer_max + head
    return Activations(full=full, checkpointed=min(full, checkpointed), per_layer_max=layer_max)


def weight_bytes(model, param_dtype) -> tuple[dict[str, int], int]:
    """(frozen base bytes per tower at ``param_dtype``, trainable parameter count)."""
    import torch

    itemsize = torch.empty((), dtype=param_dtype).element_size()
    towers = {"vision": 0, "text": 0}
    trainable = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            towers["vision" if ".visual." in f".{name}" else "text"] += p.numel() * itemsize
    return towers, trainable


def plan_memory(model, model_config, param_dtype: str, compute_dtype: str | None, batch: BatchShape,
                reserved_bytes: int, capacity_bytes: int | None, capacity_source: str) -> MemoryPlan:
    """The plan for ``model`` (adapted, on the meta device) at ``batch``; checkpointing still undecided."""
    import torch

    pdtype = getattr(torch, param_dtype)
    towers, trainable = weight_bytes(model, pdtype)
    acts = trace_activations(model, batch)
    vocab = model_config.text_config.vocab_size if hasattr(model_config, "text_config") else model_config.vocab_size
    logit_itemsize = torch.empty((), dtype=getattr(torch, compute_dtype or param_dtype)).element_size()
    # the logits stay alive through backward, and their fp32 gradient is made there
    logits = batch.samples * batch.tokens * vocab * (logit_itemsize + 4)
    return MemoryPlan(
        base_weights=towers, base_dtype=param_dtype, adapter_parameters=trainable, adapter_bytes=4 * trainable,
        grad_bytes=4 * trainable, optimizer_bytes=8 * trainable, activations=acts, logits_bytes=logits,
        reserved_bytes=reserved_bytes, batch=batch, capacity_bytes=capacity_bytes, capacity_source=capacity_source,
    )


# -- which batch is the largest --------------------------------------------------------------------

def largest_batches(lengths: list[int], grids: list[list], batch_size: int, grad_accum: int, world_size: int,
                    seed: int, total_steps: int) -> list[BatchShape]:
    """The micro-batches with the most padded tokens and with the most image patches, over every
    process and every step the run will take (the sampler is seeded, so this is exact)."""
    from .train import EpochSampler, steps_per_epoch

    n = len(lengths)
    per_epoch = steps_per_epoch(n, batch_size, grad_accum, world_size)
    epochs = min(math.ceil(total_steps / per_epoch), 64)  # beyond a few epochs no new batch shapes appear
    best_tokens: BatchShape | None = None
    best_patches: BatchShape | None = None
    for epoch in range(epochs):
        for rank in range(world_size):
            order = EpochSampler(n, seed, epoch, rank, world_size).indices()
            usable = min(len(order) // batch_size, per_epoch * grad_accum) * batch_size
            for i in range(0, usable, batch_size):
                idx = order[i:i + batch_size]
                shape = BatchShape(len(idx), max(lengths[j] for j in idx), [g for j in idx for g in grids[j]])
                if best_tokens is None or shape.samples * shape.tokens > best_tokens.samples * best_tokens.tokens:
                    best_tokens = shape
                if best_patches is None or shape.patches > best_patches.patches:
                    best_patches = shape
    if best_tokens is None:  # fewer samples than one batch: the whole set is the batch
        best_tokens = BatchShape(n, max(lengths), [g for gs in grids for g in gs])
    return [best_tokens] if best_patches is None or best_patches is best_tokens else [best_tokens, best_patches]


def worst_plan(model, model_config, param_dtype, compute_dtype, shapes: list[BatchShape], reserved: int,
               capacity: int | None, source: str) -> MemoryPlan:
    plans = [plan_memory(model, model_config, param_dtype, compute_dtype, s, reserved, capacity, source)
             for s in shapes]
    return max(plans, key=lambda p: p.total_bytes(False))


def resized_grids(grids, max_pixels: int, patch: int = 14, merge: int = 2):
    """Patch grids after capping each image at ``max_pixels`` (as ``--max-pixels`` would)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    out = []
    for t, h, w in grids:
        nh, nw = smart_resize(h * patch, w * patch, patch * merge, min_pixels=min(56 * 56, max_pixels),
                              max_pixels=max_pixels)
        out.append((t, nh // patch, nw // patch))
    return out


def decide(plan: MemoryPlan, asked: str, model, model_config, compute_dtype, batch_size: int, grad_accum: int,
           max_pixels: int | None) -> None:
    """Settle checkpointing (``asked``: on, off, auto) and, when the run does not fit, list what would."""
    if asked == "on":
        plan.checkpointing, plan.checkpointing_reason = True, "on, as asked"
    elif asked == "off":
        plan.checkpointing, plan.checkpointing_reason = False, "off, as asked"
    elif plan.capacity_bytes is None:
        plan.checkpointing, plan.checkpointing_reason = False, "auto: off (device memory unknown here)"
    elif plan.fits(False):
        plan.checkpointing, plan.checkpointing_reason = False, "auto: off (the run fits without it)"
    else:
        plan.checkpointing = True
        plan.checkpointing_reason = (f"auto: on (without it {gib(plan.total_bytes(False))} would not fit "
                                     f"{gib(plan.capacity_bytes)})")
    if plan.fits() is not False:
        return
    usable = plan.capacity_bytes * (1 - HEADROOM)
    fixes: list[str] = []
    if not plan.checkpointing:
        fixes.append(f"--grad-checkpointing on: {gib(plan.total_bytes(True))}"
                     + (" (fits)" if plan.total_bytes(True) <= usable else ""))
    if plan.base_dtype == "float32":
        half = plan.total_bytes() - sum(plan.base_weights.values()) // 2
        fixes.append(f"--param-dtype bf16 (fp16 where bf16 is not native): about {gib(half)}"
                     + (" (fits)" if half <= usable else ""))
    ckpt = plan.checkpointing or asked == "auto"
    b = plan.batch.samples
    while b > 1:
        b //= 2
        per = len(plan.batch.grids) / max(plan.batch.samples, 1)
        shape = BatchShape(b, plan.batch.tokens, plan.batch.grids[: round(per * b)])
        smaller = plan_memory(model, model_config, plan.base_dtype, compute_dtype, shape, plan.reserved_bytes,
                              plan.capacity_bytes, plan.capacity_source)
        if smaller.total_bytes(ckpt) <= usable or b == 1:
            accum = grad_accum * batch_size // b
            fixes.append(f"--batch-size {b} --grad-accum {accum} (same samples per step"
                         + (", with checkpointing" if ckpt else "") + f"): {gib(smaller.total_bytes(ckpt))}"
                         + (" (fits)" if smaller.total_bytes(ckpt) <= usable else ""))
            break
    target = 448 * 448
    if plan.batch.patches and (max_pixels is None or max_pixels > target) and \
            any(h * w * 196 > target for _, h, w in plan.batch.grids):
        shape = BatchShape(plan.batch.samples, plan.batch.tokens, resized_grids(plan.batch.grids, target))
        shape.tokens = max(1, plan.batch.tokens - (plan.batch.patches - shape.patches) // 4 // plan.batch.samples)
        capped = plan_memory(model, model_config, plan.base_dtype, compute_dtype, shape, plan.reserved_bytes,
                             plan.capacity_bytes, plan.capacity_source)
        fixes.append(f"--max-pixels {target} (448x448 images): about {gib(capped.total_bytes(ckpt))}"
                     + (" (fits)" if capped.total_bytes(ckpt) <= usable else ""))
    fixes.append("--max-length N with --skip-too-long (leave out the longest samples), or fewer targets "
                 "(--targets text, a smaller --vision-last-n)")
    plan.fixes = fixes


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
        self.live: dict[int, tuple[object, int]] = {}
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
