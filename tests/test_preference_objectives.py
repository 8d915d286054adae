"""ORPO, KTO and SimPO (``--objective orpo|kto|simpo``) end to end through the CLI on the embedded model: each
trains on the demo task and raises its own validation figure, resumes with the uninterrupted losses, starts
from another run's adapter (``--init-adapter``) and trains under two data-parallel processes; their options
take effect; ORPO is the guide's third-party plugin, registered from the guide's own text.

The runs are chained and shared (module scope), a few steps each on 4 records, which are also the
validation records (what a 4-step run can show is that it learnt the preferences it was shown; the documented
runs in docs/preference-training.md measure held-out pairs): ORPO from a fresh adapter (the guide's plugin,
one pair a step so each step's loss can be recomputed from its logged figures), KTO from ORPO's adapter (its
reference: step 1's loss is exactly the weights' mean of 0.5), SimPO from KTO's. A resumed run is the
finished run's folder cut back to its step-2 checkpoint (as tests/parity does), continued with ``--resume``:
it must log the same steps 3 and 4.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from helpers import cli_invoke, process_registry, vlft_command

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-plugins.md"
ORPO_MODULE = ROOT / "plugins" / "objectives" / "orpo.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo task as 4 preference pairs and, from them, 4 unpaired records (2 desirable), each set its own
    validation set."""
    from vlft.data.demo import write_demo_unpaired

    unpaired = write_demo_unpaired(tmp_path_factory.mktemp("prefs") / "demo", n_train=4, n_val=4, seed=5)
    pairs = unpaired.root / "preferences-train.jsonl"
    return types.SimpleNamespace(pairs=(pairs, pairs), unpaired=(unpaired.train, unpaired.train))


def args_for(objective: str, data: tuple, out, *extra, steps: int = 4, batch: int = 2) -> list:
    """A short run: ``steps`` steps of ``batch`` records, checkpoints and validation every 2 steps (on the 4
    validation records); LoRA dropout 0, so runs over other numbers of processes draw the same computation."""
    return [
        "run",
        "--objective",
        objective,
        "--backend",
        "cpu",
        "--data",
        data[0],
        "--val-data",
        data[1],
        "--output",
        out,
        "--steps",
        str(steps),
        "--batch-size",
        str(batch),
        "--log-every",
        "1",
        "--eval-every",
        "2",
        "--eval-batches",
        str(4 // batch),
        "--eval-samples",
        "2",
        "--max-new-tokens",
        "4",
        "--save-every",
        "2",
        "--seed",
        "1",
        "--lr",
        "3e-3",
        "--adapter-opt",
        "lora_dropout=0",
        "--quiet",
        *extra,
    ]


def logged(out: Path) -> list[dict]:
    return [m for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def resumed_from_step_2(run: Path, args: list, tmp_path: Path) -> Path:
    """``run`` cut back to its step-2 checkpoint and continued with ``--resume`` (``args`` made it)."""
    out = tmp_path / f"{run.name}-resumed"
    shutil.copytree(run, out)
    for name in ("adapter", "summary.json", "eval.json", "checkpoints/step-000004"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    argv = [str(a) for a in args]
    argv[argv.index("--output") + 1] = str(out)
    code, output = cli_invoke(*argv, "--resume")
    assert code == 0, output
    assert "resumed      from step 2" in output
    return out


def two_processes(objective: str, data: tuple, out: Path, start, *extra, batch: int = 1) -> list[dict]:
    """2 steps under torchrun, two processes of ``batch`` records each, from the adapter of the run ``start``
    (``--init-adapter``): its "before" answers are ``start``'s "after" ones. The logged steps."""
    argv = [str(a) for a in args_for(objective, data, out, "--init-adapter", start, *extra, steps=2, batch=batch)]
    for flag, value in (("--eval-every", "0"), ("--save-every", "0"), ("--eval-samples", "1")):
        argv[argv.index(flag) + 1] = value
    proc = subprocess.run(
        [*vlft_command(), *argv, "--nproc-per-node", "2"], capture_output=True, text=True, timeout=900, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    before = json.loads((out / "eval.json").read_text())["before"]["examples"]
    after = json.loads((Path(start) / "eval.json").read_text())["after"]["examples"]
    assert [e["prediction"] for e in before] == [e["prediction"] for e in after[: len(before)]]
    lines = logged(out)
    assert [m["step"] for m in lines] == [1, 2] and all(math.isfinite(m["loss"]) for m in lines)
    return lines


def guide_plugin():
    """The guide's objective example, made a module from the guide's text (section "An objective plugin")."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index("## 10. An objective plugin") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("guide_orpo")
    sys.modules[module.__name__] = module  # dataclasses resolve the options' types through it
    exec(compile(code, str(GUIDE), "exec"), module.__dict__)
    return code, module


@pytest.fixture(scope="module")
def orpo_run(demo, tmp_path_factory):
    """ORPO as a third party installs it: the guide's plugin beside the built-ins, the built-in orpo blocked;
    one pair a step, ``--orpo-lambda 0.2``."""
    from vlft.testing import registry_with

    _, module = guide_plugin()
    out = tmp_path_factory.mktemp("orpo") / "run"
    args = args_for("orpo", demo.pairs, out, "--orpo-lambda", "0.2", batch=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLFT_DISABLE_PLUGINS", "orpo")
        registry = registry_with(module)
    assert registry.owners[("objective", "orpo")] == "guide_orpo"
    with process_registry(registry):
        code, output = cli_invoke(*args)
        listing = cli_invoke("objectives")
        helped = cli_invoke("run", "--help")
    assert code == 0, output
    return out, args, listing, helped


@pytest.fixture(scope="module")
def kto_run(demo, orpo_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("kto") / "run"
    args = args_for(
        "kto",
        demo.unpaired,
        out,
        "--init-adapter",
        orpo_run[0],
        "--desirable-weight",
        "1.5",
        "--undesirable-weight",
        "0.5",
    )
    code, output = cli_invoke(*args)
    assert code == 0, output
    return out, args


@pytest.fixture(scope="module")
def simpo_run(demo, kto_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("simpo") / "run"
    args = args_for(
        "simpo", demo.pairs, out, "--init-adapter", kto_run[0], "--beta", "2.5", "--simpo-gamma", "0.5", batch=1
    )
    code, output = cli_invoke(*args)
    assert code == 0, output
    return out, args


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def validation(out: Path) -> tuple[dict, dict]:
    summary = json.loads((out / "summary.json").read_text())
    return summary["validation_before"], summary["validation_after"]


def test_the_guides_orpo_plugin_adds_its_option_and_trains(orpo_run):
    """The guide's code is the built-in plugin's, imports only ``vlft``, and registered as a third party it
    adds ``--orpo-lambda`` to `vlft run` and `vlft objectives`; its run's loss is ORPO's at every step
    (``nll - 0.2 log sigmoid(log odds ratio)``, one pair a step) and raises the validation log odds."""
    code, _ = guide_plugin()
    assert code == ORPO_MODULE.read_text(encoding="utf-8")
    imports = re.findall(r"^\s*(?:from|import) ([\w.]+)", code, re.M)
    assert set(imports) <= {"__future__", "dataclasses", "vlft", "torch", "torch.nn.functional"}, imports
    out, _, (code, listing), (_, helped) = orpo_run
    assert code == 0 and "orpo: odds ratio preference optimisation" in listing
    assert "--orpo-lambda 0.1  # weight of the odds-ratio term" in listing
    assert "--orpo-lambda FLOAT" in helped and "orpo: weight of the odds-ratio term" in helped
    plan = json.loads((out / "plan.json").read_text())["objective"]
    assert plan["options"] == {"orpo_lambda": 0.2} and plan["reference"] == "" and plan["rows_per_record"] == 2
    lines = logged(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        want = m["nll_chosen"] - 0.2 * logsigmoid(m["log_odds_ratio"])
        assert m["loss"] == pytest.approx(want, rel=1e-5), m
    before, after = validation(out)
    assert after["val_log_odds_ratio"] > before["val_log_odds_ratio"], (before, after)
    assert after["val_loss"] < before["val_loss"]


def test_orpo_resumes_and_trains_under_two_processes_from_another_adapter(orpo_run, simpo_run, demo, tmp_path):
    """Cut back to step 2 and resumed: steps 3 and 4 as uninterrupted. Two processes of one pair each, from
    SimPO's adapter (``--init-adapter``; the built-in plugin, loaded by torchrun's workers), train."""
    out, args, _, _ = orpo_run
    from vlft.testing import registry_with

    _, module = guide_plugin()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLFT_DISABLE_PLUGINS", "orpo")
        registry = registry_with(module)
    with process_registry(registry):
        again = resumed_from_step_2(out, args, tmp_path)
    for a, b in zip(logged(out), logged(again), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
    lines = two_processes("orpo", demo.pairs, tmp_path / "ddp", simpo_run[0], "--orpo-lambda", "0.2")
    for m in lines:  # the same pair of figures per pair: ORPO's loss is not averaged away from its formula
        assert m["loss"] >= m["nll_chosen"] - 0.2 * logsigmoid(m["log_odds_ratio"]) - 1e-5


def test_kto_trains_from_an_adapter_as_its_reference_and_resumes(kto_run, tmp_path):
    """KTO from ORPO's adapter, which is its reference: at step 1 every reward is 0, so each record's loss is
    its weight x 0.5 (desirable 1.5, undesirable 0.5); training separates the rewards of desirable and
    undesirable validation replies (0 and 0 before); resumed at step 2, the reference is still ORPO's adapter
    (kept in the checkpoint) and steps 3 and 4 are the uninterrupted ones."""
    out, args = kto_run
    lines = logged(out)
    first = lines[0]
    assert first["kl"] == 0 and first["reward_desirable"] == 0 and first["reward_undesirable"] == 0
    d, u = first["desirable"], first["undesirable"]
    assert d + u == 2 and first["loss"] == pytest.approx(0.5 * (1.5 * d + 0.5 * u) / 2, abs=1e-7)
    plan = json.loads((out / "plan.json").read_text())["objective"]
    assert plan["options"] == {"beta": 0.1, "desirable_weight": 1.5, "undesirable_weight": 0.5}
    assert plan["reference"].startswith("the adapter as --init-adapter loaded it")
    before, after = validation(out)
    assert before["val_reward_desirable"] == 0 and before["val_reward_undesirable"] == 0
    assert after["val_reward_desirable"] > after["val_reward_undesirable"], after
    again = resumed_from_step_2(out, args, tmp_path)
    for a, b in zip(lines, logged(again), strict=True):
        for key in ("loss", "kl", "reward_desirable", "reward_undesirable"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)


def _kl_point_worker(rank: int, init: str, queue) -> None:
    import torch

    from vlft.plugins import serve_checkout

    serve_checkout()
    from vlft_objectives import kto

    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        queue.put((rank, float(kto._mean_over_processes(torch.tensor([-1.0, 3.0][rank])))))
    finally:
        torch.distributed.destroy_process_group()


def test_ktos_kl_point_is_the_mean_over_processes(tmp_path):
    """KTO's KL point under data parallelism is the processes' mean estimate, the same on each (TRL's and the
    paper's code): two processes estimating -1 and 3 both take 1 (each alone would take 0 and 3)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_kl_point_worker, args=(r, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: 1.0, 1: 1.0}


def test_kto_and_simpo_train_under_two_processes(kto_run, demo, tmp_path):
    """KTO, two processes of 2 records each (the KL point: the mean of both processes' estimates), from its own
    trained adapter as the reference: step 1 is the weights' mean of 0.5 over both processes' records.
    SimPO, two processes of one pair each, from KTO's adapter: its loss is the mean of the pairs' losses,
    at least the loss of the mean margin (-log sigmoid is convex)."""
    lines = two_processes(
        "kto",
        demo.unpaired,
        tmp_path / "kto",
        kto_run[0],
        "--desirable-weight",
        "1.5",
        "--undesirable-weight",
        "0.5",
        batch=2,
    )
    d, u = lines[0]["desirable"], lines[0]["undesirable"]  # per process: the two processes' counts halved
    assert d + u == 2 and lines[0]["loss"] == pytest.approx(0.5 * (1.5 * d + 0.5 * u) / 2, abs=1e-7)
    assert lines[1]["loss"] != lines[0]["loss"]
    lines = two_processes("simpo", demo.pairs, tmp_path / "simpo", kto_run[0], "--beta", "2.5", "--simpo-gamma", "0.5")
    for m in lines:
        assert m["loss"] >= -logsigmoid(m["reward_margin"] - 0.5) - 1e-5


def test_simpo_and_kto_options_take_effect(simpo_run, kto_run, tmp_path):
    """SimPO, one pair a step: the loss is ``-log sigmoid(margin - gamma)`` of the logged reward margin
    (``beta`` 2.5 x the per-token mean log-probabilities), its validation margin rises; resumed, the same
    steps. KTO's weights: see its step 1 above (``kto_run``). Bad values stop before anything is written."""
    out, args = simpo_run
    lines = logged(out)
    for m in lines:
        assert m["loss"] == pytest.approx(-logsigmoid(m["reward_margin"] - 0.5), rel=1e-5), m
    assert json.loads((out / "plan.json").read_text())["objective"]["options"] == {"beta": 2.5, "simpo_gamma": 0.5}
    before, after = validation(out)
    assert after["val_reward_margin"] > before["val_reward_margin"], (before, after)
    again = resumed_from_step_2(out, args, tmp_path)
    for a, b in zip(lines, logged(again), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
    code, output = cli_invoke(
        "run", "--objective", "kto", "--batch-size", "1", "--output", tmp_path / "no", "--dry-run"
    )
    assert code != 0 and "--objective kto needs --batch-size 2 or more" in output
    code, output = cli_invoke(
        "run", "--objective", "kto", "--desirable-weight", "-1", "--output", tmp_path / "no", "--dry-run"
    )
    assert code != 0 and "--desirable-weight (kto) must not be negative" in output
    code, output = cli_invoke("run", "--objective", "simpo", "--simpo-gamma", "x", "--dry-run")
    assert code != 0 and "'x' is not a valid float" in output
    assert not (tmp_path / "no").exists()


def test_bad_unpaired_records_stop_before_step_1_with_file_and_line(demo, tmp_path):
    """KTO's layouts, LLaMA-Factory's (messages + kto_tag or label) and TRL's (prompt + completion + label),
    read alike; a record without a tag, with a tag that is not a boolean, or whose last turn is not the
    assistant's is named by its line."""
    from vlft.data.preferences import parse_unpaired
    from vlft.data.records import read_records_collecting

    root = Path(demo.unpaired[0]).parent
    good_lf = {
        "messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}],
        "kto_tag": True,
        "images": ["imgs/train_00000.png"],
    }
    good_trl = {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
        "completion": [{"role": "assistant", "content": "red"}],
        "label": False,
        "images": ["imgs/train_00000.png"],
    }
    bad = [
        good_lf,
        good_trl,
        {**good_lf, "kto_tag": "yes"},
        {k: v for k, v in good_trl.items() if k != "label"},
        {**good_lf, "messages": good_lf["messages"][:1]},
    ]
    data = root / "bad-unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in bad))
    records, problems = read_records_collecting(data, parse=parse_unpaired)
    assert [r.where for r in records] == ["bad-unpaired.jsonl:1", "bad-unpaired.jsonl:2"]
    assert [(r.desirable, [(t.role, t.text) for t in r.turns]) for r in records] == [
        (True, [("user", "<image>Colour?"), ("assistant", "red")]),
        (False, [("user", "<image>Colour?"), ("assistant", "red")]),
    ]
    assert problems.count == 3
    code, output = cli_invoke("data", "check", "--objective", "kto", data)
    assert code != 0 and "3 problem(s) found" in output, output
    for line, said in (
        (3, "'kto_tag' must be true (a desirable reply) or false (an undesirable one), got 'yes'"),
        (4, "an unpaired preference record needs 'label' (or LLaMA-Factory's 'kto_tag')"),
        (5, "the last turn must be the assistant's reply"),
    ):
        assert f"bad-unpaired.jsonl:{line}: {said}" in output, (line, output)
