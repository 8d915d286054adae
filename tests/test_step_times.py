"""Step times that mean what they say: evaluation and checkpoint saving are timed apart from training steps.

A tiny run evaluates and saves at every step, each made slower by a known pause; steps, evaluations and
saves must add up to the training time, each counted once, whatever the machine's speed.
"""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

PAUSE = 0.6  # seconds added to every validation loss and every checkpoint save


def test_step_time_leaves_out_evaluation_and_checkpoints_which_have_their_own_fields(tmp_path, monkeypatch):
    import vlft.commands.run as run_command
    from vlft.cli import cli
    from vlft.testing import run, tiny_run_config
    from vlft.training.checkpoints import CheckpointStore

    real_loss, real_save = run_command.validation_loss, CheckpointStore.save

    def slow_loss(*args, **kwargs):
        time.sleep(PAUSE)
        return real_loss(*args, **kwargs)

    def slow_save(self, *args, **kwargs):
        time.sleep(PAUSE)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(run_command, "validation_loss", slow_loss)
    monkeypatch.setattr(CheckpointStore, "save", slow_save)
    # log every 2 steps, evaluate and save every step: each logged window holds evaluations and saves
    config = tiny_run_config(tmp_path, steps=4, log_every=2, eval_every=1, eval_batches=1, save_every=1,
                             keep_checkpoints=1)
    result = run(config)
    lines = [json.loads(line) for line in (result.output / "metrics.jsonl").read_text().splitlines()]

    evals = [m for m in lines if "val_loss" in m]
    saves = [m for m in lines if "checkpoint_time_s" in m]
    logged = [m for m in lines if "loss" in m]
    assert [m["step"] for m in evals] == [1, 2, 3, 4]
    assert all(m["eval_time_s"] >= PAUSE for m in evals), evals
    assert [m["step"] for m in saves] == [1, 2, 3]  # the last step's adapter is not a checkpoint
    assert all(m["checkpoint_time_s"] >= PAUSE for m in saves), saves
    assert [m["step"] for m in logged] == [2, 4]

    # steps, evaluations and saves add up to the training time, each counted once
    train_time = json.loads((result.output / "summary.json").read_text())["train_time_s"]
    accounted = (sum(m["step_time_s"] * 2 for m in logged) + sum(m["eval_time_s"] for m in evals)
                 + sum(m["checkpoint_time_s"] for m in saves))
    # (a step time that held them would count each pause twice: at least 2.4 s too many here)
    assert accounted <= train_time + 0.05, (accounted, train_time)

    code_out = CliRunner().invoke(cli, ["report", str(result.output), "--output", str(tmp_path / "report")])
    assert code_out.exit_code == 0, code_out.output
    md = (tmp_path / "report" / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| run |"))
    row = next(line for line in md.splitlines() if line.startswith("| ") and "| cpu |" in line)
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert cells["eval time"].endswith("s (4x)") and float(cells["eval time"].split()[0]) >= 4 * PAUSE
    assert cells["checkpoint time"].endswith("s (3x)") and float(cells["checkpoint time"].split()[0]) >= 3 * PAUSE
    assert cells["median step time"] == f"{logged[1]['step_time_s']:.3f} s"  # the first window is warm-up
