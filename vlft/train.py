"""The training loop: AdamW, cosine schedule with warmup, accumulation, clipping, precision policy.

The step reads only plain objects resolved at set-up (``StepPolicy``); it
calls no plugin hooks. Loss is the sum of token losses over the whole
optimizer step (all micro-batches, all processes) divided by that step's
number of label tokens, so accumulation and data parallelism give exactly
the loss and gradients of one big batch.
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
from .sampling import batches

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


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``, or nothing when the policy has no autocast."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch's CPU generator; the backend seeds its device."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over label positions (fp32)."""
    shift_logits = logits[:, :-1, :].float()
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
    # DDP averages gradients over processes; scale back up so the result is sum / global tokens
    scale = policy.world_size / n_tokens
    autocast = autocast_context(policy.device, policy.autocast_dtype)
    total = torch.zeros((), device=policy.device)
    for i, batch in enumerate(micro_batches):
        sync = nullcontext()
        if hasattr(model, "no_sync") and i < len(micro_batches) - 1:
            sync = model.no_sync()  # all-reduce only on the last micro-batch
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
    if policy.scaler is not None:
        policy.scaler.step(optimizer)
        policy.scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss_sum": total, "grad_norm": grad_norm.detach(), "local_tokens": local_tokens,
            "global_tokens": n_tokens}


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
    early_stopping_patience: int = 0  # evaluations without a better validation loss before stopping (0: never)
    loader_kwargs: dict = field(default_factory=dict)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step (rank 0 writes)."""

    def __init__(self, path: Path | None, sinks: list | None = None):
        self.path = path
        self.sinks = sinks or []  # policies.MetricSink objects, opened at set-up (--report-to)

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
                 progress: bool = True, on_best: Callable[[int, float], None] | None = None) -> list[dict]:
    """Train from ``start_step`` to ``settings.total_steps``; return the logged records.

    With ``settings.early_stopping_patience`` the loop stops once that many validation losses in a row were
    no better than the best so far; ``on_best(step, loss)`` is called at each new best (to save it).
    """
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
    best, since_best = float("inf"), 0

    def watch(val: float) -> bool:
        """Record a validation loss; True when patience has run out."""
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

    stop = False
    model.train()
    for group in batches(dataset, collate, settings, start_step):
        if step >= settings.total_steps or stop:
            break
        out = train_step_on(model, optimizer, scheduler, group, policy, non_blocking)
        step += 1
        window_loss += out["loss_sum"]
        window_tokens += out["local_tokens"]
        window_samples += sum(len(b["input_ids"]) for b in group) * settings.world_size
        window_steps += 1
        bar.update(1)
        last = step == settings.total_steps
        if step % settings.log_every == 0 or last:
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
            }
            if policy.scaler is not None:
                record["loss_scale"] = float(policy.scaler.get_scale())
            if evaluate_loss is not None and settings.eval_every and (step % settings.eval_every == 0 or last):
                record["val_loss"] = evaluate_loss()
                model.train()
                stop = watch(record["val_loss"])
                if stop:
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
            stop = watch(val)
            if stop:
                records.append({"step": step, "val_loss": val, "early_stop": True})
            if is_main:
                metrics.write({"step": step, "val_loss": val, **({"early_stop": True} if stop else {})})
        if checkpoints is not None and settings.save_every and step % settings.save_every == 0 and not last:
            if is_main:
                checkpoints.save(step, model_for_saving(model), optimizer, scheduler, policy.scaler, policy.device)
            if settings.world_size > 1:
                torch.distributed.barrier()
    bar.close()
    return records


def model_for_saving(model):
    """The PEFT model inside a DistributedDataParallel wrapper, or the model itself."""
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
