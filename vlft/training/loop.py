"""The parts of the training loop (``training.trainer.Trainer.train``): its settings, the window of steps
between two logged ones, early stopping, the skipped steps' account, throughput.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from vlft.data.batching import batch_counts
from vlft.data.order import DataOrder
from vlft.training.checkpoints import CheckpointWriteError
from vlft.training.step import StepResult


@dataclass(kw_only=True)
class LoopSettings(DataOrder):
    """The data order plus what the loop does around the steps: how long, logging, evaluation, saving."""

    total_steps: int
    log_every: int = 10
    eval_every: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    max_skipped_steps: int = 5  # consecutive non-finite steps that stop the run (0: never)
    early_stopping_patience: int = 0  # evaluations without a better validation loss before stopping (0: never)
    # MFU: the device's peak FLOP/s where the backend knows it, and the model FLOPs of one (non-padding) token
    peak_flops: float | None = None
    flops_per_token: float = 0.0
    # the processes (every collective is theirs) and this one's rank; more than the data's shares (``world_size``)
    # where ``sequence_parallel`` processes split each sample and train on the same batches
    processes: int = 1
    process_rank: int = 0
    sequence_parallel: int = 1


@dataclass
class SkipLog:
    """Steps not applied because their loss or gradient norm was not finite, with this process's records."""

    total: int = 0
    consecutive: int = 0
    steps: list[dict] = field(default_factory=list)
    # fp16: steps the loss scaler skipped and backed off from (its warm-up, an overflow of the scaled
    # gradients); not applied either, but counted apart: they never stop the run
    scaler_backoffs: int = 0


class EarlyStopping:
    """``--early-stopping-patience``: stop once that many validation losses in a row beat no earlier one."""

    def __init__(self, patience: int, on_best: Callable[[int, float], None] | None):
        self.patience, self.on_best = patience, on_best
        self.best, self.since_best = float("inf"), 0

    def ran_out(self, step: int, val: float) -> bool:
        """Record a validation loss; True when the patience has run out."""
        if not self.patience:
            return False
        if val < self.best:
            self.best, self.since_best = val, 0
            if self.on_best is not None:
                self.on_best(step, val)
            return False
        self.since_best += 1
        return self.since_best >= self.patience


class Window:
    """What the steps since the last logged one add up to: loss and label tokens (kept on the device until
    the log step reads them), samples and time. Evaluation (``--eval-every``) and checkpoint saving
    (``--save-every``, the best adapter) inside the window are timed apart (``timed``) and left out of
    ``step_time_s`` and ``samples_per_s``; their lines in metrics.jsonl carry ``eval_time_s`` and
    ``checkpoint_time_s``."""

    def __init__(self, device, figure_units: dict | None = None):
        self.device = device
        self.figure_units = figure_units or {}  # figure -> the figure counting its units, or "steps"
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.figures: dict[str, torch.Tensor] = {}  # the objective's figures (sums over its units)
        self.tokens, self.samples, self.steps = 0.0, 0, 0
        self.positions, self.real = 0, 0  # this process's token positions computed, and those not padding
        self.start = time.perf_counter()
        self.paused = 0.0  # seconds of evaluation and checkpoint saving inside the window: not step time

    def timed(self, fn: Callable):
        """``fn()`` and the seconds it took, which the window's step time leaves out."""
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        self.paused += seconds
        return result, seconds

    def add(self, result: StepResult, group: list[dict], world_size: int) -> None:
        # a skipped step's loss (NaN, inf) stays out of the logged mean, and so do its figures
        self.loss += torch.where(result.skipped, torch.zeros_like(result.loss_sum), result.loss_sum)
        for name, value in result.figures.items():
            kept = torch.where(result.skipped, torch.zeros_like(value), value)
            self.figures[name] = self.figures[name] + kept if name in self.figures else kept
        self.tokens += result.local_units
        counts = [batch_counts(b) for b in group]  # host batches: no device sync
        self.samples += sum(n for n, _ in counts) * world_size
        self.positions += sum(b["input_ids"].numel() for b in group)
        self.real += sum(real for _, real in counts)
        self.steps += 1

    def close(self, world_size: int, copies: int = 1) -> WindowFigures:
        """The window's loss over all processes' label tokens (or records: the loss's units), its token counts
        and the objective's figures' means (over the same units), in one all-reduce under torchrun. ``copies``:
        how many processes computed each batch's sums (``--sequence-parallel``), counted once."""
        loss_sum = self.loss
        names = sorted(self.figures)
        counts = torch.tensor([self.tokens, self.positions, self.real], device=self.device, dtype=torch.float64)
        if world_size > 1:
            both = torch.cat(
                [loss_sum.double().reshape(1), counts, *[self.figures[n].double().reshape(1) for n in names]]
            )
            torch.distributed.all_reduce(both)
            both = both / copies
            loss_sum, counts, sums = both[0], both[1:4], both[4:].tolist()
        else:  # one read for all of them: the loop reads the device here anyway
            sums = torch.stack([self.figures[n].double() for n in names]).tolist() if names else []
        labels, positions, real = counts.tolist()
        return WindowFigures(
            loss=float(loss_sum) / max(labels, 1.0),
            means=figure_means(dict(zip(names, sums)), self.figure_units, labels, self.steps * world_size // copies),
            totals={"labels": labels, "positions": positions, "real": real},
        )


@dataclass(frozen=True)
class WindowFigures:
    """What a logged window adds up to over every process (``Window.close``)."""

    loss: float  # over the loss's units (label tokens or records)
    means: dict[str, float]  # the objective's figures
    totals: dict[str, float]  # label tokens, token positions computed, and those not padding


def figure_means(sums: dict[str, float], units: dict[str, str], loss_units: float, steps: float) -> dict:
    """Each figure's mean: over the figure ``units`` names for it (GRPO's reward over its 'completions'), per
    process and step ('steps'), or over the loss's units (label tokens or records)."""

    def over(name: str) -> float:
        unit = units.get(name)
        if unit == "steps":
            return steps
        return sums.get(unit, 0.0) if unit is not None else loss_units

    return {n: v / max(over(n), 1.0) for n, v in sums.items()}


def progress_bar(settings: LoopSettings, start_step: int, progress: bool):
    # in a terminal the bar redraws often; in a log file a line every 15 s is plenty
    return tqdm(
        total=settings.total_steps,
        initial=start_step,
        desc="train",
        unit="step",
        disable=not (progress and settings.process_rank == 0),
        dynamic_ncols=True,
        mininterval=0.2 if sys.stderr.isatty() else 15.0,
    )


def throughput(totals: dict, elapsed: float, settings: LoopSettings, per_record: bool = False) -> dict:
    """Tokens/s over all processes: every position computed (padding included), the effective ones (not
    padding), the labelled ones (where the loss counts label tokens: ``per_record`` objectives count records,
    which ``samples_per_s`` gives); and the MFU (model FLOPs of the effective tokens over the devices' peak)
    where the backend knows the peak."""
    if elapsed <= 0:
        return {}
    out = {"tokens_per_s": totals["positions"] / elapsed, "effective_tokens_per_s": totals["real"] / elapsed}
    if not per_record:
        out["label_tokens_per_s"] = totals["labels"] / elapsed
    if settings.peak_flops and settings.flops_per_token:
        out["mfu"] = (
            out["effective_tokens_per_s"] * settings.flops_per_token / (settings.peak_flops * settings.processes)
        )
    return out


def problem_message(problem: BaseException, step: int) -> str:
    if isinstance(problem, CheckpointWriteError):
        return str(problem)
    return f"writing the checkpoint of step {step} failed on rank 0 ({problem.__class__.__name__}: {problem})"


def object_device(device: torch.device) -> torch.device | None:
    """Where broadcast_object_list stages its bytes: the training device (NCCL, HCCL), or the host (gloo)."""
    return None if device.type == "cpu" else device


def model_for_saving(model):
    """The PEFT model inside a DistributedDataParallel wrapper, or the model itself."""
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
