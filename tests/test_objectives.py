"""Objectives (``--objective``): DPO end to end through the CLI on the embedded model, SFT then DPO with
``--init-adapter``, DPO's options, bad preference data, two processes, what is refused, one vision pass per
pair, and a third party's objective plugin.

One short DPO run is made per session and shared (the resumed run and the two-process run are compared with
it). The DPO loss is ln 2 at step 1 whenever the policy starts equal to its reference (a fresh LoRA, whose B
is 0, against the adapter switched off; an --init-adapter run against its own initial adapter): the margin is
exactly 0 there, since adding the LoRA's zero update leaves every activation as it is.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import brief_config, brief_flags, cli_invoke, die_at_step, vlft_command
from vlft import Average, ConfigError, Objective, ObjectiveInfo, hookimpl

LN2 = math.log(2)
DPO_FIGURES = (
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "preference_accuracy",
    "logps_chosen",
    "logps_rejected",
)


@pytest.fixture(scope="module")
def pref(tmp_path_factory):
    """The demo task as 16 + 4 preference pairs, beside its conversations (the same prompts and images)."""
    from vlft.data.demo import write_demo_preferences

    return write_demo_preferences(tmp_path_factory.mktemp("pref") / "demo", n_train=16, n_val=4, seed=5)


def dpo_args(pref, out, *extra) -> list:
    """A short DPO run: 4 steps of 2 pairs, checkpoints at 2 and 4, validation at 2 and 4; LoRA dropout 0, so
    runs over other numbers of processes draw the same computation."""
    return [
        "run",
        *brief_flags(
            objective="dpo",
            data=pref.train,
            val_data=pref.val,
            output=out,
            steps=4,
            batch_size=2,
            eval_every=2,
            eval_batches=1,
            eval_samples=2,
            max_new_tokens=4,
            save_every=2,
            seed=1,
            lr=3e-3,
            adapter={"lora_dropout": 0},
        ),
        *extra,
    ]


@pytest.fixture(scope="module")
def dpo_run(pref, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "run"
    code, output = cli_invoke(*dpo_args(pref, out))
    assert code == 0, output
    return out, output


def logged(out: Path) -> list[dict]:
    return [m for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def test_a_dpo_run_trains_saves_resumes_and_evaluates(dpo_run, pref, tmp_path, monkeypatch):
    """``vlft run --objective dpo``: the loss starts at ln 2 and falls, every figure is logged at every step
    and in validation, the plan says what the objective is, checkpoints and the adapter are written, the
    before/after evaluation scores the chosen answers; killed during step 3 and resumed, the same losses."""
    out, output = dpo_run
    lines = logged(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert lines[0]["loss"] == pytest.approx(LN2, abs=1e-6) and lines[-1]["loss"] < LN2 - 1e-3
    for m in lines:
        assert set(DPO_FIGURES) <= set(m), m
        # the means are of the same pairs: margin = chosen - rejected, to float32 rounding
        assert m["reward_margin"] == pytest.approx(m["reward_chosen"] - m["reward_rejected"], abs=1e-6)
        assert 0 <= m["preference_accuracy"] <= 1 and "label_tokens_per_s" not in m
    assert lines[0]["preference_accuracy"] == 0 and lines[0]["reward_margin"] == 0  # policy == reference
    assert lines[-1]["reward_margin"] > 0
    evals = [m for m in lines if "val_loss" in m]
    assert [m["step"] for m in evals] == [2, 4]
    assert all({f"val_{f}" for f in DPO_FIGURES} <= set(m) for m in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["objective"] == "dpo"
    assert summary["validation_before"]["val_loss"] == pytest.approx(LN2, abs=1e-6)
    assert summary["validation_before"]["val_preference_accuracy"] == 0
    assert summary["validation_after"]["val_loss"] != pytest.approx(LN2, abs=1e-4)  # 2 pairs: it moved
    assert "val_preference_accuracy" in output
    ev = json.loads((out / "eval.json").read_text())
    chosen = [json.loads(line)["chosen"]["value"] for line in Path(pref.val).read_text().splitlines()]
    assert ev["after"]["samples"] == 2 and [e["reference"] for e in ev["after"]["examples"]] == chosen[:2]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["objective"]["name"] == "dpo" and plan["objective"]["rows_per_record"] == 2
    assert plan["objective"]["options"] == {
        "beta": 0.1,
        "dpo_loss": "sigmoid",
        "label_smoothing": 0.0,
        "rpo_alpha": 0.0,
    }
    assert plan["memory"]["batch"]["samples"] == 4  # 2 pairs, 2 rows each
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()

    # the same run, stopped during step 3 (after the step-2 checkpoint), then resumed
    again = tmp_path / "again"
    die_at_step(monkeypatch, 3)
    code, _ = cli_invoke(*dpo_args(pref, again))
    assert code != 0 and [m["step"] for m in logged(again)] == [1, 2]
    monkeypatch.undo()
    code, text = cli_invoke(*dpo_args(pref, again, "--resume"))
    assert code == 0, text
    for a, b in zip(lines, logged(again), strict=True):
        for key in ("loss", *DPO_FIGURES):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a, b)


def test_the_report_plots_dpos_figures_in_training_and_validation(dpo_run, tmp_path):
    """``vlft report`` on the DPO run: a chart per DPO figure (rewards, margin, preference accuracy, log-probs)
    under the objective's heading, each drawn from the run's metrics.jsonl: the training values at every
    logged step, the validation's (``val_<figure>``) at steps 2 and 4."""
    from PIL import Image

    from vlft.commands.report import read_run, series

    run, out = dpo_run[0], tmp_path / "report"
    code, output = cli_invoke("report", run, "--output", out)
    assert code == 0, output
    md = (out / "report.md").read_text()
    assert "## dpo figures" in md
    for figure in DPO_FIGURES:
        assert f"![{figure} (dpo)]({figure}.png)" in md and f"{figure}.png: no run logged" not in md
        with Image.open(out / f"{figure}.png") as img:
            img.verify()
    assert (out / "report.html").read_text().count('src="data:image/png;base64,') == 5 + len(DPO_FIGURES)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    data = [read_run(run, "dpo")]
    for figure in ("reward_margin", "preference_accuracy", "reward_chosen", "reward_rejected"):
        for key in (figure, f"val_{figure}"):
            logged_here = [m for m in metrics if key in m]
            assert series(data, key) == [("dpo", [m["step"] for m in logged_here], [m[key] for m in logged_here])]
    assert [m["step"] for m in metrics if "val_reward_margin" in m] == [2, 4]


def test_the_dry_run_and_vlft_objectives_show_the_objective(pref, tmp_path, registry):
    code, output = cli_invoke(
        "run",
        "--objective",
        "dpo",
        "--beta",
        "0.3",
        "--backend",
        "cpu",
        "--data",
        pref.train,
        "--val-data",
        pref.val,
        "--dry-run",
    )
    assert code == 0, output
    assert "objective    dpo beta=0.3 dpo_loss=sigmoid label_smoothing=0.0 rpo_alpha=0.0" in output
    assert "reference: the base model (the adapter switched off)" in output
    # a --config file names an objective's options by their flags' names, as the flags do
    config = tmp_path / "dpo.yaml"
    config.write_text(f"objective: dpo\nbeta: 0.3\ndpo-loss: hinge\ndata: {pref.train}\nval-data: {pref.val}\n")
    code, output = cli_invoke("run", "--config", config, "--backend", "cpu", "--rpo-alpha", "0.5", "--dry-run")
    assert code == 0 and "objective    dpo beta=0.3 dpo_loss=hinge label_smoothing=0.0 rpo_alpha=0.5" in output
    config.write_text("objective: dpo\nbeta: strong\n")
    code, output = cli_invoke("run", "--config", config, "--dry-run")
    assert code != 0 and "--beta (dpo) expects float, got 'strong'" in output
    config.write_text("objective: dpo\nbetta: 0.3\n")
    code, output = cli_invoke("run", "--config", config, "--dry-run")
    assert code != 0 and "unknown key 'betta'" in output and "beta, " in output  # the valid keys listed
    code, output = cli_invoke("objectives")
    assert code == 0 and "dpo: direct preference optimisation" in output and "sft: supervised" in output
    assert "no --packing:" in output
    names = {i.name for infos in registry.pm.hook.vlft_objectives() for i in infos}
    assert {"sft", "dpo"} <= names
    from vlft.config import RunConfig

    assert registry.objective_for(RunConfig()).supervised
    with pytest.raises(
        ConfigError, match="unknown objective 'ppo'; valid objectives: dpo, grpo, kto, orpo, sft, simpo"
    ):
        registry.objective("ppo")
    # an option the objective does not declare is refused before anything loads, naming whose it is
    code, output = cli_invoke("run", "--objective", "sft", "--beta", "0.3", "--dry-run")
    assert (
        code != 0
        and "--beta is not an option of the sft objective (dpo, grpo, kto and simpo take it); its options: none"
        in output
    )


def test_sft_then_dpo_from_its_adapter(pref, tmp_path, monkeypatch):
    """``--init-adapter RUN``: the DPO run loads the SFT run's adapter, trains on from it and takes it as its
    reference (step 1: ln 2 exactly, which the base as reference would not give: the SFT adapter moved the
    log-probabilities); its "before" scores are the SFT run's "after" (the same adapter on the same prompts);
    resumed, it keeps that reference."""
    from safetensors.torch import load_file

    sft = tmp_path / "sft"
    common = brief_flags(batch_size=2, eval_samples=2, max_new_tokens=4, seed=1, lr=3e-3, adapter={"lora_dropout": 0})
    code, output = cli_invoke(
        "run", "--data", pref.root / "train.jsonl", "--val-data", pref.root / "val.jsonl", "--output", sft,
        "--steps", "3", *common,
    )  # fmt: skip
    assert code == 0, output
    dpo = tmp_path / "dpo"
    dpo_flags = [
        "run", "--objective", "dpo", "--init-adapter", sft, "--data", pref.train, "--val-data", pref.val,
        "--steps", "3", *common,
    ]  # fmt: skip
    code, output = cli_invoke(*dpo_flags, "--output", dpo)
    assert code == 0, output
    first = logged(dpo)[0]
    assert first["loss"] == pytest.approx(LN2, abs=1e-6) and first["reward_margin"] == 0
    assert logged(dpo)[1]["loss"] != pytest.approx(LN2, abs=1e-4)
    # stopped during step 3 and resumed: the reference is still the SFT adapter (kept in the checkpoint), not
    # the step-2 weights the run resumes from, so step 3 gives the uninterrupted loss
    again = tmp_path / "again"
    die_at_step(monkeypatch, 3)
    code, _ = cli_invoke(*dpo_flags, "--output", again, "--save-every", "2")
    assert code != 0 and (again / "checkpoints" / "step-000002").is_dir()
    monkeypatch.undo()
    code, output = cli_invoke(*dpo_flags, "--output", again, "--save-every", "2", "--resume")
    assert code == 0, output
    assert logged(again)[2]["loss"] == pytest.approx(logged(dpo)[2]["loss"], rel=1e-5)
    before = json.loads((dpo / "eval.json").read_text())["before"]
    sft_after = json.loads((sft / "eval.json").read_text())["after"]
    assert [e["prediction"] for e in before["examples"]] == [e["prediction"] for e in sft_after["examples"]]
    plan = json.loads((dpo / "plan.json").read_text())
    assert plan["init_adapter"] == str(sft / "adapter")
    assert plan["objective"]["reference"].startswith("the adapter as --init-adapter loaded it")
    assert plan["memory"]["reference_bytes"] == 4 * plan["memory"]["adapter_parameters"]
    start, trained = (load_file(str(p / "adapter" / "adapter_model.safetensors")) for p in (sft, dpo))
    assert start.keys() == trained.keys() and any(not torch.equal(start[k], trained[k]) for k in start)

    # an adapter of another method, or on other modules, is refused before anything is written
    code, output = cli_invoke(
        "run", "--objective", "dpo", "--init-adapter", sft, "--method", "oft", "--data", pref.train,
        "--output", tmp_path / "no1", "--steps", "1",
    )  # fmt: skip
    assert code != 0 and "holds a lora adapter" in output and not (tmp_path / "no1").exists()
    code, output = cli_invoke(
        "run", "--objective", "dpo", "--init-adapter", sft, "--targets", "text", "--data", pref.train,
        "--output", tmp_path / "no2", "--steps", "1",
    )  # fmt: skip
    assert code != 0 and "this run plans 8" in output and not (tmp_path / "no2").exists()


def test_dpo_loss_options_take_effect(pref, tmp_path):
    """--dpo-loss, --beta, --label-smoothing and --rpo-alpha, one pair a step (so the logged margin m = beta x
    the pair's log-ratio margin is that pair's): ipo starts at (1 / (2 beta))^2 (margin 0); hinge is
    relu(1 - m); sigmoid with smoothing eps is -(1 - eps) log sigmoid(m) - eps log sigmoid(-m), and with RPO's
    a, -log sigmoid(m) + a x the chosen reply's mean token NLL, at every step."""

    def run(name, *flags):
        out = tmp_path / name
        values = dict(data=pref.train, val_data=pref.val, output=out, steps=3, batch_size=1, lr=1e-2, seed=2)
        flags = brief_flags(objective="dpo", adapter={"lora_dropout": 0}, **values) + list(flags)
        code, output = cli_invoke("run", *flags)
        assert code == 0, output
        return logged(out)

    def logsigmoid(x):
        return float(torch.nn.functional.logsigmoid(torch.tensor(x, dtype=torch.float64)))

    ipo = run("ipo", "--dpo-loss", "ipo", "--beta", "0.25")
    assert ipo[0]["loss"] == pytest.approx((1 / (2 * 0.25)) ** 2, rel=1e-6)  # 4.0
    hinge = run("hinge", "--dpo-loss", "hinge", "--beta", "0.5")
    assert [m["loss"] for m in hinge] == pytest.approx([max(0.0, 1 - m["reward_margin"]) for m in hinge], abs=1e-5)
    smooth = run("smooth", "--label-smoothing", "0.2", "--beta", "0.5")
    want = [-(0.8) * logsigmoid(m["reward_margin"]) - 0.2 * logsigmoid(-m["reward_margin"]) for m in smooth]
    assert [m["loss"] for m in smooth] == pytest.approx(want, abs=1e-5)
    assert abs(smooth[-1]["reward_margin"]) > 1e-3  # not the trivial point
    plain = [-logsigmoid(m["reward_margin"]) for m in smooth]  # the unsmoothed loss would differ there
    assert smooth[-1]["loss"] != pytest.approx(plain[-1], abs=1e-4)
    rpo = run("rpo", "--rpo-alpha", "0.5", "--beta", "0.5")
    want = [-logsigmoid(m["reward_margin"]) + 0.5 * m["nll_chosen"] for m in rpo]
    assert [m["loss"] for m in rpo] == pytest.approx(want, abs=1e-5)
    assert rpo[0]["nll_chosen"] > 0.1 and rpo[0]["loss"] > LN2 + 0.05  # the NLL term is there from step 1
    code, output = cli_invoke(
        "run",
        "--objective",
        "dpo",
        "--dpo-loss",
        "ipo",
        "--label-smoothing",
        "0.1",
        "--output",
        tmp_path / "no",
        "--dry-run",
    )
    assert code != 0 and "--label-smoothing applies to --dpo-loss sigmoid" in output
    code, output = cli_invoke("run", "--objective", "dpo", "--beta", "0", "--output", tmp_path / "no", "--dry-run")
    assert code != 0 and "--beta (dpo) must be positive, got 0.0" in output


BAD = [
    # 1: no rejected reply
    {
        "conversations": [{"from": "human", "value": "<image>Colour?"}],
        "chosen": {"from": "gpt", "value": "red"},
        "images": ["imgs/train_00000.png"],
    },
    # 2: the same reply twice
    {
        "messages": [{"role": "user", "content": "<image>Colour?"}],
        "chosen": {"role": "assistant", "content": "red"},
        "rejected": {"role": "assistant", "content": "red"},
        "images": ["imgs/train_00000.png"],
    },
    # 3: an image in the rejected reply (TRL layout): the sides' images differ
    {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
        "chosen": [{"role": "assistant", "content": "red"}],
        "rejected": [
            {
                "role": "assistant",
                "content": [{"type": "image", "image": "imgs/train_00001.png"}, {"type": "text", "text": "blue"}],
            }
        ],
        "images": ["imgs/train_00000.png"],
    },
    # 4: a reply that is not the assistant's
    {"prompt": "Colour?", "chosen": [{"role": "user", "content": "red"}], "rejected": "blue"},
    # 5, 6: good, in both layouts
    {
        "messages": [{"role": "user", "content": "<image>Colour?"}],
        "chosen": {"role": "assistant", "content": "red"},
        "rejected": {"role": "assistant", "content": "blue"},
        "images": ["imgs/train_00000.png"],
    },
    {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
        "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
        "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
        "images": ["imgs/train_00000.png"],
    },
    # 7: no prompt
    {"chosen": "red", "rejected": "blue"},
]


def test_bad_preference_data_stops_before_step_1_with_file_and_line(pref, tmp_path):
    from vlft.data.preferences import parse_preference
    from vlft.data.records import read_records_collecting

    data = Path(pref.root) / "bad.jsonl"  # beside the demo's imgs/
    data.write_text("".join(json.dumps(r) + "\n" for r in BAD))
    out = tmp_path / "run"
    code, output = cli_invoke(
        "run", "--objective", "dpo", "--backend", "cpu", "--data", data, "--output", out, "--steps", "1"
    )
    assert code != 0 and not out.exists(), output
    for where, said in (
        (1, "no 'rejected' reply: a preference record needs both 'chosen' and 'rejected'"),
        (2, "chosen and rejected are the same reply ('red')"),
        (3, "chosen and rejected must share the prompt's images: chosen has 1 image(s), rejected 2"),
        (4, "chosen: turn 0 has role 'user'; a reply holds assistant turns only"),
        (7, "a preference record needs its prompt beside 'chosen' and 'rejected'"),
    ):
        assert f"bad.jsonl:{where}: {said}" in output, (where, output)
    assert "5 problem(s)" in output and "bad.jsonl:5" not in output and "bad.jsonl:6" not in output
    # vlft data check reads the objective's layout too: the same problems, and the good pairs counted as such
    code, output = cli_invoke("data", "check", "--objective", "dpo", data)
    assert code != 0 and "5 problem(s) found" in output, output
    for where in (1, 2, 3, 4, 7):
        assert f"bad.jsonl:{where}: " in output, (where, output)
    code, output = cli_invoke("data", "check", "--objective", "dpo", "--json", pref.train)
    assert code == 0, output
    [entry] = json.loads(output)["files"]
    assert entry["records"] == 16 and entry["problems"] == 0 and entry["images"] == 16
    assert all(layout.startswith("preference") for layout in entry["layouts"]), entry
    assert cli_invoke("data", "check", pref.train)[0] != 0  # read as conversations, a pair has no reply
    # the good records of both layouts read the same: one prompt and image, the two replies
    records, problems = read_records_collecting(data, parse=parse_preference)
    assert problems.count == 5 and [r.where for r in records] == ["bad.jsonl:5", "bad.jsonl:6"]
    for r in records:
        assert [(t.role, t.text) for t in r.turns] == [("user", "<image>Colour?"), ("assistant", "red")]
        assert [(t.role, t.text) for t in r.rejected] == [("user", "<image>Colour?"), ("assistant", "blue")]
        assert len(r.images) == 1 and r.layout.startswith("preference")


def test_two_processes_train_as_one(dpo_run, pref, tmp_path):
    """2 data-parallel processes of 1 pair each give the losses and figures of 1 process of 2 pairs (every
    process takes every 2nd pair of one seeded shuffle; the loss is the sum over the step's pairs, divided by
    their number, over both processes)."""
    out = tmp_path / "two"
    args = [str(a) for a in dpo_args(pref, out)]
    args[args.index("--batch-size") + 1] = "1"
    proc = subprocess.run(
        [*vlft_command(), *args, "--nproc-per-node", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(logged(dpo_run[0]), logged(out), strict=True):
        for key in ("loss", *DPO_FIGURES):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a, b)


def test_fsdp_and_packing_are_refused_with_the_reason(pref, tmp_path):
    """An objective that says it cannot run sharded (``Objective.sharding_refusal``; dpo runs sharded:
    tests/test_sharded_objectives.py) stops ``--shard fsdp`` with its reason before any process starts; dpo
    stops ``--packing on`` with its own."""
    from vlft.testing import registry_with

    out = tmp_path / "run"
    unshardable = registry_with(PerRecordPlugin("the loss reads every record whole on one process"))
    code, output = cli_invoke(
        "run",
        "--objective",
        "sft-per-record",
        "--backend",
        "cpu",
        "--data",
        pref.root / "train.jsonl",
        "--output",
        out,
        "--shard",
        "fsdp",
        "--nproc-per-node",
        "2",
        registry=unshardable,
    )
    assert code != 0 and not out.exists(), output
    assert (
        "--shard fsdp: the sft-per-record objective cannot run sharded: the loss reads every record whole on one "
        "process; nothing was started" in output
    )
    code, output = cli_invoke(
        "run",
        "--objective",
        "dpo",
        "--backend",
        "cpu",
        "--data",
        pref.train,
        "--output",
        out,
        "--packing",
        "on",
        "--steps",
        "1",
    )
    assert code != 0 and "--packing on: the dpo objective cannot pack" in output
    assert not out.exists()


def test_one_vision_pass_feeds_both_rows_and_every_adapter_gets_a_gradient(pref, registry, tmp_path):
    """The chosen and rejected rows of a pair share one vision pass, with the log-probabilities of the images
    repeated for each row (exactly: the same features), and the DPO loss reaches every adapter weight."""
    from vlft.data.batching import to_device, with_label_positions
    from vlft.models.families import base_model
    from vlft.models.loss import sequence_logps
    from vlft.models.passes import StepPasses
    from vlft.models.reference import Reference
    from vlft.models.rows import row_inputs
    from vlft.training.trainer import build_trainer

    config = brief_config(
        objective="dpo", data=pref.train, val_data=pref.val, output=tmp_path / "r", steps=1, batch_size=2,
        adapter={"lora_dropout": 0.0},
    )  # fmt: skip
    s = build_trainer(registry, config)
    with torch.no_grad():  # a trained-looking adapter: every part of it in the computation
        for p in s.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    batch = to_device(with_label_positions(s.collate([s.dataset[0], s.dataset[1]])), s.device)
    assert batch["input_ids"].shape[0] == 4 and batch["shared"]["image_grid_thw"].shape[0] == 2
    patches = []
    tower = next(m for n, m in base_model(s.model).named_modules() if n.endswith("visual"))
    hook = tower.register_forward_pre_hook(lambda m, args: patches.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            once, _ = sequence_logps(s.model, row_inputs(s.model, batch, 2), batch)
            twice, _ = sequence_logps(s.model, row_inputs(s.model, batch, 2, share_features=False), batch)
    finally:
        hook.remove()
    n = int(batch["shared"]["image_grid_thw"].prod(-1).sum())
    assert patches == [n, 2 * n]
    torch.testing.assert_close(once, twice, rtol=0, atol=1e-5)
    loss, _ = s.plan.objective.loss(s.model, batch, StepPasses(s.device, None, Reference(s.model)))
    loss.backward()
    grads = {name: p.grad for name, p in s.model.named_parameters() if p.requires_grad}
    assert grads and all(
        g is not None and bool(g.abs().sum() > 0) and bool(torch.isfinite(g).all()) for g in grads.values()
    )
    assert any(".visual." in name for name in grads)


def test_no_hook_is_called_inside_a_dpo_step(pref, registry, tmp_path, monkeypatch):
    from test_run import hook_calls_inside_steps

    config = brief_config(
        objective="dpo", data=pref.train, val_data=pref.val, output=tmp_path / "r", steps=2, batch_size=2
    )
    assert hook_calls_inside_steps(registry, config, monkeypatch) == []


# -- a third party's objective -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PerRecord(Objective):
    """``sft-per-record``: each record's mean token loss, averaged over records."""

    def loss(self, model, batch, passes):
        logps, tokens = passes.sequence_logps(model, batch)
        return (-logps / tokens.clamp(min=1)).sum(), {"label_tokens": tokens.sum().float()}


class PerRecordPlugin:
    def __init__(self, sharding_refusal: str = ""):
        self.sharding_refusal = sharding_refusal

    @hookimpl
    def vlft_objectives(self):
        return [
            ObjectiveInfo(
                "sft-per-record", "supervised loss, each record's mean over its tokens, averaged over records"
            )
        ]

    @hookimpl
    def vlft_objective(self, objective):
        if objective != "sft-per-record":
            return None
        return PerRecord(
            "sft-per-record",
            "supervised loss averaged per record",
            average_over=Average.RECORDS,
            figures=("label_tokens",),
            sharding_refusal=self.sharding_refusal,
        )


def test_a_third_party_objective_trains_through_its_plugin(pref, tmp_path):
    """Registered beside the built-ins, ``sft-per-record`` trains: with one record a step its loss is sft's
    (a record's mean token loss is the token mean of a step of one record), step for step."""
    from vlft.testing import check_plugin, registry_with, run, tiny_run_config

    check_plugin(PerRecordPlugin())
    registry = registry_with(PerRecordPlugin())
    assert "sft-per-record" in registry.objectives
    losses = {}
    for objective in ("sft", "sft-per-record"):
        config = tiny_run_config(
            tmp_path / objective,
            objective=objective,
            steps=3,
            batch_size=1,
            lr=3e-3,
            eval_samples=1,
            max_new_tokens=1,
            adapter={"lora_dropout": 0.0},
        )
        result = run(config, registry)
        losses[objective] = logged(result.output)
    per_record = losses["sft-per-record"]
    assert [m["loss"] for m in per_record] == pytest.approx([m["loss"] for m in losses["sft"]], rel=1e-5)
    assert all(m["label_tokens"] > 1 for m in per_record) and "label_tokens_per_s" not in per_record[0]
