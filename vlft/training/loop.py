"""The training loop: steps from the sampler's batches, logging, evaluation, early stopping, checkpoints.

The loop reads the step's device flags only where it syncs anyway (log steps
and checkpoints), so a skipped step costs no extra host-device sync; it stops
on SIGTERM/SIGINT (``signals.StopRequest``) after the current step with a
checkpoint, and after ``--max-skipped-steps`` consecutive non-finite steps.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from vlft.data.batching import batch_counts
from vlft.data.order import DataOrder, batches, step_indices
from vlft.training.checkpoints import CheckpointWriteError
from vlft.training.metrics import MetricsLog
from vlft.training.signals import Interrupted, NonFiniteStop, StopRequest
from vlft.training.step import StepPolicy, settle_step_counters, train_step_on

if TYPE_CHECKING:
    from vlft.training.checkpoints import CheckpointStore


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


@dataclass
class SkipLog:
    """Steps not applied because their loss or gradient norm was not finite, with this process's records."""

    total: int = 0
    consecutive: int = 0
    steps: list[dict] = field(default_factory=list)
    # fp16: steps the loss scaler skipped and backed off from (its warm-up, an overflow of the scaled
    # gradients); not applied either, but counted apart: they never stop the run
    scaler_backoffs: int = 0


@dataclass
class Training:
    """What a run's loop is given, on one object: the model and its optimizer and schedule, the step policy,
    the data and how it is batched and ordered, where checkpoints and metrics go, and what it calls at
    evaluation (``evaluate``: the validation figures, ``val_loss`` and the objective's ``val_<figure>``) and at
    each new best validation loss (``on_best(step, loss)``, to save it)."""

    model: Any
    optimizer: Any
    scheduler: Any
    policy: StepPolicy
    dataset: Any
    collate: Callable
    settings: LoopSettings
    checkpoints: CheckpointStore | None
    metrics: MetricsLog
    memory_reader: Callable
    evaluate: Callable[[], dict] | None = None
    on_best: Callable[[int, float], None] | None = None
    start_step: int = 0
    progress: bool = True
    skips: SkipLog = field(default_factory=SkipLog)
    # the applied kernel patches (models.patching.PatchWatch), checked at the first step and the first after
    # each evaluation (whose eval()/train() is what can undo one); None or empty: nothing to check
    patches: Any = None


def run_training(training: Training) -> list[dict]:
    """Train from ``training.start_step`` to ``settings.total_steps``; return the logged records.

    SIGTERM or SIGINT stops it after the current step with a checkpoint (``Interrupted``); too many
    consecutive non-finite steps stop it with ``NonFiniteStop``. ``training.skips`` collects the skipped
    steps. With ``settings.early_stopping_patience`` the loop stops once that many validation losses in a row
    were no better than the best so far.
    """
    with StopRequest() as stop:
        return Trainer(training, stop).run()


class _EarlyStopping:
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


class _Window:
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

    def add(self, out: dict, group: list[dict], world_size: int) -> None:
        # a skipped step's loss (NaN, inf) stays out of the logged mean, and so do its figures
        self.loss += torch.where(out["skipped"], torch.zeros_like(out["loss_sum"]), out["loss_sum"])
        for name, value in out.get("figures", {}).items():
            kept = torch.where(out["skipped"], torch.zeros_like(value), value)
            self.figures[name] = self.figures[name] + kept if name in self.figures else kept
        self.tokens += out["local_tokens"]
        counts = [batch_counts(b) for b in group]  # host batches: no device sync
        self.samples += sum(n for n, _ in counts) * world_size
        self.positions += sum(b["input_ids"].numel() for b in group)
        self.real += sum(real for _, real in counts)
        self.steps += 1

    def mean_loss(self, world_size: int) -> float:
        """The loss over all processes' label tokens (or records: the loss's units), in one all-reduce under
        torchrun, which also sums the window's token counts into ``totals`` and the objective's figures into
        ``means`` (over the same units)."""
        loss_sum = self.loss
        names = sorted(self.figures)
        counts = torch.tensor([self.tokens, self.positions, self.real], device=self.device, dtype=torch.float64)
        if world_size > 1:
            both = torch.cat([loss_sum.double().reshape(1), counts,
                              *[self.figures[n].double().reshape(1) for n in names]])
            torch.distributed.all_reduce(both)
            loss_sum, counts, sums = both[0], both[1:4], both[4:].tolist()
        else:  # one read for all of them: the loop reads the device here anyway
            sums = torch.stack([self.figures[n].double() for n in names]).tolist() if names else []
        labels, positions, real = counts.tolist()
        self.totals = {"labels": labels, "positions": positions, "real": real}
        self.means = figure_means(dict(zip(names, sums)), self.figure_units, labels, self.steps * world_size)
        return float(loss_sum) / max(labels, 1.0)


def figure_means(sums: dict[str, float], units: dict[str, str], loss_units: float, steps: float) -> dict:
    """Each figure's mean: over the figure ``units`` names for it (GRPO's reward over its 'completions'), per
    process and step ('steps'), or over the loss's units (label tokens or records)."""
    def over(name: str) -> float:
        unit = units.get(name)
        if unit == "steps":
            return steps
        return sums.get(unit, 0.0) if unit is not None else loss_units
    return {n: v / max(over(n), 1.0) for n, v in sums.items()}


def _progress_bar(settings: LoopSettings, start_step: int, progress: bool):
    # in a terminal the bar redraws often; in a log file a line every 15 s is plenty
    return tqdm(total=settings.total_steps, initial=start_step, desc="train", unit="step",
                disable=not (progress and settings.rank == 0), dynamic_ncols=True,
                mininterval=0.2 if sys.stderr.isatty() else 15.0)


class Trainer:
    """One run of the loop: the ``Training`` it was given and the state the steps build up (the step, the
    window being logged, the steps whose skip flags are not read yet, early stopping)."""

    def __init__(self, training: Training, stop: StopRequest):
        self.t, self.stop = training, stop
        self.is_main = training.settings.rank == 0
        self.step = training.start_step
        self.window = _Window(training.policy.device, training.policy.figure_units)
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, skipped, back-off) not yet read
        self.patience = _EarlyStopping(training.settings.early_stopping_patience, training.on_best)
        self.wants_eval = training.evaluate is not None and training.settings.eval_every
        self.early_stop = False
        self.saved_step: int | None = None
        self.records: list[dict] = []
        self.check_patches = "the first step" if training.patches else None  # where the next check is due

    def run(self) -> list[dict]:
        """Step, log, evaluate, save and heed a stop request, step after step; then the final checkpoint."""
        t, settings = self.t, self.t.settings
        bar = _progress_bar(settings, t.start_step, t.progress)
        non_blocking = bool(settings.loader_kwargs.get("pin_memory"))
        t.model.train()
        for group in batches(t.dataset, t.collate, settings, t.start_step):
            if self.step >= settings.total_steps or self.early_stop:
                break
            checking = self.check_patches
            if checking:
                t.patches.before_step()
            out = train_step_on(t.model, t.optimizer, t.scheduler, group, t.policy, non_blocking)
            self.step += 1
            if checking:
                t.patches.after_step(self.step, checking)
                self.check_patches = None
            self.pending.append((self.step, out["skipped"], out["backoff"]))
            self.window.add(out, group, settings.world_size)
            bar.update(1)
            last = self.step == settings.total_steps
            if self.step % settings.log_every == 0 or last:
                self._log(out, last, bar)
            elif self.wants_eval and self.step % settings.eval_every == 0:
                self._evaluate_between_logs()
            saved = None
            if t.checkpoints is not None and settings.save_every and self.step % settings.save_every == 0 \
                    and not last:
                saved, save_s = self.window.timed(self._save)
                if self.is_main:
                    t.metrics.write({"step": self.step, "checkpoint_time_s": save_s})
                self.saved_step = self.step
            signum = self.stop.agreed(settings.world_size, t.policy.device) if not last else None
            if signum:
                if saved is None and t.checkpoints is not None:
                    saved = self._save()
                bar.close()
                raise Interrupted(self.step, signum, saved)
        bar.close()
        self._read_skips()
        if t.checkpoints is not None and self.step > t.start_step and self.saved_step != self.step:
            # the final checkpoint: the run's end is resumable (and known complete) before anything else runs
            self._save()
        return self.records

    def _log(self, out: dict, last: bool, bar) -> None:
        """A log step: the skip flags read, one line of metrics.jsonl (with the validation loss when due)."""
        t, settings = self.t, self.t.settings
        self._read_skips()
        record = self._record(out)
        if self.wants_eval and (self.step % settings.eval_every == 0 or last):
            figures, record["eval_time_s"] = self.window.timed(t.evaluate)
            record.update(figures)
            self._back_to_training()
            self.early_stop, saved_s = self._patience(record["val_loss"])
            if saved_s is not None:
                record["checkpoint_time_s"] = saved_s
            if self.early_stop:
                record["early_stop"] = True
        self.records.append(record)
        if self.is_main:
            t.metrics.write(record)
            # refresh=False: the bar draws at its own interval (one line per 15 s in a log file), not per log
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                            **({"tok/s": f"{record['tokens_per_s']:,.0f}",
                                "eff": f"{record['effective_tokens_per_s']:,.0f}"}
                               if record.get("tokens_per_s") else {}),
                            **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}), refresh=False)
        self.window.reset()

    def _evaluate_between_logs(self) -> None:
        t = self.t
        figures, eval_s = self.window.timed(t.evaluate)
        self._back_to_training()
        self.early_stop, saved_s = self._patience(figures["val_loss"])
        line = {"step": self.step, **figures, "eval_time_s": eval_s,
                **({"checkpoint_time_s": saved_s} if saved_s is not None else {}),
                **({"early_stop": True} if self.early_stop else {})}
        if self.early_stop:
            self.records.append(line)
        if self.is_main:
            t.metrics.write(line)

    def _back_to_training(self) -> None:
        self.t.model.train()
        if self.t.patches:
            self.check_patches = f"the first step after the evaluation at step {self.step}"

    def _record(self, out: dict) -> dict:
        """One line of metrics.jsonl for the window ending at this step."""
        t, window = self.t, self.window
        loss = window.mean_loss(t.settings.world_size)
        elapsed = time.perf_counter() - window.start - window.paused  # training steps only
        record = {
            "step": self.step,
            "loss": loss,
            **window.means,
            "lr": t.scheduler.get_last_lr()[0],
            "grad_norm": float(out["grad_norm"]),
            "step_time_s": elapsed / window.steps,
            "samples_per_s": window.samples / elapsed if elapsed > 0 else None,
            **throughput(window.totals, elapsed, t.settings, t.policy.per_record),
            "peak_memory_bytes": t.memory_reader().peak_bytes,
            "skipped_steps": t.skips.total,
        }
        if t.policy.scaler is not None:
            record["loss_scale"] = float(t.policy.scaler.get_scale())
            record["scaler_backoffs"] = t.skips.scaler_backoffs
        return record

    def _patience(self, val: float) -> tuple[bool, float | None]:
        """Early stopping's verdict on ``val``; with the seconds spent saving a new best adapter (None if none)."""
        best = self.patience.best
        stop, seconds = self.window.timed(lambda: self.patience.ran_out(self.step, val))
        saved = self.patience.on_best is not None and self.patience.best < best
        return stop, seconds if saved else None

    def _read_skips(self) -> None:
        """Read the pending steps' skip flags (one sync, where the loop syncs anyway) and account for them."""
        t, pending, skips, settings = self.t, self.pending, self.t.skips, self.t.settings
        if not pending:
            return
        flags = torch.stack([torch.stack([flag, backoff.to(flag.device)]) for _, flag, backoff in pending]).tolist()
        n_skipped = 0
        for (step, _, _), (skipped, backoff) in zip(pending, flags):
            if backoff:
                skips.scaler_backoffs += 1
                continue
            if not skipped:
                skips.consecutive = 0
                continue
            n_skipped += 1
            skips.total += 1
            skips.consecutive += 1
            records = getattr(t.dataset, "records", None)
            where = [records[i].where for i in step_indices(len(t.dataset), settings, step)] if records else []
            entry = {"step": step, "skipped": "non-finite loss or gradient norm", "records": where}
            skips.steps.append(entry)
            print(f"step {step} skipped: non-finite loss or gradient norm (records {', '.join(where)})",
                  file=sys.stderr, flush=True)
            if self.is_main:
                t.metrics.write(entry)
            if settings.max_skipped_steps and skips.consecutive >= settings.max_skipped_steps:
                pending.clear()
                last = skips.steps[-skips.consecutive:]
                raise NonFiniteStop(
                    f"{skips.consecutive} consecutive steps had a non-finite loss or gradient norm (steps "
                    f"{', '.join(str(e['step']) for e in last)}; records "
                    f"{', '.join(sorted({w for e in last for w in e['records']}))}); the run stops. No skipped "
                    f"step was applied, so the newest checkpoint holds the last good weights. Lower --lr, use "
                    f"--precision fp32 or bf16, check these records, or raise --max-skipped-steps.")
        if t.policy.scaler is None:  # the scaler's skipped steps never reached the optimizer
            settle_step_counters(t.optimizer, n_skipped, t.policy.device)
        pending.clear()

    def _save(self):
        """A checkpoint of this step: every process its share (``--shard fsdp``), else rank 0 alone, the others
        told whether it managed."""
        t, step, device = self.t, self.step, self.t.policy.device
        self._read_skips()  # the step counters must be settled before they are saved
        if t.checkpoints.collective:
            return t.checkpoints.save(step, t.model, t.optimizer, t.scheduler, t.policy.scaler, device)
        path, problem = None, None
        if self.is_main:
            try:
                path = t.checkpoints.save(step, model_for_saving(t.model), t.optimizer, t.scheduler,
                                          t.policy.scaler, device)
            except Exception as e:  # noqa: BLE001 - any failure: the other processes must hear of it, not wait
                problem = e
        if t.settings.world_size > 1:
            # rank 0 writes alone; the others learn whether it did (a barrier would leave them waiting until the
            # process-group timeout when rank 0 stops): every process stops with rank 0's message
            said = [None if problem is None else _problem_message(problem, step)]
            torch.distributed.broadcast_object_list(said, src=0, device=_object_device(device))
            if problem is None and said[0] is not None:
                raise CheckpointWriteError(said[0])
        if problem is not None:
            raise problem
        return path


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
        out["mfu"] = out["effective_tokens_per_s"] * settings.flops_per_token / (settings.peak_flops
                                                                                 * settings.world_size)
    return out


def _problem_message(problem: BaseException, step: int) -> str:
    if isinstance(problem, CheckpointWriteError):
        return str(problem)
    return f"writing the checkpoint of step {step} failed on rank 0 ({problem.__class__.__name__}: {problem})"


def _object_device(device: torch.device) -> torch.device | None:
    """Where broadcast_object_list stages its bytes: the training device (NCCL, HCCL), or the host (gloo)."""
    return None if device.type == "cpu" else device


def model_for_saving(model):
    """The PEFT model inside a DistributedDataParallel wrapper, or the model itself."""
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
