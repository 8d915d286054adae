"""The owner of a run: one ``Trainer`` holds the model, the optimizer and its schedule, the data order, the
checkpoints, the metrics and the step counter, built once from the resolved plan (``planning.preflight``).

``train()`` reads top to bottom: step, log, evaluate, save, heed a stop request, step after step; then the final
checkpoint. It reads the step's device flags only where it syncs anyway (log steps and checkpoints), so a
skipped step costs no extra host-device sync; it stops on SIGTERM/SIGINT (``signals.StopRequest``) after the
current step with a checkpoint, and after ``--max-skipped-steps`` consecutive non-finite steps. The trainer
owns no run folder of its own choosing: ``vlft run`` gives it one (``RunOutput``), ``vlft parity`` none.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vlft.config import RunConfig
from vlft.data.encoding import EncodedDataset
from vlft.data.lazy import modalities
from vlft.data.order import batches, step_indices
from vlft.models.bundled import require_weights
from vlft.models.patching import PatchWatch
from vlft.models.vision import install_vision_warmup
from vlft.planning.plan import RunPlan, choose_backend, require_available
from vlft.planning.preflight import check_fits, fused_optimizer, plan_run
from vlft.registry import Registry
from vlft.training.checkpoints import (
    CheckpointStore,
    CheckpointWriteError,
    read_checkpoint,
    set_rng_state,
    training_state,
)
from vlft.training.fsdp import OPTIMIZER_DIR, load_optimizer
from vlft.training.loop import (
    EarlyStopping,
    SkipLog,
    Window,
    model_for_saving,
    object_device,
    problem_message,
    progress_bar,
    throughput,
)
from vlft.training.metrics import MetricsLog
from vlft.training.sequence import install_sequence_split
from vlft.training.setup import (
    adapted,
    adapter_to_save,
    base_model,
    disable_dropout,
    init_distributed,
    loop_settings,
    optimizer_and_schedule,
    place,
    probe_packing,
    reference_model,
    run_collator,
    seeded_device,
    step_prepare,
)
from vlft.training.signals import Interrupted, NonFiniteStop, StopRequest
from vlft.training.step import StepPolicy, StepResult, settle_step_counters, train_step_on
from vlft.training.validation import objective_validation, validation_loss


@dataclass(frozen=True)
class RunOutput:
    """Where a run writes its checkpoints, metrics and adapters (``vlft run``'s folder)."""

    folder: Path
    identity: dict | None = None  # what defines the training (training.resume.run_identity), kept in checkpoints
    sinks: tuple = ()  # metric sink factories (--report-to), each opened on rank 0


@dataclass(frozen=True)
class TrainingOutcome:
    """What training did, for the run's summary."""

    steps: int  # the run's total steps
    resumed_from: int
    train_time_s: float
    skipped_steps: int
    skipped: list[dict]
    scaler_backoffs: int
    best_step: int | None  # --early-stopping-patience: the best validation loss and its step
    best_val_loss: float | None


def build_trainer(
    registry: Registry,
    config: RunConfig,
    *,
    resume_from: Path | None = None,
    choice=None,
    output: RunOutput | None = None,
    progress: bool = True,
) -> Trainer:
    """Check everything (``preflight``), then the trainer, set up and ready for its first step.

    ``resume_from``: a checkpoint folder the trainer continues from. ``choice``: the backend already chosen (and
    probed) by the caller, so it is not probed twice. Every hook answer is taken here, before the first step.
    """
    choice = choice or choose_backend(registry, config.backend)
    require_available(choice)
    device = seeded_device(registry, choice.info.name, config)
    plan = plan_run(registry, config, choice)
    require_weights(plan.model_path, config.model, registry)
    check_fits(plan)
    if config.world_size > 1 or plan.sharding.enabled:
        init_distributed(plan, device)
        if output is not None and config.world_size > 1:
            output = RunOutput(_shared_folder(output.folder), output.identity, output.sinks)
    return Trainer(
        registry=registry, plan=plan, device=device, resume_from=resume_from, output=output, progress=progress
    )


def _shared_folder(folder: Path) -> Path:
    """Every process writes under rank 0's folder (a default name carries a time stamp)."""
    shared = [str(folder)]
    torch.distributed.broadcast_object_list(shared, src=0)
    return Path(shared[0])


class Trainer:
    """One run's state, on one object: the adapted model, its optimizer, schedule and loss scaler, the step
    policy, the data and its order, the checkpoints and metrics, the step counter, and what the loop builds up
    (the window being logged, the steps whose skip flags are not read yet, early stopping, skipped steps)."""

    def __init__(
        self,
        *,
        registry: Registry,
        plan: RunPlan,
        device,
        resume_from: Path | None = None,
        output: RunOutput | None = None,
        progress: bool = True,
    ):
        config = plan.config
        self.plan, self.config, self.device, self.progress = plan, config, device, progress
        self.registry = registry
        self.memory_reader = registry.first("vlft_memory_reader", backend=plan.backend.info.name, device=device)
        # the model: loaded, patched, adapted, on its device; every step runs the towers the data uses, on every
        # process, one included (models.vision)
        model, self.patches = base_model(registry, plan, device)
        self.model, self.setup_notes = adapted(registry, plan, model, resume_from)
        place(self.model, plan, device)
        probe_packing(self.model, plan)
        towers = modalities(plan.train_records)
        if not towers and (config.world_size > 1 or self.sharded):
            # text-only data: the vision adapter still takes part in every step, or DDP stops at the second
            # step on parameters no loss used (and FSDP's gathers fall out of step)
            towers = {"image"}
        install_vision_warmup(self.model, towers, plan.family, sharded=self.sharded)
        split = None
        if plan.sequence is not None and plan.sequence.enabled:
            split = install_sequence_split(self.model, plan.family, plan.sequence.size)
        # how it trains
        precision = plan.precision
        self.autocast_dtype = getattr(torch, precision.autocast_dtype) if precision.autocast_dtype else None
        self.scaler = None
        if precision.loss_scaling:
            assert precision.make_scaler is not None, f"the {precision.name} precision scales the loss: make_scaler"
            self.scaler = precision.make_scaler()
        self.optimizer, self.scheduler = optimizer_and_schedule(self.model, plan)
        self.step = 0
        kept_reference = None
        if resume_from is not None:
            kept_reference = self.load_checkpoint(resume_from)
        self.start_step, self.checkpoint = self.step, resume_from
        objective = plan.objective
        if not objective.dropout:
            disable_dropout(self.model)
        self.reference = (
            reference_model(self.model, plan, device, resume_from, kept_reference) if objective.reference else None
        )
        self.policy = StepPolicy(
            device,
            self.autocast_dtype,
            self.scaler,
            config.max_grad_norm,
            config.grad_accum,
            config.world_size,
            flags_on_host=device.type == "cpu",
            fused_optimizer=fused_optimizer(plan),
            objective=objective,
            reference=self.reference,
            encoder=plan.encoder,
            prepare=step_prepare(objective, self.start_step),
            split=split,
            sharded=self.sharded,
        )
        # what it trains and validates on, in which order
        self.settings = loop_settings(plan, self.model)
        self.collate = run_collator(plan)
        self.dataset = EncodedDataset(plan.train_records, plan.encoder)
        # where it writes
        self.output = output.folder if output is not None else None
        self.checkpoints = self._checkpoint_store(output)
        main = output if config.rank == 0 else None  # rank 0 writes the metrics
        self.metrics = MetricsLog(
            main.folder / "metrics.jsonl" if main else None,
            [open_sink(main.folder) for open_sink in main.sinks] if main else None,
        )
        if resume_from is not None:
            self.metrics.truncate_after(self.start_step)  # the lines past the checkpoint are written again
        # what training builds up
        self.skips = SkipLog()
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, skipped, back-off) not yet read
        self.best: dict = {}
        self.train_time = 0.0
        self.records: list[dict] = []

    # -- what the run is ------------------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        """Processes talk: several of them, or one sharding on its own."""
        return self.config.world_size > 1 or self.sharded

    @property
    def sharded(self) -> bool:
        return bool(self.plan.sharding and self.plan.sharding.enabled)

    @property
    def is_main(self) -> bool:
        return self.config.rank == 0

    @property
    def folder(self) -> Path:
        """The run's folder (``vlft run``'s trainer always has one; a trainer built without a ``RunOutput``
        writes nothing)."""
        assert self.output is not None, "this trainer was built without a RunOutput: it has no folder"
        return self.output

    def describe(self, notes: Sequence[str] = ()) -> dict:
        """The plan as planned, with what setting the model up did and ``notes`` of the caller's."""
        desc = self.plan.describe()
        return {**desc, "model_patches": self.patches, "notes": [*desc["notes"], *self.setup_notes, *notes]}

    def outcome(self) -> TrainingOutcome:
        return TrainingOutcome(
            steps=self.settings.total_steps,
            resumed_from=self.start_step,
            train_time_s=self.train_time,
            skipped_steps=self.skips.total,
            skipped=self.skips.steps,
            scaler_backoffs=self.skips.scaler_backoffs,
            best_step=self.best.get("step"),
            best_val_loss=self.best.get("val_loss"),
        )

    # -- one step -------------------------------------------------------------------------------------------

    def batches(self):
        """The step groups (``grad_accum`` host micro-batches each) from the current step on."""
        return batches(self.dataset, self.collate, self.settings, self.step)

    def train_step(self, group: list[dict], model=None) -> StepResult:
        """One optimizer step on ``group`` (host batches); ``model``: the model to step (DDP's wrapper)."""
        non_blocking = bool(self.settings.loader_kwargs.get("pin_memory"))
        model = self.model if model is None else model
        result = train_step_on(model, self.optimizer, self.scheduler, group, self.policy, non_blocking)
        self.step += 1
        return result

    # -- the loop -------------------------------------------------------------------------------------------

    def train(self) -> list[dict]:
        """Train from the current step to ``total_steps`` under DDP when several processes hold the whole model;
        return the logged records. SIGTERM or SIGINT stops it after the current step with a checkpoint
        (``Interrupted``); too many consecutive non-finite steps stop it with ``NonFiniteStop``. With
        ``--early-stopping-patience`` it stops once that many validation losses in a row were no better than
        the best so far. The metrics are closed when it returns or stops."""
        model = self._training_model()
        t0 = time.perf_counter()
        try:
            with StopRequest() as stop:
                return self._loop(model, stop)
        finally:
            self.train_time = time.perf_counter() - t0
            self.metrics.close()

    def _loop(self, model, stop: StopRequest) -> list[dict]:
        settings = self.settings
        bar = progress_bar(settings, self.start_step, self.progress)
        self.window = Window(self.device, self.policy.figure_units)
        self.patience = EarlyStopping(
            settings.early_stopping_patience, self._save_best if self.config.early_stopping_patience else None
        )
        self.wants_eval = bool(settings.eval_every)
        self.early_stop, saved_step = False, None
        self.watch = PatchWatch(self.model)
        self.check_patches = "the first step" if self.watch else None  # where the next check is due
        model.train()
        for group in self.batches():
            if self.step >= settings.total_steps or self.early_stop:
                break
            result = self._checked_step(group, model)
            self.pending.append((self.step, result.skipped, result.backoff))
            self.window.add(result, group, settings.world_size)
            bar.update(1)
            last = self.step == settings.total_steps
            if self.step % settings.log_every == 0 or last:
                self._log(result, last, bar, model)
            elif self.wants_eval and self.step % settings.eval_every == 0:
                self._evaluate_between_logs(model)
            saved = None
            if (
                self.checkpoints is not None
                and settings.save_every
                and self.step % settings.save_every == 0
                and not last
            ):
                saved, save_s = self.window.timed(lambda: self.save(model))
                if self.is_main:
                    self.metrics.write({"step": self.step, "checkpoint_time_s": save_s})
                saved_step = self.step
            signum = stop.agreed(settings.processes, self.device) if not last else None
            if signum:
                if saved is None and self.checkpoints is not None:
                    saved = self.save(model)
                bar.close()
                raise Interrupted(self.step, signum, saved)
        bar.close()
        self._read_skips()
        if self.checkpoints is not None and self.step > self.start_step and saved_step != self.step:
            # the final checkpoint: the run's end is resumable (and known complete) before anything else runs
            self.save(model)
        return self.records

    def _checked_step(self, group: list[dict], model) -> StepResult:
        """A step; where a check is due, with the kernel patches checked to have run in it."""
        checking = self.check_patches
        if checking:
            self.watch.before_step()
        result = self.train_step(group, model)
        if checking:
            self.watch.after_step(self.step, checking)
            self.check_patches = None
        return result

    def _training_model(self):
        """The model the steps run: under DDP when several processes hold the whole model."""
        if self.config.world_size > 1 and not self.sharded:
            device = self.device
            return torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type != "cpu" and device.index is not None else None
            )
        return self.model

    def _log(self, result: StepResult, last: bool, bar, model) -> None:
        """A log step: the skip flags read, one line of metrics.jsonl (with the validation loss when due)."""
        settings = self.settings
        self._read_skips()
        record = self._record(result)
        if self.wants_eval and (self.step % settings.eval_every == 0 or last):
            figures, record["eval_time_s"] = self.window.timed(self.evaluate)
            record.update(figures)
            self._back_to_training(model)
            self.early_stop, saved_s = self._patience(record["val_loss"])
            if saved_s is not None:
                record["checkpoint_time_s"] = saved_s
            if self.early_stop:
                record["early_stop"] = True
        self.records.append(record)
        if self.is_main:
            self.metrics.write(record)
            # refresh=False: the bar draws at its own interval (one line per 15 s in a log file), not per log
            bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                lr=f"{record['lr']:.2e}",
                **(
                    {"tok/s": f"{record['tokens_per_s']:,.0f}", "eff": f"{record['effective_tokens_per_s']:,.0f}"}
                    if record.get("tokens_per_s")
                    else {}
                ),
                **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}),
                refresh=False,
            )
        self.window.reset()

    def _evaluate_between_logs(self, model) -> None:
        figures, eval_s = self.window.timed(self.evaluate)
        self._back_to_training(model)
        self.early_stop, saved_s = self._patience(figures["val_loss"])
        line = {
            "step": self.step,
            **figures,
            "eval_time_s": eval_s,
            **({"checkpoint_time_s": saved_s} if saved_s is not None else {}),
            **({"early_stop": True} if self.early_stop else {}),
        }
        if self.early_stop:
            self.records.append(line)
        if self.is_main:
            self.metrics.write(line)

    def _back_to_training(self, model) -> None:
        model.train()
        if self.watch:
            self.check_patches = f"the first step after the evaluation at step {self.step}"

    def _record(self, result: StepResult) -> dict:
        """One line of metrics.jsonl for the window ending at this step."""
        window = self.window
        figures = window.close(self.settings.processes, self.settings.sequence_parallel)
        elapsed = time.perf_counter() - window.start - window.paused  # training steps only
        record = {
            "step": self.step,
            "loss": figures.loss,
            **figures.means,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(result.grad_norm),
            "step_time_s": elapsed / window.steps,
            "samples_per_s": window.samples / elapsed if elapsed > 0 else None,
            **throughput(figures.totals, elapsed, self.settings, self.policy.per_record),
            "peak_memory_bytes": self.memory_reader().peak_bytes,
            "skipped_steps": self.skips.total,
        }
        if self.scaler is not None:
            record["loss_scale"] = float(self.scaler.get_scale())
            record["scaler_backoffs"] = self.skips.scaler_backoffs
        return record

    def _patience(self, val: float) -> tuple[bool, float | None]:
        """Early stopping's verdict on ``val``; with the seconds spent saving a new best adapter (None if none)."""
        best = self.patience.best
        stop, seconds = self.window.timed(lambda: self.patience.ran_out(self.step, val))
        saved = self.patience.on_best is not None and self.patience.best < best
        return stop, seconds if saved else None

    def _read_skips(self) -> None:
        """Read the pending steps' skip flags (one sync, where the loop syncs anyway) and account for them."""
        pending, skips, settings = self.pending, self.skips, self.settings
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
            records = self.dataset.records
            where = [records[i].where for i in step_indices(len(self.dataset), settings, step)] if records else []
            entry = {"step": step, "skipped": "non-finite loss or gradient norm", "records": where}
            skips.steps.append(entry)
            print(
                f"step {step} skipped: non-finite loss or gradient norm (records {', '.join(where)})",
                file=sys.stderr,
                flush=True,
            )
            if self.is_main:
                self.metrics.write(entry)
            if settings.max_skipped_steps and skips.consecutive >= settings.max_skipped_steps:
                pending.clear()
                last = skips.steps[-skips.consecutive :]
                raise NonFiniteStop(
                    f"{skips.consecutive} consecutive steps had a non-finite loss or gradient norm (steps "
                    f"{', '.join(str(e['step']) for e in last)}; records "
                    f"{', '.join(sorted({w for e in last for w in e['records']}))}); the run stops. No skipped "
                    f"step was applied, so the newest checkpoint holds the last good weights. Lower --lr, use "
                    f"--precision fp32 or bf16, check these records, or raise --max-skipped-steps."
                )
        if self.scaler is None:  # the scaler's skipped steps never reached the optimizer
            settle_step_counters(self.optimizer, n_skipped, self.device)
        pending.clear()

    # -- evaluation -----------------------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """The validation figures: ``val_loss`` (the objective's loss) and the objective's ``val_<figure>``."""
        objective = self.plan.objective
        with self.policy.splitting():
            if objective.supervised:
                return {"val_loss": validation_loss(self.model, self.val_batches, self.device, self.autocast_dtype)}
            return objective_validation(self.model, self.val_batches, self.policy.passes(), objective)

    @functools.cached_property
    def val_batches(self) -> list[dict]:
        """The first ``--eval-batches`` batches of the validation records, fixed for the whole run (encoded at
        the first evaluation)."""
        config, records, encoder = self.config, self.plan.val_records, self.plan.encoder
        size = config.batch_size
        return [
            self.collate([encoder.encode(r) for r in records[i : i + size]])
            for i in range(0, min(len(records), config.eval_batches * size), size)
        ]

    # -- saving and resuming --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint's state.pt holds (``checkpoints.training_state``); the optimizer's state is left out
        when sharded (each process writes its share)."""
        reference = self.reference.state() if self.reference is not None else None
        return training_state(
            self.step, None if self.sharded else self.optimizer, self.scheduler, self.scaler, self.device, reference
        )

    def load_state_dict(self, state: dict) -> None:
        """Optimizer (unless sharded: ``load_checkpoint`` reads its shares), scheduler, scaler, RNG and step."""
        if not self.sharded:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], self.device)
        self.step = int(state["step"])

    def load_checkpoint(self, checkpoint: Path) -> dict | None:
        """Continue from ``checkpoint`` (its adapter was loaded with the model); returns the reference weights it
        kept (``Reference.state``), or None."""
        state = read_checkpoint(checkpoint, self.sharded)
        if self.sharded:
            load_optimizer(self.model, self.optimizer, checkpoint / OPTIMIZER_DIR)
        self.load_state_dict(state)
        return state.get("reference") or None

    def save(self, model=None):
        """A checkpoint of this step: every process its share (``--shard fsdp``), else rank 0 alone, the others
        told whether it managed. ``model``: the model the steps run (DDP's wrapper)."""
        store = self.checkpoints
        assert store is not None, "the loop saves only where the trainer has a checkpoint store"
        model = self.model if model is None else model
        step, device = self.step, self.device
        self._read_skips()  # the step counters must be settled before they are saved
        if store.collective:
            adapter = self.adapter_to_save()  # collective
            return store.save(step, self.state_dict(), adapter, (self.model, self.optimizer))
        path, problem = None, None
        if self.is_main:
            try:
                path = store.save(step, self.state_dict(), model_for_saving(model))
            except Exception as e:  # noqa: BLE001 - any failure: the other processes must hear of it, not wait
                problem = e
        if self.settings.processes > 1:
            # rank 0 writes alone; the others learn whether it did (a barrier would leave them waiting until the
            # process-group timeout when rank 0 stops): every process stops with rank 0's message
            said = [None if problem is None else problem_message(problem, step)]
            torch.distributed.broadcast_object_list(said, src=0, device=object_device(device))
            if problem is None and said[0] is not None:
                raise CheckpointWriteError(said[0])
        if problem is not None:
            raise problem
        return path

    def adapter_to_save(self):
        """What the method's saver writes: the model, or under ``--shard fsdp`` the adapter gathered whole (on
        rank 0; None on the others). Every process must call it when sharded: gathering is collective."""
        return adapter_to_save(self.model, self.plan.skeleton, self.sharded)

    def save_adapter(self, target: Path) -> None:
        """The adapter into ``target``, written whole beside it before it replaces what was there. Every process
        calls it (gathering a sharded adapter is collective); rank 0 writes."""
        to_save = self.adapter_to_save()
        if not self.is_main:
            return
        tmp = target.parent / f".{target.name}-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self._write_adapter(to_save, tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)

    def _write_adapter(self, model, path: Path) -> None:
        self.registry.first("vlft_save_adapter", method=self.plan.method.name, model=model, path=path)

    def _save_best(self, step: int, loss: float) -> None:
        # beside adapter/ (the last), written whole before it replaces the previous best
        self.save_adapter(self.folder / "adapter-best")
        self.best.update(step=step, val_loss=loss)

    def _checkpoint_store(self, output: RunOutput | None) -> CheckpointStore | None:
        if output is None:
            return None
        return CheckpointStore(
            output.folder / "checkpoints",
            self.config.keep_checkpoints,
            self._write_adapter,
            identity=output.identity,
            collective=self.sharded,
        )

    # -- after training -------------------------------------------------------------------------------------

    def free_optimizer_state(self) -> None:
        """The AdamW moments are not needed once the last checkpoint holds them: free them before the
        evaluation generates, so it runs in what training used."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        if self.device.type != "cpu":
            module = getattr(torch, self.device.type, None)
            if module is not None and hasattr(module, "empty_cache"):
                module.empty_cache()

    def close(self) -> None:
        """Leave the process group, every process together."""
        if self.distributed:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
