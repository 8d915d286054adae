"""The training loop: AdamW, cosine schedule with warmup, accumulation, clipping, precision policy.

The step reads only plain objects resolved at set-up (``StepPolicy``); it
calls no plugin hooks. Loss is the sum of token losses over the whole
optimizer step (all micro-batches, all processes) divided by that step's
number of label tokens, so accumulation and data parallelism give exactly
the loss and gradients of one big batch.

A step whose loss or gradient norm is not finite is not applied, in every
precision, without a host-device sync: on an accelerator the update is masked
on the device (``guarded_step``); on the CPU, where reading the flag waits for
nothing, the step is just not taken. The loop reads the skip flags when it
reads the loss anyway (log steps, checkpoints), naming the skipped batches'
records then.
"""

from __future__ import annotations

import json
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .data import IGNORE_INDEX
from .resilience import Interrupted, NonFiniteStop, StopRequest
from .sampling import batches, step_indices
from .sharding import local

if TYPE_CHECKING:
    from .checkpoints import CheckpointStore


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


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``, or nothing when the policy has no autocast."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch's CPU generator; the backend seeds its device."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over label positions, in fp32 at least (fp64 logits stay fp64)."""
    shift_logits = logits[:, :-1, :].to(torch.promote_types(logits.dtype, torch.float32))
    shift_labels = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


def label_count(batch: dict) -> int:
    """Label tokens that count in the loss (host-side: no device sync)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def to_device(batch: dict, device: torch.device, non_blocking: bool = False) -> dict:
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def global_label_count(count: int, world_size: int, device: torch.device) -> float:
    """Label tokens of this optimizer step summed over processes."""
    if world_size > 1:
        t = torch.tensor([count], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        count = t.item()
    return float(max(count, 1))


def train_step(model, optimizer, scheduler, micro_batches: list[dict], policy: StepPolicy,
               local_tokens: int) -> dict:
    """One optimizer step over ``micro_batches`` (already on the device). Returns device tensors.

    ``local_tokens`` is this process's label-token count for the step, counted
    on the host before the batches moved, so the step needs no device sync for it.
    """
    n_tokens = global_label_count(local_tokens, policy.world_size, policy.device)
    # DDP and FSDP average gradients over processes; scale back up so the result is sum / global tokens
    scale = policy.world_size / n_tokens
    autocast = autocast_context(policy.device, policy.autocast_dtype)
    total = torch.zeros((), device=policy.device)
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        sync = nullcontext()
        if hasattr(model, "no_sync") and i < last:
            sync = model.no_sync()  # DDP: all-reduce only on the last micro-batch
        elif hasattr(model, "set_requires_gradient_sync") and last:
            model.set_requires_gradient_sync(i == last)  # FSDP: reduce-scatter only on the last one
        with sync:
            with autocast:
                logits = model(**model_inputs(batch)).logits
            loss_sum = token_loss_sum(logits, batch["labels"])
            loss = loss_sum * scale
            (policy.scaler.scale(loss) if policy.scaler is not None else loss).backward()
        total += loss_sum.detach()
    if policy.scaler is not None:
        policy.scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if policy.max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, policy.max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    grad_norm = grad_norm.detach()
    if hasattr(grad_norm, "full_tensor"):  # sharded gradients: the norm over all shards, the same on every process
        grad_norm = grad_norm.full_tensor()
    # gradients are all-reduced, the loss is not: with several processes only the gradient decides, so
    # every rank skips the same steps
    finite = torch.isfinite(grad_norm)
    if policy.world_size == 1:
        finite = finite & torch.isfinite(total)
    if policy.scaler is not None:  # the scaler skips a step with inf/NaN gradients itself (and backs off)
        policy.scaler.step(optimizer)
        policy.scaler.update()
    elif policy.flags_on_host:
        if finite:
            optimizer.step()
    else:
        guarded_step(optimizer, finite)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss_sum": total, "grad_norm": grad_norm, "local_tokens": local_tokens,
            "global_tokens": n_tokens, "skipped": ~finite}


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
                saved.append((p, local(p).clone(), {k: local(v).clone() for k, v in state.items()
                                                    if torch.is_tensor(v) and v.device == p.device}))
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


def train_step_on(model, optimizer, scheduler, host_batches: list[dict], policy: StepPolicy,
                  non_blocking: bool = False) -> dict:
    """``train_step`` on batches still on the host: count their label tokens there, then move them."""
    local_tokens = sum(label_count(b) for b in host_batches)
    batches_on_device = [to_device(b, policy.device, non_blocking) for b in host_batches]
    return train_step(model, optimizer, scheduler, batches_on_device, policy, local_tokens)


def cosine_with_warmup(optimizer, warmup: int, total: int):
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, warmup, total)


@dataclass
class LoopSettings:
    total_steps: int
    batch_size: int
    grad_accum: int
    seed: int
    rank: int = 0
    world_size: int = 1
    log_every: int = 10
    eval_every: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    loader_kwargs: dict = field(default_factory=dict)
    max_skipped_steps: int = 5  # consecutive non-finite steps that stop the run (0: never)
    early_stopping_patience: int = 0  # evaluations without a better validation loss before stopping (0: never)


@dataclass
class SkipLog:
    """Steps not applied because their loss or gradient norm was not finite, with this process's records."""

    total: int = 0
    consecutive: int = 0
    steps: list[dict] = field(default_factory=list)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step (rank 0 writes)."""

    def __init__(self, path: Path | None, sinks: list | None = None):
        self.sinks = sinks or []  # policies.MetricSink objects, opened at set-up (--report-to)
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step``: a resumed run rewrites them."""
        if self.path is None or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def run_training(model, optimizer, scheduler, policy: StepPolicy, dataset, collate, settings: LoopSettings,
                 checkpoints: CheckpointStore | None, metrics: MetricsLog, memory_reader: Callable,
                 evaluate_loss: Callable[[], float] | None = None, start_step: int = 0,
                 progress: bool = True, skips: SkipLog | None = None,
                 on_best: Callable[[int, float], None] | None = None) -> list[dict]:
    """Train from ``start_step`` to ``settings.total_steps``; return the logged records.

    SIGTERM or SIGINT stops it after the current step with a checkpoint (``Interrupted``); too many
    consecutive non-finite steps stop it with ``NonFiniteStop``. ``skips`` collects the skipped steps.
    With ``settings.early_stopping_patience`` the loop stops once that many validation losses in a row were
    no better than the best so far; ``on_best(step, loss)`` is called at each new best (to save it).
    """
    with StopRequest() as stop:
        return _loop(model, optimizer, scheduler, policy, dataset, collate, settings, checkpoints, metrics,
                     memory_reader, evaluate_loss, start_step, progress, skips if skips is not None else SkipLog(),
                     stop, on_best)


def _read_skips(pending: list, skips: SkipLog, dataset, settings: LoopSettings, optimizer, policy: StepPolicy,
                metrics: MetricsLog, is_main: bool) -> None:
    """Read the pending steps' skip flags (one sync, where the loop syncs anyway) and account for them."""
    if not pending:
        return
    flags = torch.stack([flag for _, flag in pending]).tolist()
    n_skipped = 0
    for (step, _), skipped in zip(pending, flags):
        if not skipped:
            skips.consecutive = 0
            continue
        n_skipped += 1
        skips.total += 1
        skips.consecutive += 1
        records = getattr(dataset, "records", None)
        where = [records[i].where for i in step_indices(len(dataset), settings, step)] if records else []
        entry = {"step": step, "skipped": "non-finite loss or gradient norm", "records": where}
        skips.steps.append(entry)
        print(f"step {step} skipped: non-finite loss or gradient norm (records {', '.join(where)})",
              file=sys.stderr, flush=True)
        if is_main:
            metrics.write(entry)
        if settings.max_skipped_steps and skips.consecutive >= settings.max_skipped_steps:
            pending.clear()
            last = skips.steps[-skips.consecutive:]
            raise NonFiniteStop(
                f"{skips.consecutive} consecutive steps had a non-finite loss or gradient norm (steps "
                f"{', '.join(str(e['step']) for e in last)}; records "
                f"{', '.join(sorted({w for e in last for w in e['records']}))}); the run stops. No skipped step "
                f"was applied, so the newest checkpoint holds the last good weights. Lower --lr, use "
                f"--precision fp32 or bf16, check these records, or raise --max-skipped-steps.")
    if policy.scaler is None:  # the scaler's skipped steps never reached the optimizer
        settle_step_counters(optimizer, n_skipped, policy.device)
    pending.clear()


def _loop(model, optimizer, scheduler, policy, dataset, collate, settings, checkpoints, metrics, memory_reader,
          evaluate_loss, start_step, progress, skips: SkipLog, stop: StopRequest, on_best=None) -> list[dict]:
    from tqdm.auto import tqdm

    is_main = settings.rank == 0
    # in a terminal the bar redraws often; in a log file a line every 15 s is plenty
    bar = tqdm(total=settings.total_steps, initial=start_step, desc="train", unit="step",
               disable=not (progress and is_main), dynamic_ncols=True,
               mininterval=0.2 if sys.stderr.isatty() else 15.0)
    records: list[dict] = []
    window_loss = torch.zeros((), device=policy.device)
    window_tokens = 0.0
    window_samples = 0
    window_start = time.perf_counter()
    window_steps = 0
    non_blocking = bool(settings.loader_kwargs.get("pin_memory"))
    step = start_step
    pending: list[tuple[int, torch.Tensor]] = []  # (step, skipped flag on the device) not yet read
    best, since_best = float("inf"), 0

    def patience_ran_out(val: float) -> bool:
        """Record a validation loss; True when early stopping's patience has run out."""
        nonlocal best, since_best
        if not settings.early_stopping_patience:
            return False
        if val < best:
            best, since_best = val, 0
            if on_best is not None:
                on_best(step, val)
            return False
        since_best += 1
        return since_best >= settings.early_stopping_patience

    early_stop = False
    model.train()
    for group in batches(dataset, collate, settings, start_step):
        if step >= settings.total_steps or early_stop:
            break
        out = train_step_on(model, optimizer, scheduler, group, policy, non_blocking)
        step += 1
        pending.append((step, out["skipped"]))
        # a skipped step's loss (NaN, inf) stays out of the logged mean
        window_loss += torch.where(out["skipped"], torch.zeros_like(out["loss_sum"]), out["loss_sum"])
        window_tokens += out["local_tokens"]
        window_samples += sum(len(b["input_ids"]) for b in group) * settings.world_size
        window_steps += 1
        bar.update(1)
        last = step == settings.total_steps
        if step % settings.log_every == 0 or last:
            _read_skips(pending, skips, dataset, settings, optimizer, policy, metrics, is_main)
            loss_sum = window_loss
            tokens = torch.tensor(window_tokens, device=policy.device, dtype=torch.float64)
            if settings.world_size > 1:
                pair = torch.stack([loss_sum.double(), tokens])
                torch.distributed.all_reduce(pair)
                loss_sum, tokens = pair[0], pair[1]
            elapsed = time.perf_counter() - window_start
            mem = memory_reader()
            record = {
                "step": step,
                "loss": float(loss_sum) / max(float(tokens), 1.0),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(out["grad_norm"]),
                "step_time_s": elapsed / window_steps,
                "samples_per_s": window_samples / elapsed if elapsed > 0 else None,
                "peak_memory_bytes": mem.peak_bytes,
                "skipped_steps": skips.total,
            }
            if policy.scaler is not None:
                record["loss_scale"] = float(policy.scaler.get_scale())
            if evaluate_loss is not None and settings.eval_every and (step % settings.eval_every == 0 or last):
                record["val_loss"] = evaluate_loss()
                model.train()
                early_stop = patience_ran_out(record["val_loss"])
                if early_stop:
                    record["early_stop"] = True
            records.append(record)
            if is_main:
                metrics.write(record)
                # refresh=False: the bar draws at its own interval (one line per 15 s in a log file), not per log
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
            window_loss = torch.zeros((), device=policy.device)
            window_tokens, window_samples, window_steps = 0.0, 0, 0
            window_start = time.perf_counter()
        elif evaluate_loss is not None and settings.eval_every and step % settings.eval_every == 0:
            val = evaluate_loss()
            model.train()
            early_stop = patience_ran_out(val)
            if early_stop:
                records.append({"step": step, "val_loss": val, "early_stop": True})
            if is_main:
                metrics.write({"step": step, "val_loss": val, **({"early_stop": True} if early_stop else {})})
        saved = None
        if checkpoints is not None and settings.save_every and step % settings.save_every == 0 and not last:
            saved = _save(checkpoints, step, model, optimizer, scheduler, policy, settings, pending, skips, dataset,
                          metrics, is_main)
        signum = stop.agreed(settings.world_size, policy.device) if not last else None
        if signum:
            if saved is None and checkpoints is not None:
                saved = _save(checkpoints, step, model, optimizer, scheduler, policy, settings, pending, skips,
                              dataset, metrics, is_main)
            bar.close()
            raise Interrupted(step, signum, saved)
    bar.close()
    _read_skips(pending, skips, dataset, settings, optimizer, policy, metrics, is_main)
    return records


def _save(checkpoints, step, model, optimizer, scheduler, policy, settings, pending, skips, dataset, metrics,
          is_main):
    # the step counters must be settled before they are saved
    _read_skips(pending, skips, dataset, settings, optimizer, policy, metrics, is_main)
    if checkpoints.collective:  # --shard fsdp: every process writes its share
        return checkpoints.save(step, model, optimizer, scheduler, policy.scaler, policy.device)
    path = None
    if is_main:
        path = checkpoints.save(step, model_for_saving(model), optimizer, scheduler, policy.scaler, policy.device)
    if settings.world_size > 1:
        torch.distributed.barrier()
    return path


def model_for_saving(model):
    """The PEFT model inside a DistributedDataParallel wrapper, or the model itself."""
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
