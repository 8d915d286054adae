"""Cross-backend, distributed, accumulation, attention, precision and seed parity, and `vlft parity` itself.

On a CPU-only machine these still check real things (gloo processes, micro-batches against one batch,
eager against SDPA, autocast against fp32); on a GPU or NPU machine the `accelerator` tests compare that
device with the CPU, in fp32 and in the device's default policy. (vlft's step on an overflowing fp16
step: tests/test_device_checks.py.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import embedded_family
from vlft.commands.parity import TOLERANCES, WorkerOptions, compare, run_worker, tolerance_for
from vlft.config import build_config
from vlft.data.batching import collator_for
from vlft.data.encoding import SampleEncoder
from vlft.data.records import read_records


def _cfg(small_data, out, **over):
    train, val = small_data
    values = dict(
        backend="cpu",
        method="lora",
        data=str(train),
        val_data=str(val),
        output=str(out),
        steps=4,
        batch_size=8,
        log_every=1,
        eval_every=0,
        eval_samples=2,
        max_new_tokens=4,
        save_every=0,
        seed=5,
        lr=2e-3,
        warmup_ratio=0.0,
    )
    values.update(over)
    return values


def test_a_failing_rank_stops_the_others_with_a_clear_message(small_data, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": []}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlft",
            "run",
            "--nproc-per-node",
            "2",
            "--backend",
            "cpu",
            "--data",
            str(bad),
            "--output",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode != 0
    assert "no assistant turn" in proc.stderr and "a training process failed" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def batch(small_data, processor):
    enc = SampleEncoder(processor, embedded_family())
    records = read_records(small_data[0])[:4]
    return collator_for(processor, embedded_family())([enc.encode(r) for r in records])


def _loss_and_grads(model, batch):
    from vlft.data.batching import model_inputs
    from vlft.models.loss import token_loss_sum

    model.zero_grad()
    logits = model(**model_inputs(batch)).logits
    loss = token_loss_sum(logits, batch["labels"]) / (batch["labels"][:, 1:] != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_eager_and_sdpa_give_the_same_logits_and_gradients(model_dir, batch):
    from helpers import base_model

    results = {}
    for impl in ("eager", "sdpa"):
        model = base_model(model_dir, attn=impl)
        for p in model.parameters():
            p.requires_grad_(True)
        results[impl] = _loss_and_grads(model, batch)
    (le, ge), (ls, gs) = results["eager"], results["sdpa"]
    torch.testing.assert_close(ls, le, rtol=1e-4, atol=1e-4)
    assert ge.keys() == gs.keys() and len(ge) > 50
    for name in ge:
        torch.testing.assert_close(gs[name], ge[name], rtol=1e-3, atol=1e-5, msg=name)


def _worker(small_data, backend="cpu", precision="fp32", **over):
    values = dict(method="lora", steps=3, batch_size=4, seed=7, model=None, data=str(small_data[0]), attn=None)
    values.update(over)
    return run_worker(backend, precision, WorkerOptions(**values))


def test_seed_parity_same_seed_identical_other_seed_different(small_data):
    a, b, c = _worker(small_data), _worker(small_data), _worker(small_data, seed=8)
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert a["steps"][-1]["weights"] == b["steps"][-1]["weights"]
    assert [s["loss"] for s in a["steps"]] != [s["loss"] for s in c["steps"]]
    assert all(r.ok for r in compare(a, b, TOLERANCES["fp32"]))
    assert not all(r.ok for r in compare(a, c, TOLERANCES["fp32"]))


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_reduced_precision_stays_within_its_stated_tolerance_of_fp32(small_data, low):
    ref, run = _worker(small_data), _worker(small_data, precision=low)
    assert run["precision"] == low
    name, tol = tolerance_for(["fp32", low])
    assert name == low
    rows = compare(ref, run, tol)
    assert all(r.ok for r in rows), rows
    # and it is not secretly fp32: the tight tolerance sees the difference
    assert not all(r.ok for r in compare(ref, run, TOLERANCES["fp32"]))


@pytest.fixture(scope="module")
def cpu_reference(small_data):
    return _worker(small_data, steps=3)


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_cpu_against_each_accelerator(small_data, accelerator, precision, cpu_reference):
    """fp32 on both (TF32 off: a real fp32 comparison), and the accelerator's default policy (what users
    run: bf16 or fp16, flash, sdpa or eager attention) at the tolerance of the precision it resolves to."""
    dev = _worker(small_data, backend=accelerator, steps=3, precision=precision)
    assert dev["available"], dev
    assert all(math.isfinite(s["loss"]) for s in dev["steps"])
    name, tol = tolerance_for([cpu_reference["precision"], dev["precision"]])
    rows = compare(cpu_reference, dev, tol)
    assert all(r.ok for r in rows), (name, dev["precision"], dev["attention"], rows)
    if precision == "fp32":
        assert dev["precision"] == "fp32"
    elif dev["precision"] != "fp32":
        # and the reduced precision really ran: the fp32 tolerance sees the difference
        assert not all(r.ok for r in compare(cpu_reference, dev, TOLERANCES["fp32"])), rows


def _step_figures(small_data, out, float64=False, **over):
    """Per step (loss, gradient norm), and the final adapter weights, of ``prepare`` + vlft's own step.

    ``float64``: the prepared model (base and adapter) is cast to float64 before the first step (AdamW's
    state is created at that step, so it follows the parameters)."""
    from vlft.registry import get_registry
    from vlft.training.trainer import build_trainer

    s = build_trainer(get_registry(), build_config({}, _cfg(small_data, out, adapter={"lora_dropout": 0.0}, **over)))
    if float64:
        from float64_reference import float64_throughout

        float64_throughout(s.model.double())
    figures = []
    s.model.train()
    for group in s.batches():
        r = s.train_step(group)
        figures.append((r.loss, float(r.grad_norm)))
        if len(figures) == s.settings.total_steps:
            break
    return figures, {n: p.detach().clone() for n, p in s.model.named_parameters() if p.requires_grad}


def _varied_replies(train: Path, out: Path) -> Path:
    """The records of ``train`` with replies of 0 to 3 extra words, so micro-batches hold different numbers
    of label tokens (the demo's replies are all about as long, which would hide a per-micro-batch mean)."""
    lines = []
    for i, line in enumerate(train.read_text().splitlines()):
        rec = json.loads(line)
        rec["image"] = str(train.parent / rec["image"])
        rec["conversations"][-1]["value"] += "".join(f", note {k}" for k in range(i % 4))
        lines.append(json.dumps(rec))
    out.write_text("\n".join(lines) + "\n")
    return out


def test_gradient_accumulation_computes_what_one_big_batch_computes(small_data, tmp_path):
    """Batch 2 with 2 micro-batches per step against batch 4, 6 steps. LoRA dropout is off: its masks are drawn
    per micro-batch, which no split can match.

    Both runs compute in float64. In float32 the two differ only by summation order (one batch of 4 against
    two of 2, and a CPU's kernels choose their own blocking: Intel and AMD differ), about 1e-7 of a sum; but
    AdamW divides each gradient by its own running RMS, so a weight whose gradient is near zero (|g| ~ 1e-6
    where the sum's rounding is ~1e-7 of the larger terms) moves by up to the learning rate either way: one
    Intel machine saw 2 of 4,096 weights 2.5e-6 apart (lr 2e-3, 6 steps), while a real accumulation bug
    (each micro-batch divided by its own label count instead of the step's) moves most weights by 1e-4 and
    more. In float64 the rounding is ~1e-16, below AdamW's eps (1e-8) by far, so nothing amplifies it: the
    tolerances below are 1e-9, and the bug (shown in ``test_the_accumulation_check_sees_a_per_micro_batch_mean``)
    is 5 orders of magnitude beyond them. transformers keeps Qwen2.5-VL's RMSNorms and eager softmax in
    float32 whatever the model's dtype, and those float32 reductions split by batch shape and thread count (7e-8
    apart on the loss at 1 thread): ``float64_reference.float64_throughout`` computes them in float64."""
    data = str(_varied_replies(small_data[0], tmp_path / "varied.jsonl"))
    big, wb = _step_figures(small_data, tmp_path / "big", data=data, batch_size=4, steps=6, float64=True)
    acc, wa = _step_figures(small_data, tmp_path / "acc", data=data, batch_size=2, grad_accum=2, steps=6, float64=True)
    assert all(w.dtype == torch.float64 for w in wa.values())
    _assert_same_training(big, wb, acc, wa)
    assert big[-1][0] < big[0][0]  # the adapter moved


def _assert_same_training(big, wb, acc, wa):
    assert len(big) == len(acc) == 6
    for (lb, gb), (la, ga) in zip(big, acc):
        assert la == pytest.approx(lb, rel=1e-9), (big, acc)
        assert ga == pytest.approx(gb, rel=1e-9), (big, acc)
    assert wa.keys() == wb.keys()
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-9, atol=1e-12)


def test_the_accumulation_check_sees_a_per_micro_batch_mean(small_data, tmp_path, monkeypatch):
    """The check above fails on the bug it was written for: each micro-batch's loss divided by its own label
    count and the micro-batch means averaged, instead of the step's sum over the step's label count. The bug
    is injected into vlft's step for this test only: each micro-batch's loss sum is rescaled so that
    ``sum * world / step_tokens`` becomes ``mean / micro_batches`` (with one micro-batch it changes nothing)."""
    import vlft.models.passes
    import vlft.training.step

    data = str(_varied_replies(small_data[0], tmp_path / "varied.jsonl"))
    big, wb = _step_figures(small_data, tmp_path / "big", data=data, batch_size=4, steps=6, float64=True)
    real_step, real_sum = vlft.training.step.train_step, vlft.models.passes.batch_loss_sum
    factors = []

    def step_with_per_micro_batch_means(model, optimizer, scheduler, micro_batches, *rest):
        counts = [vlft.data.batching.label_count(b) for b in micro_batches]
        factors[:] = [sum(counts) / (len(counts) * c) for c in counts]
        return real_step(model, optimizer, scheduler, micro_batches, *rest)

    monkeypatch.setattr(vlft.training.step, "train_step", step_with_per_micro_batch_means)
    calls = []

    def rescaled_sum(*args, **kwargs):  # outside a step nothing is rescaled
        calls.append(bool(factors))
        return real_sum(*args, **kwargs) * (factors.pop(0) if factors else 1.0)

    monkeypatch.setattr(vlft.models.passes, "batch_loss_sum", rescaled_sum)
    acc, wa = _step_figures(small_data, tmp_path / "acc", data=data, batch_size=2, grad_accum=2, steps=6, float64=True)
    assert not factors and calls.count(True) == 12  # the bug ran, on each of the 6 x 2 micro-batches
    with pytest.raises(AssertionError):
        _assert_same_training(big, wb, acc, wa)


def test_vlft_parity_command_prints_the_table_and_exits_1_beyond_tolerance(small_data, tmp_path, monkeypatch):
    """The command as a user runs it (each backend in a worker process): fp32 against bf16 on the CPU fails at
    the forced fp32 tolerance. The same figures, judged at the default (the looser precision's, bf16), pass:
    that second verdict replays the first call's worker results through the command in this process (a
    stand-in for the workers, which already ran for real), rather than training the same steps again."""
    from click.testing import CliRunner

    import vlft.commands.parity
    from helpers import vlft_command
    from vlft.cli import cli

    tight_path = tmp_path / "tight.json"
    tight = subprocess.run(
        [
            *vlft_command(),
            "parity",
            "--backends",
            "cpu,cpu",
            "--precision",
            "fp32,bf16",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--data",
            str(small_data[0]),
            "--output",
            str(tight_path),
            "--tolerance",
            "fp32",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # one thread: robust on a busy host

    def table(stdout):
        return [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]

    assert tight.returncode == 1, tight.stdout + tight.stderr[-3000:]
    tight_json = json.loads(tight_path.read_text())
    assert tight_json["tolerance"]["name"] == "fp32" and not tight_json["passed"]
    first = next(r for r in tight_json["comparison"] if not r["ok"])
    assert f"DIVERGED first at step {first['step']}:" in tight.stdout
    tight_table = table(tight.stdout)
    assert [row[-1] for row in tight_table] == ["ok" if r["ok"] else "DIVERGED" for r in tight_json["comparison"]]
    for row, r in zip(tight_table, tight_json["comparison"]):  # the table prints the JSON's losses
        assert (float(row[1]), float(row[2])) == pytest.approx((r["loss_a"], r["loss_b"]), abs=1e-6)

    runs = tight_json["runs"]

    def replay(index, backend, precision, opts, out, probe_only=False):
        return {"backend": backend, "available": True} if probe_only else runs[index]

    monkeypatch.setattr(vlft.commands.parity, "_spawn_worker", replay)
    loose_path = tmp_path / "loose.json"
    loose = CliRunner().invoke(
        cli,
        [
            "parity",
            "--backends",
            "cpu,cpu",
            "--precision",
            "fp32,bf16",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--data",
            str(small_data[0]),
            "--output",
            str(loose_path),
        ],
    )
    assert loose.exit_code == 0, loose.output
    loose_json = json.loads(loose_path.read_text())
    assert loose_json["tolerance"]["name"] == "bf16" and loose_json["passed"]
    assert [row[0] for row in table(loose.stdout)] == ["1", "2"] and all(r[-1] == "ok" for r in table(loose.stdout))
    assert "PASSED" in loose.stdout
    # the same seeded runs: the figures agree, only the verdicts differ
    assert [r["loss_diff"] for r in tight_json["comparison"]] == [r["loss_diff"] for r in loose_json["comparison"]]


def test_vlft_parity_writes_into_a_folder_of_its_own_and_says_where(tmp_path, monkeypatch):
    """Without --output the figures go to runs/parity-<time>-A-B/parity.json, not loose into the working
    folder. The workers are stood in for (two identical fake runs): only where the command writes is tested."""
    from click.testing import CliRunner

    import vlft.commands.parity
    from vlft.cli import cli

    steps = [{"step": 1, "loss": 2.0, "grad_norm": 1.0, "weights": {"m.layers.0.q": [1.0, 2.0]}}]

    def stand_in(index, backend, precision, opts, out, probe_only=False):
        if probe_only:
            return {"backend": backend, "available": True}
        return {"backend": backend, "available": True, "precision": "fp32", "device": "cpu", "steps": steps}

    monkeypatch.setattr(vlft.commands.parity, "_spawn_worker", stand_in)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["parity", "--backends", "cpu,cpu", "--steps", "1"])
    assert result.exit_code == 0, result.output
    written = list(tmp_path.rglob("*.json"))
    assert len(written) == 1 and written[0].name == "parity.json", written
    folder = written[0].parent
    assert folder.parent == tmp_path / "runs" and folder.name.startswith("parity-") and folder.name.endswith("-cpu-cpu")
    assert json.loads(written[0].read_text())["passed"] is True
    assert f"wrote {written[0].relative_to(tmp_path)}" in result.output
