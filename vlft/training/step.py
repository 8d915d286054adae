"""The training step: AdamW, cosine schedule with warmup, accumulation, clipping, precision policy.

The step reads only plain objects resolved at set-up (``StepPolicy``); it
calls no plugin hooks. Loss is the sum of token losses over the whole
optimizer step (all micro-batches, all processes) divided by that step's
number of label tokens, so accumulation and data parallelism give exactly
the loss and gradients of one big batch. The objective (``StepPolicy.objective``)
prepares the step's batches and counts their units (``Objective.prepare``: label
tokens, DPO's pairs, GRPO's sampled completion tokens) and sums its loss over
them the same way.

A step whose loss or gradient norm is not finite is not applied, in every
precision, without a host-device sync: on an accelerator the update is masked
on the device (``guarded_step``); on the CPU, where reading the flag waits for
nothing, the step is just not taken. The loop (``training.trainer``) reads the skip flags when it
reads the loss anyway (log steps, checkpoints), naming the skipped batches'
records then.
"""

from __future__ import annotations

import random
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from transformers import get_cosine_schedule_with_warmup

from vlft.contracts.objective import Average, Objective
from vlft.models.passes import StepPasses
from vlft.planning.sharding import local
from vlft.training.fsdp import root_gathered
from vlft.training.signals import host_all_reduce


@dataclass
class StepPolicy:
    """What one optimizer step needs to know, resolved before the first step."""

    device: torch.device
    autocast_dtype: torch.dtype | None
    scaler: Any  # a GradScaler or None
    max_grad_norm: float
    grad_accum: int
    world_size: int = 1
    # the device runs each op before returning (the CPU): reading the non-finite flag waits for nothing, so a
    # skipped step is simply not taken instead of being taken and undone on the device (``guarded_step``)
    flags_on_host: bool = False
    # torch's fused AdamW, told ``found_inf``, skips a non-finite step on the device: nothing is copied
    # (``PrecisionPolicy.fused_optimizer``; else ``guarded_step`` copies and restores)
    fused_optimizer: bool = False
    # the lm_head and the fp32 logits at labelled positions only (``models.loss.batch_loss_sum``)
    labels_only: bool = True
    # the objective (``vlft.Objective``): its batch preparation, which validation shares, and its loss; None:
    # the next-token loss over label tokens (sft). ``reference``: its reference model (``models.reference``)
    # where it takes one; ``encoder``: the run's sample encoder (GRPO decodes with its tokenizer);
    # ``prepare``: what prepares a step, where not the objective's own (``training.rollouts.KeptRollout``)
    objective: Any = None
    reference: Any = None
    encoder: Any = None
    prepare: Any = None
    # --sequence-parallel: the text model's split (``training.sequence.SequenceSplit``), on around the loss only
    split: Any = None
    # --shard fsdp: the passes keep the vision tower inside the sharded forward and generate in step with the
    # other processes (``models.passes.StepPasses``)
    sharded: bool = False

    def __post_init__(self):
        if self.objective is None:
            self.objective = Objective("sft")
        if self.prepare is None:
            self.prepare = self.objective.prepare

    def splitting(self):
        """The block in which the text model's forwards split their sequences (``--sequence-parallel``)."""
        return self.split.on() if self.split is not None else nullcontext()

    @property
    def figure_units(self) -> dict:
        """What each logged figure is a mean over (``Objective.figure_units``)."""
        return dict(self.objective.figure_units)

    @property
    def per_record(self) -> bool:
        """The loss is averaged over something other than label tokens (DPO's pairs)."""
        return self.objective.average_over is not Average.LABEL_TOKENS

    def passes(self, non_blocking: bool = False) -> StepPasses:
        """What the objective's ``prepare`` and ``loss`` run through (``vlft.Passes``)."""
        return StepPasses(
            self.device,
            self.autocast_dtype,
            self.reference,
            self.encoder,
            self.labels_only,
            non_blocking,
            gathered=root_gathered if self.sharded else None,
        )


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did. The tensors stay on the device: the loop reads them where it syncs anyway
    (log steps, checkpoints), so a step costs no host-device sync."""

    loss_sum: torch.Tensor  # the step's loss summed over its units (every micro-batch of this process)
    grad_norm: torch.Tensor  # before clipping, over every process's gradients
    local_units: int  # what the loss is averaged over on this process (label tokens, records, completion tokens)
    global_units: float  # the same, summed over every process
    skipped: torch.Tensor  # bool: not applied (a non-finite loss or gradient norm)
    backoff: torch.Tensor  # bool: skipped by the loss scaler, which backed off (fp16's warm-up, an overflow)
    figures: dict[str, torch.Tensor] = field(default_factory=dict)  # the objective's figures (sums over units)

    @property
    def loss(self) -> float:
        """The step's mean loss over every process's units (reads the device)."""
        return float(self.loss_sum) / self.global_units


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch's CPU generator; the backend seeds its device."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_global_label_count(count: int, world_size: int):
    """Start summing this step's label tokens over processes, on the host (the counts are known there, so
    the device is never waited for); call the result for the sum."""
    if world_size <= 1:
        return lambda: float(max(count, 1))
    work, total = host_all_reduce([count], np.float64)

    def result() -> float:
        work.wait()
        return float(max(total[0], 1))

    return result


def global_label_count(count: int, world_size: int, device: torch.device | None = None) -> float:
    """Label tokens of this optimizer step summed over processes (a host reduction: no device sync)."""
    return start_global_label_count(count, world_size)()


def train_step(
    model,
    optimizer,
    scheduler,
    micro_batches: list[dict],
    policy: StepPolicy,
    local_tokens: int,
    global_tokens: float | None = None,
    passes: StepPasses | None = None,
) -> StepResult:
    """One optimizer step over ``micro_batches`` (already on the device).

    ``local_tokens`` is this process's count of what the loss is averaged over (label tokens, records, ...:
    ``Objective.prepare``), counted on the host before the batches moved, so the step needs no device sync for it.
    """
    n_tokens = global_tokens if global_tokens is not None else global_label_count(local_tokens, policy.world_size)
    # DDP and FSDP average gradients over processes; scale back up so the result is sum / global tokens
    scale = policy.world_size / n_tokens
    passes = passes if passes is not None else policy.passes()
    total = torch.zeros((), device=policy.device)
    figures: dict[str, torch.Tensor] = {}
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        sync = nullcontext()
        if hasattr(model, "no_sync") and i < last:
            sync = model.no_sync()  # DDP: all-reduce only on the last micro-batch
        elif hasattr(model, "set_requires_gradient_sync") and last:
            model.set_requires_gradient_sync(i == last)  # FSDP: reduce-scatter only on the last one
        with sync, policy.splitting():
            loss_sum, parts = policy.objective.loss(model, batch, passes)
            loss = loss_sum * scale
            (policy.scaler.scale(loss) if policy.scaler is not None else loss).backward()
        total += loss_sum.detach()
        for name, value in parts.items():
            figures[name] = figures[name] + value.detach() if name in figures else value.detach()
    if policy.scaler is not None:
        policy.scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if policy.max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, policy.max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    grad_norm = grad_norm.detach()
    if hasattr(grad_norm, "full_tensor"):  # sharded gradients: the norm over all shards, the same on every process
        grad_norm = grad_norm.full_tensor()  # pyright: ignore[reportAttributeAccessIssue]  # a DTensor, from sharded gradients
    # gradients are all-reduced, the loss is not: with several processes only the gradient decides, so
    # every rank skips the same steps
    finite = torch.isfinite(grad_norm)
    if policy.world_size == 1:
        finite = finite & torch.isfinite(total)
    backoff = torch.zeros((), dtype=torch.bool, device=finite.device)
    if policy.scaler is not None:  # the scaler skips a step with inf/NaN gradients itself (and backs off)
        backoff = scaler_explains(policy, finite, total)
        policy.scaler.step(optimizer)
        policy.scaler.update()
    elif policy.flags_on_host:
        if finite:
            optimizer.step()
    elif policy.fused_optimizer:
        fused_guarded_step(optimizer, finite)
    else:
        guarded_step(optimizer, finite)
    if policy.scaler is not None:
        with warnings.catch_warnings():
            # a step the scaler skipped still advances the schedule (it counts the run's steps, which resuming
            # relies on); torch warns of exactly that when the first step is a back-off, as fp16 runs often start
            warnings.filterwarnings(
                "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before", category=UserWarning
            )
            scheduler.step()
    else:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss_sum=total,
        grad_norm=grad_norm,
        local_units=local_tokens,
        global_units=n_tokens,
        skipped=~finite,
        backoff=backoff,
        figures=figures,
    )


# below this loss scale an overflow is the gradients' own, not the scale's: fp16 holds up to 65504 unscaled
MIN_LOSS_SCALE = 1.0


def scaler_explains(policy: StepPolicy, finite: torch.Tensor, loss_sum: torch.Tensor) -> torch.Tensor:
    """A non-finite step the loss scaler explains (a device flag, no sync): the loss is finite on every
    process and the scale is above ``MIN_LOSS_SCALE``, so the scaled gradients overflowed and the scaler backs
    off (its warm-up from 65536, then now and then). A NaN loss, or an overflow at the floor, is not explained."""
    loss_finite = torch.isfinite(loss_sum).to(torch.float32)
    if policy.world_size > 1:  # every process must classify the step alike (they stop together)
        torch.distributed.all_reduce(loss_finite, op=torch.distributed.ReduceOp.MIN)
    if not policy.scaler.is_enabled():  # a disabled scaler skips nothing, so it explains nothing
        return torch.zeros_like(finite)
    scale = policy.scaler._get_scale_async()  # the scale this step used, as a device tensor (no sync)
    above_floor = (scale > MIN_LOSS_SCALE) if scale is not None else torch.ones((), dtype=torch.bool)
    return (~finite) & (loss_finite > 0).to(finite.device) & above_floor.to(finite.device).reshape(())


def fused_guarded_step(optimizer, finite: torch.Tensor) -> None:
    """``optimizer.step()`` of a fused AdamW told to skip where ``finite`` is False, on the device, as GradScaler
    tells it (``found_inf``): parameters, moments and step counters (on the device with ``fused``) stay as
    they were, with no copy and no host sync."""
    optimizer.found_inf = (~finite).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def guarded_step(optimizer, finite: torch.Tensor) -> None:
    """``optimizer.step()``, undone on the device where ``finite`` is False: parameters and optimizer state
    come back bit for bit, with no host sync. State a first step creates comes back as zeros (for AdamW,
    the same as no state). Tensors that live elsewhere than the flag (AdamW's CPU step counters on an
    accelerator) are settled at the next sync by ``settle_step_counters``. Sharded parameters and state are
    masked shard by shard (``finite`` is the same on every process)."""
    saved = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state.get(p, {})
                saved.append(
                    (
                        p,
                        local(p).clone(),
                        {k: local(v).clone() for k, v in state.items() if torch.is_tensor(v) and v.device == p.device},
                    )
                )
    optimizer.step()
    with torch.no_grad():
        for p, old_p, old_state in saved:
            mine = local(p)
            mine.copy_(torch.where(finite, mine, old_p))
            for k, v in optimizer.state[p].items():
                if torch.is_tensor(v) and v.device == finite.device:
                    v = local(v)
                    v.copy_(torch.where(finite, v, old_state[k] if k in old_state else torch.zeros_like(v)))


def settle_step_counters(optimizer, skipped: int, device: torch.device) -> None:
    """Take ``skipped`` steps back off step counters ``guarded_step`` could not mask on the device."""
    if not skipped:
        return
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step) and step.device != device:
            step -= skipped


def train_step_on(
    model, optimizer, scheduler, host_batches: list[dict], policy: StepPolicy, non_blocking: bool = False
) -> StepResult:
    """``train_step`` on batches still on the host: the objective prepares them (``Objective.prepare``: counted
    on the host and moved, or GRPO's completions sampled and scored), then its units are summed over processes
    (a host reduction) and the step runs; what preparing measured joins the step's figures."""
    passes = policy.passes(non_blocking)
    prepared = policy.prepare(model, host_batches, passes)
    global_units = start_global_label_count(prepared.units, policy.world_size)()
    result = train_step(model, optimizer, scheduler, prepared.batches, policy, prepared.units, global_units, passes)
    return replace(result, figures={**result.figures, **prepared.figures})


def cosine_with_warmup(optimizer, warmup: int, total: int):

    return get_cosine_schedule_with_warmup(optimizer, warmup, total)
