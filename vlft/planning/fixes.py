"""When a run does not fit: settle activation checkpointing, and name the fixes that would make it fit,
each re-estimated by the memory plan (not scaled)."""

from __future__ import annotations

import dataclasses
import itertools

from vlft.config import RunConfig
from vlft.planning.memory import (
    HEADROOM,
    MemoryBasis,
    MemoryPlan,
    fsdp_gathered_bytes,
    gib,
    plan_memory,
    resized_grids,
)
from vlft.planning.sequence import split_problem
from vlft.planning.trace import BatchShape


def decide(plan: MemoryPlan, basis: MemoryBasis, config: RunConfig, can_shard: bool = False) -> None:
    """Settle checkpointing (``--grad-checkpointing``: on, off, auto) and, when the run does not fit, list what
    would (``basis``: what ``plan`` was made from)."""
    asked = config.grad_checkpointing
    _settle_checkpointing(plan, asked)
    if plan.fits() is not False:
        return
    ckpt = plan.checkpointing or asked == "auto"
    replan = _replanner(plan, basis)
    family = basis.family
    fixes = [
        _fix_checkpointing(plan),
        _fix_half_weights(plan),
        _fix_smaller_batches(plan, replan, ckpt, config.batch_size, config.grad_accum),
        _fix_fewer_pixels(plan, replan, ckpt, config.max_pixels, family),
        _fix_sharding(plan, basis.model, basis.compute_dtype, ckpt, family)
        if can_shard and plan.shard_world == 1
        else None,
        _fix_sequence_split(plan, basis, ckpt) if plan.sequence_split == 1 else None,
        _fix_offload(plan, basis.model, basis.compute_dtype, ckpt, family, can_shard),
    ]
    if not any(f and f.endswith("(fits)") for f in fixes):
        fixes.append(_fix_combined(plan, basis, ckpt, config))
    fixes.append(
        "--max-length N with --skip-too-long (leave out the longest samples), or fewer targets "
        "(--targets text, a smaller --vision-last-n)"
    )
    plan.fixes = [f for f in fixes if f]


def _settle_checkpointing(plan: MemoryPlan, asked: str) -> None:
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
        plan.checkpointing_reason = (
            f"auto: on (without it {gib(plan.total_bytes(False))} would not fit {gib(plan.capacity_bytes)})"
        )


def _usable(plan: MemoryPlan) -> float:
    assert plan.capacity_bytes is not None  # asked only where the device's capacity is known
    return plan.capacity_bytes * (1 - HEADROOM)


def _verdict(plan: MemoryPlan, n: int) -> str:
    return " (fits)" if n <= _usable(plan) else ""


def _replanner(plan: MemoryPlan, basis: MemoryBasis):
    """The same plan for another batch shape (re-estimated, not scaled)."""

    def replan(shape: BatchShape) -> MemoryPlan:
        return plan_memory(_rebased(plan, basis, plan.base_dtype), shape)

    return replan


def _rebased(plan: MemoryPlan, basis: MemoryBasis, param_dtype: str) -> MemoryBasis:
    """``basis`` with ``plan``'s capacity, sharding and guard and the base weights in ``param_dtype``, unquantized."""
    return dataclasses.replace(
        basis,
        param_dtype=param_dtype,
        reserved_bytes=plan.reserved_bytes,
        capacity_bytes=plan.capacity_bytes,
        capacity_source=plan.capacity_source,
        shard_world=plan.shard_world,
        gathered_bytes=plan.gathered_bytes,
        quantization=None,
        double_quant=False,
        guard_copy=bool(plan.guard_copy_bytes),
        offload=plan.offload,
    )


def _fix_checkpointing(plan: MemoryPlan) -> str | None:
    if plan.checkpointing:
        return None
    n = plan.total_bytes(True)
    return f"--grad-checkpointing on: {gib(n)}" + _verdict(plan, n)


def _fix_half_weights(plan: MemoryPlan) -> str | None:
    if plan.base_dtype != "float32":
        return None
    half = plan.total_bytes() - sum(plan.base_weights.values()) // 2
    return f"--param-dtype bf16 (fp16 where bf16 is not native): about {gib(half)}" + _verdict(plan, half)


def _fix_smaller_batches(plan: MemoryPlan, replan, ckpt: bool, batch_size: int, grad_accum: int) -> str | None:
    """The largest halved micro-batch that fits (or batch 1), with the accumulation that keeps the step."""
    b = plan.batch.samples
    per = len(plan.batch.grids) / max(plan.batch.samples, 1)
    while b > 1:
        b //= 2
        n = replan(
            BatchShape(b, plan.batch.tokens, plan.batch.grids[: round(per * b)], plan.batch.labelled)
        ).total_bytes(ckpt)
        if n <= _usable(plan) or b == 1:
            accum = grad_accum * batch_size // b
            return (
                f"--batch-size {b} --grad-accum {accum} (same samples per step"
                + (", with checkpointing" if ckpt else "")
                + f"): {gib(n)}"
                + _verdict(plan, n)
            )
    return None


def _resizable(family) -> bool:
    """The family says how its images resize (``ImageInputs.grid`` and its patch side)."""
    images = family.image_inputs if family is not None else None
    return images is not None and images.grid is not None and images.patch_size > 0


def _fix_fewer_pixels(plan: MemoryPlan, replan, ckpt: bool, max_pixels: int | None, family) -> str | None:
    if not _resizable(family):
        return None
    if (
        not plan.batch.patches
        or (max_pixels is not None and max_pixels <= PIXELS)
        or not any(h * w * family.image_inputs.patch_size**2 > PIXELS for _, h, w in plan.batch.grids)
    ):
        return None
    n = replan(_fewer_pixels_shape(plan.batch, family)).total_bytes(ckpt)
    return f"--max-pixels {PIXELS} (448x448 images): about {gib(n)}" + _verdict(plan, n)


PIXELS = 448 * 448  # --max-pixels in the fixes: 448x448 images


def _fewer_pixels_shape(batch: BatchShape, family) -> BatchShape:
    shape = BatchShape(batch.samples, batch.tokens, resized_grids(batch.grids, PIXELS, family), batch.labelled)
    per_token = family.image_inputs.patches_per_token
    shape.tokens = max(1, batch.tokens - (batch.patches - shape.patches) // per_token // batch.samples)
    return shape


def _fix_combined(plan: MemoryPlan, basis: MemoryBasis, ckpt: bool, config: RunConfig) -> str | None:
    """When no single fix fits: the fewest of them that fit together, each combination re-estimated by
    ``plan_memory`` (checkpointing, bf16 base weights, a smaller micro-batch with the accumulation that keeps
    the step, 448x448 images), tried two at a time, then three, then all four; within one size in that order
    of preference, and with the largest micro-batch that fits."""
    family, max_pixels = basis.family, config.max_pixels
    options = []
    if not ckpt:
        options.append("checkpointing")
    if plan.base_dtype == "float32":
        options.append("half")
    if plan.batch.samples > 1:
        options.append("batch")
    if (
        _resizable(family)
        and plan.batch.patches
        and not (max_pixels is not None and max_pixels <= PIXELS)
        and any(h * w * family.image_inputs.patch_size**2 > PIXELS for _, h, w in plan.batch.grids)
    ):
        options.append("pixels")
    per = len(plan.batch.grids) / max(plan.batch.samples, 1)
    plans: dict = {}

    def total(chosen, samples: int) -> int:
        key = ("half" in chosen, samples, "pixels" in chosen)
        if key not in plans:
            shape = BatchShape(
                samples, plan.batch.tokens, plan.batch.grids[: round(per * samples)], plan.batch.labelled
            )
            if "pixels" in chosen:
                shape = _fewer_pixels_shape(shape, family)
            dtype = "bfloat16" if "half" in chosen else plan.base_dtype
            plans[key] = plan_memory(_rebased(plan, basis, dtype), shape)
        return plans[key].total_bytes(ckpt or "checkpointing" in chosen)

    for size in range(2, len(options) + 1):
        for chosen in itertools.combinations(options, size):
            sizes = [plan.batch.samples]
            if "batch" in chosen:
                sizes, b = [], plan.batch.samples
                while b > 1:
                    b //= 2
                    sizes.append(b)
            for b in sizes:  # the largest micro-batch first
                n = total(chosen, b)
                if n <= _usable(plan):
                    flags = []
                    if "checkpointing" in chosen:
                        flags.append("--grad-checkpointing on")
                    if "half" in chosen:
                        flags.append("--param-dtype bf16")
                    if "batch" in chosen:
                        flags.append(f"--batch-size {b} --grad-accum {config.grad_accum * config.batch_size // b}")
                    if "pixels" in chosen:
                        flags.append(f"--max-pixels {PIXELS}")
                    return f"together: {' '.join(flags)}: {gib(n)}" + _verdict(plan, n)
    return None


def _fix_sharding(plan: MemoryPlan, model, compute_dtype, ckpt: bool, family) -> str | None:
    """The fewest processes FSDP2 would need for the run to fit."""
    gathered = fsdp_gathered_bytes(model, compute_dtype, family)
    for n in (2, 4, 8, 16, 32, 64):
        total = dataclasses.replace(plan, shard_world=n, gathered_bytes=gathered, fixes=[]).total_bytes(ckpt)
        if total <= _usable(plan):
            return (
                f"--shard fsdp over {n} processes (--nproc-per-node {n}, or --nnodes with "
                f"--nproc-per-node making {n}"
                + (", with checkpointing" if ckpt else "")
                + f"): {gib(total)} per process (fits)"
            )
    return None


def _fix_sequence_split(plan: MemoryPlan, basis: MemoryBasis, ckpt: bool) -> str | None:
    """The fewest processes splitting each sample (``--sequence-parallel``) for the run to fit, where the model
    can split: the text layers' activations are what a long sample fills a device with."""
    for n in (2, 4, 8, 16):
        if split_problem(n, basis.model_config, basis.family, basis.model):
            return None
        split = plan_memory(dataclasses.replace(basis, sequence_split=n), plan.batch)
        total = split.total_bytes(ckpt)
        if total <= _usable(plan):
            return (
                f"--sequence-parallel {n} (--nproc-per-node {n}: each process holds 1/{n} of each sample's tokens in "
                f"the text model" + (", with checkpointing" if ckpt else "") + f"): {gib(total)} per process (fits)"
            )
    return None


def _fix_offload(plan: MemoryPlan, model, compute_dtype, ckpt: bool, family, can_shard: bool) -> str | None:
    """--offload cpu (FSDP2's CPUOffloadPolicy): the device keeps only what is gathered and the activations; the
    shares move to the host, which the line states. Under --shard fsdp already, or as sharding's companion
    (over the processes the run has)."""
    if plan.offload or not (can_shard or plan.shard_world > 1):
        return None
    world = plan.shard_world
    gathered = plan.gathered_bytes or fsdp_gathered_bytes(model, compute_dtype, family)
    offloaded = dataclasses.replace(plan, gathered_bytes=gathered, offload=True, fixes=[])
    n = offloaded.total_bytes(ckpt)
    return (
        ("--offload cpu" if world > 1 else "--shard fsdp --offload cpu")
        + f": {gib(n)} on the device, {gib(offloaded.host_bytes_per_process)} of host memory per process; slower "
        "(each block copied to the device at every forward and backward, the AdamW step on the host)"
        + _verdict(plan, n)
    )
