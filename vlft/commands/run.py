"""``vlft run``: from a config to a trained adapter, an evaluation and a report.

Order matters for the promise "bad input loses nothing": the run folder is
checked (not created), then everything in ``preflight`` (backend, method,
model config, every data record, the memory plan) before the folder is
created or any weight is loaded onto a device.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vlft.config import RunConfig
from vlft.contracts.backend import MemoryStats
from vlft.errors import ConfigError
from vlft.evaluation.generation import evaluate_generation
from vlft.evaluation.inference import write_atomically
from vlft.evaluation.scoring import format_table
from vlft.evaluation.validation import objective_validation, validation_loss
from vlft.models.patching import KernelPatchLost, PatchWatch
from vlft.planning.memory import gib
from vlft.planning.plan import RunPlan, choose_backend, format_plan, require_available
from vlft.planning.preflight import plan_run
from vlft.planning.sharding import base_bytes
from vlft.registry import Registry
from vlft.training.checkpoints import (
    RUN_IDENTITY,
    CheckpointStore,
    CheckpointWriteError,
    newest_checkpoint,
)
from vlft.training.loop import SkipLog, Training, run_training
from vlft.training.metrics import MetricsLog
from vlft.training.resume import check_same_run, resume_command, run_identity
from vlft.training.session import prepare
from vlft.training.signals import Interrupted, NonFiniteStop


@dataclass
class RunResult:
    output: Path | None
    plan: RunPlan | None  # None: --resume found the run complete
    before: dict | None = None
    after: dict | None = None
    metrics: list | None = None
    description: dict | None = None  # the resolved plan (a real run's: with what setting the model up did)


def log(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def default_output(config: RunConfig, backend: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{config.method}-{backend}"


def run_folder(config: RunConfig, choice) -> Path:
    """Where the run writes: ``--output`` or a new time-stamped folder; checked, not yet created.

    A folder that already holds a run is refused unless ``--resume`` continues it.
    """
    output = Path(config.output) if config.output else default_output(config, choice.info.name)
    if config.resume:
        if not (output / "checkpoints").exists():
            raise ConfigError(f"--resume: no checkpoints in {output}; give the --output of the run to continue")
    elif output.exists() and any(output.iterdir()):
        raise ConfigError(f"--output {output} already holds a run; choose another folder or pass --resume")
    return output


def execute(registry: Registry, config: RunConfig, progress: bool = True) -> RunResult:
    """The whole job: checks -> folder -> resume -> set-up -> evaluate before -> train -> evaluate after ->
    adapter -> summary (see the module docstring for why checks come first)."""
    if config.dry_run:
        plan = plan_run(registry, config).plan
        return RunResult(None, plan, description=plan.describe())
    choice = choose_backend(registry, config.backend)
    require_available(choice)
    output = run_folder(config, choice)
    sink_factories = metric_sinks(registry, config)
    identity = run_identity(config)
    resume_from = _checkpoint_to_resume(config, output, identity)
    complete = _completed(output, resume_from, config)
    if complete is not None:
        log(f"--resume: the run in {output} is complete ({complete['steps']} steps, checkpoint "
            f"{resume_from.name}); nothing to train. Its adapter: {complete.get('adapter')}", config.rank)
        return RunResult(output, None, metrics=[])
    s = prepare(registry, config, resume_from=resume_from, choice=choice)
    job = _Job(s, _shared_output(s, output), identity, sink_factories, progress)
    job.write_plan()
    before = job.evaluate_before()
    records = job.train()  # ends with a checkpoint of the last step
    job.save_adapter()  # before the evaluation: whatever it does, the trained adapter is kept
    job.free_optimizer_state()
    after, eval_error = job.evaluate_after()
    job.write_summary(before, after, records, eval_error)
    job.finish()
    return RunResult(job.output, s.plan, before, after, records, job.description)


def _completed(output: Path, resume_from: Path | None, config: RunConfig) -> dict | None:
    """``--resume`` on a run that finished: its summary says completed and its newest checkpoint is of the
    last step, and ``--steps`` asks for no more (a finished run extended with ``--force-resume --steps N``
    trains on). The summary then, else None."""
    path = output / "summary.json"
    if resume_from is None or not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    step = int(resume_from.name.rpartition("-")[2]) if resume_from.name.startswith("step-") else -1
    if summary.get("status") != "completed" or step != summary.get("steps"):
        return None
    if config.steps is not None and config.steps > step:
        return None
    return summary


def _checkpoint_to_resume(config: RunConfig, output: Path, identity: dict) -> Path | None:
    """``--resume``: the newest checkpoint that verifies, after checking it belongs to the same training."""
    if not config.resume:
        return None
    resume_from = newest_checkpoint(output / "checkpoints", report=lambda m: log(m, config.rank))
    saved = resume_from / RUN_IDENTITY
    check_same_run(json.loads(saved.read_text()) if saved.exists() else None, identity, resume_from,
                   config.force_resume, lambda m: log(m, config.rank))
    return resume_from


def _shared_output(s, output: Path) -> Path:
    """Every process writes under rank 0's folder (a default name carries a time stamp)."""
    if not s.distributed:
        return output
    shared = [str(output)]
    torch.distributed.broadcast_object_list(shared, src=0)
    return Path(shared[0])


class _Job:
    """One prepared run and what its steps share: the folder, metrics, checkpoints and evaluation data."""

    def __init__(self, s, output: Path, identity: dict, sink_factories: list, progress: bool):
        config = s.config
        self.s, self.config, self.output, self.progress = s, config, output, progress
        self.rank, self.model, self.device = config.rank, s.model, s.device
        self.eval_records = s.val_records[: config.eval_samples] if config.eval_samples else s.val_records
        self.val_batches = [s.collate([s.encoder.encode(r) for r in s.val_records[i:i + config.batch_size]])
                            for i in range(0, min(len(s.val_records), config.eval_batches * config.batch_size),
                                           config.batch_size)]
        self.store = CheckpointStore(output / "checkpoints", config.keep_checkpoints, s.save_adapter)
        self.store.run_identity = identity
        self.store.collective, self.store.adapter_to_save = s.sharded, s.adapter_to_save
        self.store.reference_state = s.reference.state if s.reference is not None else None
        self.objective = s.plan.objective
        self.sharding = sharding_figures(s) if s.sharded else None
        self.metrics = MetricsLog(output / "metrics.jsonl" if self.rank == 0 else None,
                                  [open_sink(output) for open_sink in sink_factories] if self.rank == 0 else None)
        self.skips = SkipLog()
        self.best: dict = {}
        self.train_time = 0.0
        self.description = s.describe([
            f"evaluation generates in batches of {eval_batch_size(config)} (the training micro-batch, at most 16), "
            f"after training, once the adapter is saved and the optimizer state freed"])

    def write_plan(self) -> None:
        s, output = self.s, self.output
        if self.rank != 0:
            return
        output.mkdir(parents=True, exist_ok=True)
        (output / "plan.json").write_text(json.dumps(self.description, indent=2, default=str))
        (output / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        log(format_plan(self.description))
        log(f"data         {len(s.train_records)} training and {len(s.val_records)} validation records")
        log(f"output       {output}")

    def generation_eval(self, model) -> dict:
        s, config = self.s, self.config
        return evaluate_generation(model, s.encoder, self.eval_records, self.device, config.max_new_tokens,
                                   s.autocast_dtype, rank=self.rank, world_size=config.world_size,
                                   synced=s.sharded, batch_size=eval_batch_size(config),
                                   scorers=s.plan.scorers.chosen if s.plan.scorers else None)

    def evaluate(self) -> dict:
        """The validation figures: ``val_loss`` (the objective's loss) and the objective's ``val_<figure>``."""
        if self.objective.supervised:
            return {"val_loss": validation_loss(self.model, self.val_batches, self.device, self.s.autocast_dtype)}
        return objective_validation(self.model, self.val_batches, self.device, self.s.autocast_dtype,
                                    self.objective, self.s.reference)

    def validation_figures(self) -> dict | None:
        """The objective's validation figures now (for before and after training), where it has figures."""
        if self.objective.supervised or not self.val_batches:
            return None
        return self.evaluate()

    def evaluate_before(self) -> dict:
        """The scores of the model training starts from: the base model, or the adapter --init-adapter loaded
        (with the objective's validation figures, where it has them); a resumed run keeps those it wrote
        before."""
        s = self.s
        if s.checkpoint is not None:
            self.metrics.truncate_after(s.start_step)
            log(f"resumed      from step {s.start_step} ({s.checkpoint})", self.rank)
            iterations = s.plan.objective.iterations
            if s.start_step % iterations:  # the kept rollout is not checkpointed (training.rollouts says why)
                first, last = s.start_step + 1, s.start_step - s.start_step % iterations + iterations
                log(f"resumed inside a rollout (--num-iterations {iterations}): the prompts of "
                    f"{f'step {first}' if first == last else f'steps {first}-{last}'} are sampled again by the "
                    f"resumed weights (a checkpoint at a multiple of {iterations} steps resumes exactly)", self.rank)
            eval_path = self.output / "eval.json"
            before = json.loads(eval_path.read_text()).get("before") if eval_path.exists() else None
            if before is not None:
                return before
        if s.plan.init_adapter:
            log(f"evaluating the adapter it starts from ({s.plan.init_adapter}) ...", self.rank)
            before = self.generation_eval(self.model)
        else:
            log("evaluating the base model ...", self.rank)
            with self.model.disable_adapter():
                before = self.generation_eval(self.model)
        validation = self.validation_figures()
        if validation is not None:
            before["validation"] = validation
        if self.rank == 0:
            _write_eval(self.output, before, None)
        return before

    def save_best(self, step: int, loss: float) -> None:
        # beside adapter/ (the last), written whole before it replaces the previous best
        to_save = self.s.adapter_to_save(self.model)  # every process: gathering a sharded adapter is collective
        if self.rank == 0:
            _save_adapter_atomically(self.s, to_save, self.output / "adapter-best")
        self.best.update(step=step, val_loss=loss)

    def train(self) -> list[dict]:
        """The loop, under DDP when several processes hold the whole model; a stop writes its summary."""
        s, config = self.s, self.config
        train_model = self.model
        if config.world_size > 1 and not s.sharded:
            device = self.device
            train_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type != "cpu" and device.index is not None else None)
        log(f"training     {s.settings.total_steps} steps of "
            f"{config.batch_size * config.grad_accum * config.world_size} samples", self.rank)
        t0 = time.perf_counter()
        try:
            records = run_training(Training(
                train_model, s.optimizer, s.scheduler, s.policy, s.dataset, s.collate, s.settings, self.store,
                self.metrics, s.memory_reader, evaluate=self.evaluate if config.eval_every else None,
                on_best=self.save_best if config.early_stopping_patience else None, start_step=s.start_step,
                progress=self.progress, skips=self.skips, patches=PatchWatch(self.model)))
        except Interrupted as e:
            command = resume_command(sys.argv, self.output, config.world_size)
            self.stopped_summary("interrupted", e.step, t0, signal=e.signum,
                                 checkpoint=str(e.checkpoint) if e.checkpoint else None, resume_command=command)
            log(f"interrupted after step {e.step}; checkpoint {e.checkpoint}. Continue with:\n  {command}",
                self.rank)
            self.metrics.close()
            if s.distributed:
                torch.distributed.destroy_process_group()
            raise SystemExit(e.exit_code) from None
        except KernelPatchLost as e:
            self.stopped_summary("stopped: kernel patch lost", None, t0, error=str(e))
            self.metrics.close()
            raise
        except NonFiniteStop:
            newest = self.store.newest()
            self.stopped_summary("stopped: non-finite steps", None, t0, checkpoint=str(newest) if newest else None)
            self.metrics.close()
            raise
        except CheckpointWriteError as e:
            newest = self.store.newest()
            self.stopped_summary("stopped: checkpoint write failed", None, t0, error=str(e),
                                 checkpoint=str(newest) if newest else None,
                                 resume_command=resume_command(sys.argv, self.output, config.world_size)
                                 if newest else None)
            self.metrics.close()
            raise
        self.train_time = time.perf_counter() - t0
        self.metrics.close()
        return records

    def stopped_summary(self, status: str, step: int | None, t0: float, **extra) -> None:
        if self.rank == 0:
            summary = {"status": status, "step": step, "steps": self.s.settings.total_steps,
                       "resumed_from": self.s.start_step, "train_time_s": time.perf_counter() - t0,
                       "skipped_steps": self.skips.total, "skipped": self.skips.steps,
                       "scaler_backoffs": self.skips.scaler_backoffs, **extra}
            try:
                write_atomically(self.output / "summary.json", json.dumps(summary, indent=2))
            except OSError as e:  # the disk that stopped the run may not take this either: the error still prints
                log(f"could not write {self.output / 'summary.json'} ({e})", self.rank)

    def free_optimizer_state(self) -> None:
        """The AdamW moments are not needed once the last checkpoint holds them: free them before the
        evaluation generates, so it runs in what training used."""
        self.s.optimizer.zero_grad(set_to_none=True)
        self.s.optimizer.state.clear()
        if self.device.type != "cpu":
            module = getattr(torch, self.device.type, None)
            if module is not None and hasattr(module, "empty_cache"):
                module.empty_cache()

    def evaluate_after(self) -> tuple[dict | None, str | None]:
        """The adapted model's scores, or (None, the error) when the evaluation fails: the adapter and the
        final checkpoint are already written, so the run is complete without it."""
        log("evaluating the adapted model ...", self.rank)
        try:
            after = self.generation_eval(self.model)
            validation = self.validation_figures()
            if validation is not None:
                after["validation"] = validation
            return after, None
        except Exception as e:
            if self.s.distributed:
                raise  # the other processes wait in the evaluation's collectives: stop them all
            error = f"{e.__class__.__name__}: {e}"
            log(f"the evaluation after training failed ({error}); the adapter is saved in "
                f"{self.output / 'adapter'}. Score it again with: vlft predict", self.rank)
            return None, error

    def save_adapter(self) -> None:
        to_save = self.s.adapter_to_save(self.model)  # every process: gathering a sharded adapter is collective
        if self.rank == 0:
            _save_adapter_atomically(self.s, to_save, self.output / "adapter")

    def write_summary(self, before: dict, after: dict | None, records: list[dict],
                      eval_error: str | None = None) -> None:
        if self.rank != 0:
            return
        s, plan, output, config = self.s, self.s.plan, self.output, self.config
        total_steps = s.settings.total_steps
        _write_eval(output, before, after)
        mem: MemoryStats = s.memory_reader()
        summary = {
            "backend": plan.backend.info.name, "method": plan.method.name, "objective": plan.objective.name,
            "init_adapter": plan.init_adapter, "steps": total_steps,
            "resumed_from": s.start_step, "train_time_s": self.train_time,
            "final_loss": records[-1]["loss"] if records else None, "peak_memory_bytes": mem.peak_bytes,
            "exact_match_before": before.get("exact_match"),
            "exact_match_after": after.get("exact_match") if after is not None else None, "eval_error": eval_error,
            "adapter": str(output / "adapter"),
            "param_dtype": plan.precision.param_dtype, "checkpointing": plan.checkpointing,
            "memory_estimate_bytes": plan.memory.total_bytes() if plan.memory else None,
            **_validation_summary(before, after),
            "skipped_too_long": plan.lengths.get("skipped_samples", []),
            "status": "completed", "skipped_steps": self.skips.total, "skipped": self.skips.steps,
            "scaler_backoffs": self.skips.scaler_backoffs,
            "sharding": self.sharding,
        }
        if config.early_stopping_patience:
            best = self.best
            summary["early_stopping"] = {"stopped_early": any(r.get("early_stop") for r in records),
                                         "best_step": best.get("step"), "best_val_loss": best.get("val_loss"),
                                         "best_adapter": str(output / "adapter-best") if best else None}
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
        if after is not None:
            print(format_table(before, after))
        for name, value in (before.get("validation") or {}).items():
            later = ((after or {}).get("validation") or {}).get(name)
            print(f"{name:<28} {value:10.4f} -> " + (f"{later:.4f}" if later is not None else "-"))
        print(f"adapter saved to {output / 'adapter'} ({total_steps - s.start_step} steps in {self.train_time:.0f} s)")
        print(f"compare it with other runs: vlft report {output} [OTHER_RUN ...] --output {output}-report")

    def finish(self) -> None:
        if self.s.distributed:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def eval_batch_size(config: RunConfig) -> int:
    """The generation evaluation's batch: the training micro-batch (a forward without gradients and its KV
    cache hold less than a training step of as many samples), at most 16."""
    return max(1, min(16, config.batch_size))


def sharding_figures(s) -> dict:
    """Under --shard fsdp: the base weights each process holds, measured on its tensors (collective)."""
    here, whole = base_bytes(s.model)
    per_rank: list = [None] * s.config.world_size
    torch.distributed.all_gather_object(per_rank, here)
    log(f"sharded      base weights per process {', '.join(gib(b) for b in per_rank)} of {gib(whole)} "
        f"({len(per_rank)} process(es))", s.config.rank)
    return {"strategy": "fsdp", "world_size": s.config.world_size, "base_bytes_per_process": per_rank,
            "base_bytes_whole": whole, "wrapped": s.plan.sharding.wrapped}


def _save_adapter_atomically(session, model, target: Path) -> None:
    tmp = target.parent / f".{target.name}-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    session.save_adapter(model, tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def metric_sinks(registry: Registry, config: RunConfig) -> list:
    """``--report-to``: one sink factory per name, asked once at set-up (``vlft_metric_sink``)."""
    factories = []
    for name in [n.strip() for n in (config.report_to or "").split(",") if n.strip()]:
        factory = registry.pm.hook.vlft_metric_sink(name=name, config=config)
        if factory is None:
            raise ConfigError(f"--report-to {name}: no plugin offers this metric sink (built in: tensorboard)")
        factories.append(factory)
    return factories


def _validation_summary(before: dict, after: dict | None) -> dict:
    """The objective's validation figures before and after training (a preference objective's accuracy)."""
    if "validation" not in before:
        return {}
    return {"validation_before": before["validation"],
            "validation_after": after.get("validation") if after is not None else None}


def _write_eval(output: Path, before: dict | None, after: dict | None) -> None:
    tmp = output / ".eval.json.tmp"
    tmp.write_text(json.dumps({"before": before, "after": after}, indent=2))
    os.replace(tmp, output / "eval.json")
