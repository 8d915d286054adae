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
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from vlft.config import RunConfig
from vlft.contracts.backend import MemoryStats
from vlft.errors import ConfigError
from vlft.evaluation.generation import Decoding, evaluate_generation
from vlft.evaluation.inference import write_atomically
from vlft.evaluation.scoring import format_table
from vlft.models.patching import KernelPatchLost
from vlft.planning.memory import gib
from vlft.planning.plan import RunPlan, choose_backend, format_plan, require_available
from vlft.planning.preflight import plan_run
from vlft.planning.sharding import base_bytes
from vlft.registry import Registry
from vlft.training.checkpoints import RUN_IDENTITY, CheckpointWriteError, newest_checkpoint
from vlft.training.resume import check_same_run, resume_command, run_identity
from vlft.training.signals import Interrupted, NonFiniteStop
from vlft.training.trainer import RunOutput, Trainer, build_trainer


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
        plan = plan_run(registry, config)
        return RunResult(None, plan, description=plan.describe())
    choice = choose_backend(registry, config.backend)
    require_available(choice)
    output = run_folder(config, choice)
    sink_factories = metric_sinks(registry, config)
    identity = run_identity(config, registry.objective_for(config).describe()["options"])
    resume_from = _checkpoint_to_resume(config, output, identity)
    if resume_from is not None and (complete := _completed(output, resume_from, config)) is not None:
        log(
            f"--resume: the run in {output} is complete ({complete['steps']} steps, checkpoint "
            f"{resume_from.name}); nothing to train. Its adapter: {complete.get('adapter')}",
            config.rank,
        )
        return RunResult(output, None, metrics=[])
    trainer = build_trainer(
        registry,
        config,
        resume_from=resume_from,
        choice=choice,
        output=RunOutput(output, identity, tuple(sink_factories)),
        progress=progress,
    )
    description = trainer.describe(
        [
            f"evaluation generates in batches of {eval_batch_size(config)} (the training micro-batch, at most 16), "
            f"after training, once the adapter is saved and the optimizer state freed"
        ]
    )
    sharding = sharding_figures(trainer) if trainer.sharded else None
    write_plan(trainer, description)
    before = evaluate_before(trainer)
    records = train(trainer)  # ends with a checkpoint of the last step
    trainer.save_adapter(trainer.folder / "adapter")  # before the evaluation: whatever it does, the adapter is kept
    trainer.free_optimizer_state()
    after, eval_error = evaluate_after(trainer)
    write_summary(trainer, before, after, records, eval_error, sharding)
    trainer.close()
    return RunResult(trainer.folder, trainer.plan, before, after, records, description)


def _completed(output: Path, resume_from: Path, config: RunConfig) -> dict | None:
    """``--resume`` on a run that finished: its summary says completed and its newest checkpoint is of the
    last step, and ``--steps`` asks for no more (a finished run extended with ``--force-resume --steps N``
    trains on). The summary then, else None."""
    path = output / "summary.json"
    if not path.exists():
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
    check_same_run(
        json.loads(saved.read_text()) if saved.exists() else None,
        identity,
        resume_from,
        config.force_resume,
        lambda m: log(m, config.rank),
    )
    return resume_from


def write_plan(trainer: Trainer, description: dict) -> None:
    """plan.json and config.json, and the plan on stderr (rank 0)."""
    config, output = trainer.config, trainer.folder
    if config.rank != 0:
        return
    output.mkdir(parents=True, exist_ok=True)
    (output / "plan.json").write_text(json.dumps(description, indent=2, default=str))
    (output / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    log(format_plan(description))
    log(
        f"data         {len(trainer.plan.train_records)} training and {len(trainer.plan.val_records)} validation "
        f"records"
    )
    log(f"output       {output}")


def generation_eval(trainer: Trainer) -> dict:
    """The greedy answers' scores on the first ``--eval-samples`` validation records."""
    config, plan = trainer.config, trainer.plan
    records = plan.val_records[: config.eval_samples] if config.eval_samples else plan.val_records
    decoding = Decoding(config.max_new_tokens, eval_batch_size(config), trainer.autocast_dtype, synced=trainer.sharded)
    return evaluate_generation(
        trainer.model,
        plan.encoder,
        records,
        trainer.device,
        decoding=decoding,
        share=(config.rank, config.world_size),
        scorers=plan.scorers.chosen if plan.scorers else [],
    )


def validation_figures(trainer: Trainer) -> dict | None:
    """The objective's validation figures now (for before and after training), where it has figures."""
    if trainer.plan.objective.supervised or not trainer.val_batches:
        return None
    return trainer.evaluate()


def evaluate_before(trainer: Trainer) -> dict:
    """The scores of the model training starts from: the base model, or the adapter --init-adapter loaded
    (with the objective's validation figures, where it has them); a resumed run keeps those it wrote before."""
    plan, rank, output = trainer.plan, trainer.config.rank, trainer.folder
    if trainer.checkpoint is not None:
        start = trainer.start_step
        log(f"resumed      from step {start} ({trainer.checkpoint})", rank)
        iterations = plan.objective.iterations
        if start % iterations:  # the kept rollout is not checkpointed (training.rollouts says why)
            first, last = start + 1, start - start % iterations + iterations
            log(
                f"resumed inside a rollout (--num-iterations {iterations}): the prompts of "
                f"{f'step {first}' if first == last else f'steps {first}-{last}'} are sampled again by the "
                f"resumed weights (a checkpoint at a multiple of {iterations} steps resumes exactly)",
                rank,
            )
        eval_path = output / "eval.json"
        before = json.loads(eval_path.read_text()).get("before") if eval_path.exists() else None
        if before is not None:
            return before
    if plan.init_adapter:
        log(f"evaluating the adapter it starts from ({plan.init_adapter}) ...", rank)
        before = generation_eval(trainer)
    else:
        log("evaluating the base model ...", rank)
        with trainer.model.disable_adapter():
            before = generation_eval(trainer)
    validation = validation_figures(trainer)
    if validation is not None:
        before["validation"] = validation
    if rank == 0:
        _write_eval(output, before, None)
    return before


def train(trainer: Trainer) -> list[dict]:
    """The trainer's loop; a stop writes its summary (and an interruption says how to continue)."""
    config, output, rank = trainer.config, trainer.folder, trainer.config.rank
    log(
        f"training     {trainer.settings.total_steps} steps of "
        f"{config.batch_size * config.grad_accum * config.world_size} samples",
        rank,
    )
    try:
        return trainer.train()
    except Interrupted as e:
        command = resume_command(sys.argv, output, config.world_size)
        stopped_summary(
            trainer,
            "interrupted",
            e.step,
            signal=e.signum,
            checkpoint=str(e.checkpoint) if e.checkpoint else None,
            resume_command=command,
        )
        log(f"interrupted after step {e.step}; checkpoint {e.checkpoint}. Continue with:\n  {command}", rank)
        if trainer.distributed:
            torch.distributed.destroy_process_group()
        raise SystemExit(e.exit_code) from None
    except KernelPatchLost as e:
        stopped_summary(trainer, "stopped: kernel patch lost", None, error=str(e))
        raise
    except NonFiniteStop:
        newest = _newest_checkpoint(trainer)
        stopped_summary(trainer, "stopped: non-finite steps", None, checkpoint=str(newest) if newest else None)
        raise
    except CheckpointWriteError as e:
        newest = _newest_checkpoint(trainer)
        stopped_summary(
            trainer,
            "stopped: checkpoint write failed",
            None,
            error=str(e),
            checkpoint=str(newest) if newest else None,
            resume_command=resume_command(sys.argv, output, config.world_size) if newest else None,
        )
        raise


def _newest_checkpoint(trainer: Trainer) -> Path | None:
    store = trainer.checkpoints
    return store.newest() if store is not None else None


def stopped_summary(trainer: Trainer, status: str, step: int | None, **extra) -> None:
    if trainer.config.rank != 0:
        return
    done = trainer.outcome()
    summary = {
        "status": status,
        "step": step,
        "steps": done.steps,
        "resumed_from": done.resumed_from,
        "train_time_s": done.train_time_s,
        "skipped_steps": done.skipped_steps,
        "skipped": done.skipped,
        "scaler_backoffs": done.scaler_backoffs,
        **extra,
    }
    path = trainer.folder / "summary.json"
    try:
        write_atomically(path, json.dumps(summary, indent=2))
    except OSError as e:  # the disk that stopped the run may not take this either: the error still prints
        log(f"could not write {path} ({e})", trainer.config.rank)


def evaluate_after(trainer: Trainer) -> tuple[dict | None, str | None]:
    """The adapted model's scores, or (None, the error) when the evaluation fails: the adapter and the final
    checkpoint are already written, so the run is complete without it."""
    rank = trainer.config.rank
    log("evaluating the adapted model ...", rank)
    try:
        after = generation_eval(trainer)
        validation = validation_figures(trainer)
        if validation is not None:
            after["validation"] = validation
        return after, None
    except Exception as e:
        if trainer.distributed:
            raise  # the other processes wait in the evaluation's collectives: stop them all
        error = f"{e.__class__.__name__}: {e}"
        log(
            f"the evaluation after training failed ({error}); the adapter is saved in "
            f"{trainer.folder / 'adapter'}. Score it again with: vlft predict",
            rank,
        )
        return None, error


def write_summary(
    trainer: Trainer,
    before: dict,
    after: dict | None,
    records: list[dict],
    eval_error: str | None = None,
    sharding: dict | None = None,
) -> None:
    config, plan, output = trainer.config, trainer.plan, trainer.folder
    if config.rank != 0:
        return
    done = trainer.outcome()
    _write_eval(output, before, after)
    mem: MemoryStats = trainer.memory_reader()
    summary = {
        "backend": plan.backend.info.name,
        "method": plan.method.name,
        "objective": plan.objective.name,
        "init_adapter": plan.init_adapter,
        "steps": done.steps,
        "resumed_from": done.resumed_from,
        "train_time_s": done.train_time_s,
        "final_loss": records[-1]["loss"] if records else None,
        "peak_memory_bytes": mem.peak_bytes,
        "exact_match_before": before.get("exact_match"),
        "exact_match_after": after.get("exact_match") if after is not None else None,
        "eval_error": eval_error,
        "adapter": str(output / "adapter"),
        "param_dtype": plan.precision.param_dtype,
        "checkpointing": plan.checkpointing,
        "memory_estimate_bytes": plan.memory.total_bytes() if plan.memory else None,
        **_validation_summary(before, after),
        "skipped_too_long": plan.lengths.get("skipped_samples", []),
        "status": "completed",
        "skipped_steps": done.skipped_steps,
        "skipped": done.skipped,
        "scaler_backoffs": done.scaler_backoffs,
        "sharding": sharding,
    }
    if config.early_stopping_patience:
        summary["early_stopping"] = {
            "stopped_early": any(r.get("early_stop") for r in records),
            "best_step": done.best_step,
            "best_val_loss": done.best_val_loss,
            "best_adapter": str(output / "adapter-best") if done.best_step is not None else None,
        }
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    if after is not None:
        print(format_table(before, after))
    for name, value in (before.get("validation") or {}).items():
        later = ((after or {}).get("validation") or {}).get(name)
        print(f"{name:<28} {value:10.4f} -> " + (f"{later:.4f}" if later is not None else "-"))
    print(
        f"adapter saved to {output / 'adapter'} ({done.steps - done.resumed_from} steps in {done.train_time_s:.0f} s)"
    )
    print(f"compare it with other runs: vlft report {output} [OTHER_RUN ...] --output {output}-report")


def eval_batch_size(config: RunConfig) -> int:
    """The generation evaluation's batch: the training micro-batch (a forward without gradients and its KV
    cache hold less than a training step of as many samples), at most 16."""
    return max(1, min(16, config.batch_size))


def sharding_figures(trainer: Trainer) -> dict:
    """Under --shard fsdp: the base weights each process holds, measured on its tensors (collective)."""
    config = trainer.config
    here, whole = base_bytes(trainer.model)
    per_rank: list = [None] * config.world_size
    torch.distributed.all_gather_object(per_rank, here)
    log(
        f"sharded      base weights per process {', '.join(gib(b) for b in per_rank)} of {gib(whole)} "
        f"({len(per_rank)} process(es))",
        config.rank,
    )
    return {
        "strategy": "fsdp",
        "world_size": config.world_size,
        "base_bytes_per_process": per_rank,
        "base_bytes_whole": whole,
        "wrapped": trainer.plan.sharding.wrapped,
    }


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
    return {
        "validation_before": before["validation"],
        "validation_after": after.get("validation") if after is not None else None,
    }


def _write_eval(output: Path, before: dict | None, after: dict | None) -> None:
    tmp = output / ".eval.json.tmp"
    tmp.write_text(json.dumps({"before": before, "after": after}, indent=2))
    os.replace(tmp, output / "eval.json")
