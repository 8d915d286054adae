"""Step times that mean what they say: evaluation and checkpoint saving are timed apart from training steps.

A tiny run evaluates and saves at every step. The run's clock (``time.perf_counter`` in the two modules that
time it, the trainer and its loop's window) is replaced by one that moves only when this test says: each training
step, validation loss and checkpoint save moves it by its own known amount, and nothing else does. Every time
the run reports is then an exact sum of those amounts, whatever the machine's speed and load: each is checked
from both sides (a field that held another's time is too large, one that lost its own too small), with no
wall-clock bound.
"""

from __future__ import annotations

import json
import types

from click.testing import CliRunner

# what each kind of work costs on the run's clock; powers of two, so every sum and mean is exact in floats
STEP, EVAL, SAVE = 0.25, 0.5, 2.0


class RunClock:
    """``perf_counter`` for the modules that time the run; moved only by ``spend``."""

    def __init__(self):
        self.now = 1024.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def test_step_time_leaves_out_evaluation_and_checkpoints_which_have_their_own_fields(tmp_path, monkeypatch):
    import vlft.training.loop as loop
    import vlft.training.trainer as trainer
    from vlft.cli import cli
    from vlft.testing import run, tiny_run_config
    from vlft.training.checkpoints import CheckpointStore

    clock = RunClock()
    for module in (loop, trainer):  # only perf_counter: any other use of `time` there fails loudly
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    real_step, real_loss, real_save = trainer.train_step_on, trainer.validation_loss, CheckpointStore.save

    def costed(real, seconds):
        def call(*args, **kwargs):
            clock.spend(seconds)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(trainer, "train_step_on", costed(real_step, STEP))
    monkeypatch.setattr(trainer, "validation_loss", costed(real_loss, EVAL))
    monkeypatch.setattr(CheckpointStore, "save", costed(real_save, SAVE))
    # log every 2 steps, evaluate and save every step: each logged window holds evaluations and saves
    config = tiny_run_config(
        tmp_path, steps=4, log_every=2, eval_every=1, eval_batches=1, save_every=1, keep_checkpoints=1
    )
    result = run(config)
    lines = [json.loads(line) for line in (result.output / "metrics.jsonl").read_text().splitlines()]

    evals = [m for m in lines if "val_loss" in m]
    saves = [m for m in lines if "checkpoint_time_s" in m]
    logged = [m for m in lines if "loss" in m]
    assert [(m["step"], m["eval_time_s"]) for m in evals] == [(1, EVAL), (2, EVAL), (3, EVAL), (4, EVAL)]
    # the last step's adapter is the final checkpoint, saved after the loop: no line of its own
    assert [(m["step"], m["checkpoint_time_s"]) for m in saves] == [(1, SAVE), (2, SAVE), (3, SAVE)]
    # each window of 2 steps held 2 evaluations and 2 saves (1 and 1 in the last): the step time is the steps'
    assert [(m["step"], m["step_time_s"]) for m in logged] == [(2, STEP), (4, STEP)]
    assert [m["samples_per_s"] for m in logged] == [config.batch_size / STEP] * 2

    # the training time holds every step, evaluation and save once, and the final checkpoint
    train_time = json.loads((result.output / "summary.json").read_text())["train_time_s"]
    accounted = (
        sum(m["step_time_s"] * 2 for m in logged)
        + sum(m["eval_time_s"] for m in evals)
        + sum(m["checkpoint_time_s"] for m in saves)
    )
    assert accounted + SAVE == train_time == 4 * STEP + 4 * EVAL + 4 * SAVE

    code_out = CliRunner().invoke(cli, ["report", str(result.output), "--output", str(tmp_path / "report")])
    assert code_out.exit_code == 0, code_out.output
    md = (tmp_path / "report" / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| run |"))
    row = next(line for line in md.splitlines() if line.startswith("| ") and "| cpu |" in line)
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert cells["eval time"] == f"{4 * EVAL:.2f} s (4x)"
    assert cells["checkpoint time"] == f"{3 * SAVE:.2f} s (3x)"
    assert cells["median step time"] == f"{STEP:.3f} s"  # the second window's (the first is warm-up)
    assert cells["samples/s"] == f"{config.batch_size / STEP:.2f}"
