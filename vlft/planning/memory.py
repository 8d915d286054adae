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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlft.data.order import DataOrder, run_micro_batches
from vlft.models.families import base_model
from vlft.planning.sharding import working_set_bytes
from vlft.planning.trace import Activations, BatchShape, trace_activations

GIB = 2**30


HEADROOM = 0.05  # allocator fragmentation: plan to use at most 95% of the device


def gib(n: int | float | None) -> str:
    """Bytes for a person: GiB from 1 GiB up, MiB below."""
    if n is None:
        return "unknown"
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


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
    shard_world: int = 1  # --shard fsdp: base weights, adapter, grads and AdamW state split over this many
    gathered_bytes: int = 0  # --shard fsdp: parameters gathered whole at a time (root + two blocks)
    guard_copy_bytes: int = 0  # the non-finite guard's copy of the adapter and its AdamW state (no fused AdamW)
    reference_bytes: int = 0  # a preference objective's reference: the --init-adapter weights it keeps (fp32)
    # an objective that generates in the step (GRPO): the KV cache of its sampled sequences (every layer's keys
    # and values for the largest micro-batch's prompts x G, prompt + new tokens long) and the last position's
    # logits. Generation runs without gradients before the trained pass and its cache is gone when that starts,
    # so the peak holds the larger of the two working sets, not their sum
    generation_bytes: int = 0
    generation_shape: str = ""
    sequence_split: int = 1  # --sequence-parallel: the text model's activations are each process's 1/N of a sample
    # --offload cpu: the shares of the base weights and of the adapter's weights, gradients and AdamW state
    # live in host memory (FSDP2 CPUOffloadPolicy), not the device's
    offload: bool = False

    def per_process(self, n: int) -> int:
        """``n`` bytes of sharded state as one process holds them."""
        return math.ceil(n / self.shard_world)

    @property
    def base_bytes_per_process(self) -> int:
        return self.per_process(sum(self.base_weights.values()))

    @property
    def adapter_state_bytes_per_process(self) -> int:
        return self.per_process(
            self.adapter_bytes + self.grad_bytes + self.optimizer_bytes + self.guard_copy_bytes + self.reference_bytes
        )

    @property
    def activation_bytes(self) -> int:
        return self.activations.checkpointed if self.checkpointing else self.activations.full

    @property
    def host_bytes_per_process(self) -> int:
        """What ``--offload cpu`` keeps in each process's host memory: its shares of the base weights and of the
        adapter's weights, gradients and AdamW state."""
        return self.base_bytes_per_process + self.adapter_state_bytes_per_process

    def counted_bytes(self, checkpointing: bool | None = None) -> int:
        """Weights + adapter state + saved activations: what bench/ counts on the CPU (on the device: without
        the shares ``--offload cpu`` keeps on the host)."""
        ckpt = self.checkpointing if checkpointing is None else checkpointing
        act = self.activations.checkpointed if ckpt else self.activations.full
        held = 0 if self.offload else self.host_bytes_per_process
        return held + self.gathered_bytes + act

    def total_bytes(self, checkpointing: bool | None = None) -> int:
        ckpt = self.checkpointing if checkpointing is None else checkpointing
        act = self.activations.checkpointed if ckpt else self.activations.full
        training = act + self.activations.backward_transient + self.logits_bytes
        return self.counted_bytes(checkpointing) - act + max(training, self.generation_bytes) + self.reserved_bytes

    def fits(self, checkpointing: bool | None = None) -> bool | None:
        if self.capacity_bytes is None:
            return None
        return self.total_bytes(checkpointing) <= self.capacity_bytes * (1 - HEADROOM)

    def describe(self) -> dict:
        return {
            "base_weights_bytes": self.base_weights,
            "base_dtype": self.base_dtype,
            "adapter_parameters": self.adapter_parameters,
            "adapter_bytes": self.adapter_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "guard_copy_bytes": self.guard_copy_bytes,
            "reference_bytes": self.reference_bytes,
            "activation_bytes": self.activation_bytes,
            "activation_bytes_without_checkpointing": self.activations.full,
            "activation_bytes_with_checkpointing": self.activations.checkpointed,
            "backward_transient_bytes": self.activations.backward_transient,
            "logits_bytes": self.logits_bytes,
            "reserved_bytes": self.reserved_bytes,
            "batch": self.batch.describe(),
            "checkpointing": self.checkpointing,
            "estimate_bytes": self.total_bytes(),
            "capacity_bytes": self.capacity_bytes,
            "capacity_source": self.capacity_source,
            "usable_fraction": 1 - HEADROOM,
            "fits": self.fits(),
            "fixes": self.fixes,
            "sharded_over": self.shard_world,
            "sequence_split": self.sequence_split,
            "gathered_bytes": self.gathered_bytes,
            "base_bytes_per_process": self.base_bytes_per_process,
            "adapter_state_bytes_per_process": self.adapter_state_bytes_per_process,
            **({"offload": "cpu", "host_bytes_per_process": self.host_bytes_per_process} if self.offload else {}),
            **(
                {"generation_bytes": self.generation_bytes, "generation_shape": self.generation_shape}
                if self.generation_bytes
                else {}
            ),
        }

    def format(self) -> list[str]:
        return format_memory(self.describe())


def format_memory(d: dict) -> list[str]:
    """The plan's memory lines, from ``MemoryPlan.describe()`` (so dry-run JSON and text agree)."""
    w, batch = d["base_weights_bytes"], d["batch"]
    verdict = {True: "fits", False: "DOES NOT FIT", None: "capacity unknown (pass --device-memory)"}[d["fits"]]
    adapter = (
        d["adapter_bytes"]
        + d["grad_bytes"]
        + d["optimizer_bytes"]
        + d.get("guard_copy_bytes", 0)
        + d.get("reference_bytes", 0)
    )
    world = d.get("sharded_over", 1)
    lines = [
        f"memory       {gib(d['estimate_bytes'])} estimated per process; device {gib(d['capacity_bytes'])} "
        f"({d['capacity_source']}), {d['usable_fraction']:.0%} usable: {verdict}",
        f"             base weights {d['base_dtype']}: {gib(sum(w.values()))} (vision {gib(w.get('vision', 0))}, "
        f"text {gib(w.get('text', 0))})"
        + (f"; sharded over {world} processes: {gib(d['base_bytes_per_process'])} each" if world > 1 else ""),
        f"             adapter {d['adapter_parameters']:,} params, fp32 weights + grads + AdamW"
        + (" + the guard's copy" if d.get("guard_copy_bytes") else "")
        + (" + the reference's copy" if d.get("reference_bytes") else "")
        + f": {gib(adapter)}"
        + (f"; {gib(d['adapter_state_bytes_per_process'])} each" if world > 1 else ""),
    ]
    if world > 1:
        lines.append(
            f"             gathered whole at a time (the root's parameters + 2 blocks): {gib(d['gathered_bytes'])}"
        )
    if d.get("offload"):
        lines.append(
            f"             --offload cpu: the shares of the base weights and of the adapter's state on the host, "
            f"{gib(d['host_bytes_per_process'])} per process, not counted on the device; cost: every block copied "
            "host to device each forward and backward, gradients back, the AdamW step on the host"
        )
    lines += [
        f"             activations {gib(d['activation_bytes'])} (checkpointing {'on' if d['checkpointing'] else 'off'}; "
        f"on {gib(d['activation_bytes_with_checkpointing'])}, off {gib(d['activation_bytes_without_checkpointing'])})"
        f" for the largest batch: {batch['samples']} x {batch['tokens_per_sample']} tokens, "
        f"{batch['image_patches']} image patches"
        + (
            f" (per process: the text model on 1/{d['sequence_split']} of the tokens, --sequence-parallel)"
            if d.get("sequence_split", 1) > 1
            else ""
        ),
        f"             backward working space {gib(d.get('backward_transient_bytes', 0))}, logits "
        f"{gib(d['logits_bytes'])}, runtime reserve {gib(d['reserved_bytes'])}",
    ]
    if d.get("generation_bytes"):
        lines.append(
            f"             generation (before the trained pass, not beside it): KV cache + last logits "
            f"{gib(d['generation_bytes'])} for {d['generation_shape']}"
        )
    return lines + [f"fix          {f}" for f in d["fixes"]]


def generation_bytes(model_config, dtype: str, sequences: int, tokens: int) -> int:
    """Sampling ``sequences`` sequences of up to ``tokens`` tokens with the KV cache: every text layer's keys and
    values (``dtype``), and the fp32 logits of the last position of each."""
    text = getattr(model_config, "text_config", None) or model_config
    layers = text.num_hidden_layers
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * layers * heads * head_dim * size * sequences * tokens + 4 * sequences * text.vocab_size


NF4_BLOCK = 64  # weights per absmax constant (bitsandbytes' 4-bit blocksize)
NF4_DQ_BLOCK = 256  # absmax constants per fp32 constant of the second level (double quantization)


def four_bit_bytes(n: int, double_quant: bool) -> int:
    """Bytes of one NF4-quantized weight of ``n`` elements, as bitsandbytes stores it: two weights per byte, an
    fp32 absmax per 64-block (double quantization: a uint8 one, plus an fp32 per 256 of those, its 256-entry
    code and an offset), and the 16-entry NF4 code. Equal to the stored tensors (tested where it runs)."""
    blocks = math.ceil(n / NF4_BLOCK)
    packed = math.ceil(n / 2) + 16 * 4
    if not double_quant:
        return packed + 4 * blocks
    return packed + blocks + 4 * math.ceil(blocks / NF4_DQ_BLOCK) + 256 * 4 + 4


def quantized_weights(model, skip: tuple[str, ...]) -> set[int]:
    """ids of the weights ``--param-dtype nf4`` stores in 4-bit: every nn.Linear's, except under ``skip``
    (the head and the mergers, kept in bf16 as transformers' bitsandbytes loading is told)."""
    out = set()
    for name, module in base_model(model).named_modules():
        clean = name.replace(".base_layer", "")
        if isinstance(module, torch.nn.Linear) and not any(clean == s or clean.startswith(s + ".") for s in skip):
            out.add(id(module.weight))
    return out


def four_bit_skip(family) -> tuple[str, ...]:
    """What stays unquantized under nf4: the output head and the merger(s) (small; trained in full with
    --train-merger, which needs float weights)."""
    return (family.towers.lm_head, *family.towers.vision_mergers)


def weight_bytes(
    model, param_dtype, family, quantization: str | None = None, double_quant: bool = False
) -> tuple[dict[str, int], int]:
    """(frozen base bytes per tower at ``param_dtype``, trainable parameter count); the vision side is what
    the family's vision tower and projectors hold. ``quantization`` "nf4": linear weights at 4 bits with
    their constants (``four_bit_bytes``)."""

    itemsize = torch.empty((), dtype=param_dtype).element_size()
    towers = {"vision": 0, "text": 0}
    trainable = 0
    roots = tuple(r + "." for r in family.vision_side() if r)
    four_bit = quantized_weights(model, four_bit_skip(family)) if quantization == "nf4" else set()
    for name, p in base_model(model).named_parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            size = four_bit_bytes(p.numel(), double_quant) if id(p) in four_bit else p.numel() * itemsize
            towers["vision" if roots and name.startswith(roots) else "text"] += size
    return towers, trainable


@dataclass(frozen=True)
class MemoryBasis:
    """What a batch's memory plan is made from: the adapted model (on 'meta') and its config, the base weights'
    and the compute dtype, the device's capacity, and how the processes hold the model."""

    model: Any
    model_config: Any
    param_dtype: str
    compute_dtype: str | None
    family: Any  # the model's family (contracts.family.ModelFamily), resolved once at plan time
    reserved_bytes: int = 0
    capacity_bytes: int | None = None
    capacity_source: str = ""
    shard_world: int = 1  # > 1: sharded with FSDP over that many processes, ``gathered_bytes`` gathered at a time
    gathered_bytes: int = 0
    quantization: str | None = None
    double_quant: bool = False
    guard_copy: bool = False  # the adapter's weights and AdamW moments cloned before each step (``guarded_step``)
    sequence_split: int = 1  # --sequence-parallel N: each process runs the text layers on 1/N of a sample's tokens
    offload: bool = False  # --offload cpu: the shares on the host (``MemoryPlan.offload``)


def plan_memory(basis: MemoryBasis, batch: BatchShape) -> MemoryPlan:
    """The plan for ``basis.model`` at ``batch``; checkpointing still undecided."""

    model, param_dtype, compute_dtype = basis.model, basis.param_dtype, basis.compute_dtype
    pdtype = getattr(torch, param_dtype)
    family = basis.family
    towers, trainable = weight_bytes(model, pdtype, family, basis.quantization, basis.double_quant)
    acts = trace_activations(model, batch, family, basis.sequence_split)
    model_config = basis.model_config
    vocab = model_config.text_config.vocab_size if hasattr(model_config, "text_config") else model_config.vocab_size
    logit_itemsize = torch.empty((), dtype=getattr(torch, compute_dtype or param_dtype)).element_size()
    # the logits stay alive through backward, and their fp32 gradient is made there; the head runs at the
    # labelled positions only (``batch.logit_positions``)
    logits = batch.samples * batch.logit_positions * vocab * (logit_itemsize + 4)
    return MemoryPlan(
        base_weights=towers,
        base_dtype=f"nf4 linear + {param_dtype}" if basis.quantization else param_dtype,
        adapter_parameters=trainable,
        adapter_bytes=4 * trainable,
        grad_bytes=4 * trainable,
        optimizer_bytes=8 * trainable,
        activations=acts,
        logits_bytes=logits,
        reserved_bytes=basis.reserved_bytes,
        batch=batch,
        capacity_bytes=basis.capacity_bytes,
        capacity_source=basis.capacity_source,
        shard_world=basis.shard_world,
        gathered_bytes=basis.gathered_bytes,
        guard_copy_bytes=(4 + 8) * trainable if basis.guard_copy else 0,
        sequence_split=basis.sequence_split,
        offload=basis.offload,
    )


def fsdp_gathered_bytes(model, compute_dtype: str | None, family) -> int:
    """What FSDP holds whole at one time: the root's parameters and two blocks (the one running and the next,
    prefetched), at the dtype they are gathered in."""

    itemsize = torch.empty((), dtype=getattr(torch, compute_dtype)).element_size() if compute_dtype else None
    root, block = working_set_bytes(model, itemsize, family)
    return root + 2 * block


def largest_batches(
    lengths: Sequence[int],
    grids: Sequence[Sequence[tuple[int, int, int]]],
    order: DataOrder,
    total_steps: int,
    labelled: Sequence[int] | None = None,
) -> list[BatchShape]:
    """The micro-batches with the most padded tokens, with the most image patches and (given ``labelled``,
    each sample's labelled tokens) with the most logit positions, over every process and every step the run
    will take in ``order`` (the sampler is seeded, so this is exact). A packed micro-batch is planned as padded:
    packing computes per sample what padding computes, less the padding, so the padded shape bounds it from
    above."""

    def most_labelled(idx) -> int | None:
        return max(labelled[j] for j in idx) if labelled else None

    def shape_of(idx) -> BatchShape:
        idx = list(idx)
        gs = [g for j in idx for g in grids[j]]
        return BatchShape(len(idx), max(lengths[j] for j in idx), gs, most_labelled(idx))

    n = len(lengths)
    best_tokens: BatchShape | None = None
    best_patches: BatchShape | None = None
    best_logits: BatchShape | None = None
    for idx in run_micro_batches(n, order, total_steps):
        shape = shape_of(idx)
        if labelled and (
            best_logits is None
            or shape.samples * shape.logit_positions > best_logits.samples * best_logits.logit_positions
        ):
            best_logits = shape
        if best_tokens is None or shape.samples * shape.tokens > best_tokens.samples * best_tokens.tokens:
            best_tokens = shape
        if best_patches is None or shape.patches > best_patches.patches:
            best_patches = shape
    if best_tokens is None:  # fewer samples than one batch: the whole set is the batch
        best_tokens = shape_of(range(n))
    shapes = [best_tokens]
    for other in (best_patches, best_logits):
        if other is not None and all(other is not s for s in shapes):
            shapes.append(other)
    return shapes


def worst_plan(basis: MemoryBasis, shapes: list[BatchShape]) -> MemoryPlan:
    """The plan of the largest of ``shapes`` (without checkpointing)."""
    plans = [plan_memory(basis, s) for s in shapes]
    return max(plans, key=lambda p: p.total_bytes(False))


def resized_grids(grids, max_pixels: int, family):
    """Patch grids after capping each image at ``max_pixels`` (as ``--max-pixels`` would), by the family's own
    resize rule (``ImageInputs.grid``); grids are unchanged where the family gives none."""
    images = family.image_inputs
    if images is None or images.grid is None:
        return list(grids)
    patch = images.patch_size
    return [tuple(family.call("image_inputs.grid", images.grid, h * patch, w * patch, max_pixels)) for _, h, w in grids]
