"""``--packing`` as a user runs it: real ``vlft run``s on variable-length data (0-2 images per record,
text-only records among them, 1-3 turns), packed against padded on the same seed.

Every run computes in float64 (the test plugin ``float64_reference``, loaded in-process and, for torchrun's
workers, through ``VLFT_PLUGINS``) with LoRA/OFT dropout off (packed and padded batches have other shapes,
so they would draw other dropout masks): packed and padded then differ in summation order only, and their
logged losses agree to the float32 rounding of the logged figure (``LOGGED_RTOL``). The runs are shared by
module-scoped fixtures: 1 process padded, packed, and packed killed after step 6 then resumed; 2 processes
data parallel and sharded (FSDP2), packed; OFT, Qwen3-VL and Qwen3-VL MoE (expert LoRA) packed and padded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import float64_reference
import pytest
from float64_reference import LOGGED_RTOL

from helpers import die_at_step as dying
from helpers import run_flags, vlft_command
from vlft.config import build_config

HERE = Path(__file__).resolve().parent
STEPS = 8
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "VLFT_PLUGINS": "float64_reference",
    "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
}


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> tuple[Path, Path]:
    """32 training and 8 validation records of 1-3 turns, 0-2 images of 28-160 pixels a side."""
    from vlft.data.demo import write_varied_dataset

    root = tmp_path_factory.mktemp("varied")
    shape = dict(min_side=28, max_side=160, max_images=2, answer_words=(1, 20))
    return (
        write_varied_dataset(root / "train", n=32, seed=1, **shape),
        write_varied_dataset(root / "val", n=8, seed=2, **shape),
    )


def _values(varied, out, **over) -> dict:
    train, val = varied
    values = dict(
        backend="cpu",
        data=str(train),
        val_data=str(val),
        output=str(out),
        steps=STEPS,
        batch_size=4,
        log_every=1,
        eval_every=4,
        eval_batches=1,
        eval_samples=2,
        max_new_tokens=4,
        save_every=4,
        seed=3,
        lr=3e-3,
        adapter={"lora_dropout": 0.0},
    )
    values.update(over)
    return values


def _run(values: dict, monkeypatch=None, die_at_step: int | None = None) -> Path:
    """``vlft run`` in this process with the float64 reference; ``die_at_step``: interrupted there (as a
    Ctrl-C would), the folder left as such a run leaves it."""
    from vlft.commands.run import execute
    from vlft.registry import load_registry

    registry = load_registry(plugins=(float64_reference,))
    if die_at_step is None:
        execute(registry, build_config({}, values), progress=False)
        return Path(values["output"])
    dying(monkeypatch, die_at_step)
    with pytest.raises(KeyboardInterrupt):
        execute(registry, build_config({}, values), progress=False)
    monkeypatch.undo()
    return Path(values["output"])


def _cli(values: dict, *extra: str) -> Path:
    proc = subprocess.run(
        [*vlft_command(), "run", "--quiet", *extra, *run_flags(values)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(values["output"])


def _logged(out: Path) -> list[dict]:
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def _val_losses(out: Path) -> list[float]:
    return [m["val_loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_loss" in m]


def _same_losses(a: Path, b: Path, steps: int = STEPS) -> None:
    x, y = _logged(a), _logged(b)
    assert [m["step"] for m in x] == [m["step"] for m in y] == list(range(1, steps + 1))
    for p, q in zip(x, y):
        assert q["loss"] == pytest.approx(p["loss"], rel=LOGGED_RTOL, abs=0), (p, q)
        # the norm is logged in float64: after one AdamW step, whose normalised update amplifies the rounding
        # of near-cancelling gradients, 2 processes against 1 were seen 1e-8 apart (packed 1 process: equal)
        assert q["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-6), (p, q)
    assert x[-1]["loss"] < x[0]["loss"]  # it trained: the comparison is not of two untouched models


def _plan(out: Path) -> dict:
    return json.loads((out / "plan.json").read_text())


@pytest.fixture(scope="module")
def padded(varied, tmp_path_factory) -> Path:
    return _run(_values(varied, tmp_path_factory.mktemp("padded") / "run", packing="off"))


@pytest.fixture(scope="module")
def packed(varied, tmp_path_factory) -> Path:
    return _run(_values(varied, tmp_path_factory.mktemp("packed") / "run", packing="on"))


def test_auto_packs_where_the_data_pads_and_pads_where_it_does_not(varied, tmp_path):
    """``--packing auto`` in real runs on the CPU (the segments path): on the variable-length data, whose
    micro-batches pad, it packs and says what it expects; on the demo set (one image, short answers: nearly
    uniform lengths) it pads, saying why and how to pack anyway. Both train."""
    from vlft.data.packing import CEILING_SHARE

    def padding(packing: dict) -> float:  # the positions per real token the plan found
        return float(packing["reason"].split("compute ")[1].split(" positions")[0])

    out = _run(_values(varied, tmp_path / "varied", packing="auto", steps=2, save_every=0, eval_every=0))
    packed = _plan(out)["packing"]
    assert packed["enabled"] and packed["path"] == "segments" and padding(packed) * CEILING_SHARE > 1
    demo = _run(
        _values(
            varied, tmp_path / "demo", packing="auto", steps=2, save_every=0, eval_every=0, data=None, val_data=None
        )
    )
    padded = _plan(demo)["packing"]
    assert not padded["enabled"] and "auto: padded" in padded["reason"] and "--packing on" in padded["reason"]
    assert padding(padded) * CEILING_SHARE <= 1
    assert [m["step"] for m in _logged(out)] == [m["step"] for m in _logged(demo)] == [1, 2]


def test_a_packed_run_trains_evaluates_and_saves_with_the_padded_losses(padded, packed):
    assert _plan(packed)["packing"]["enabled"] and not _plan(padded)["packing"]["enabled"]
    assert _plan(packed)["precision"]["param_dtype"] == "float64"  # the comparison ran where it can be exact
    _same_losses(padded, packed)
    va, vb = _val_losses(padded), _val_losses(packed)  # validation batches are packed too
    assert len(va) == len(vb) == 2 and vb == pytest.approx(va, rel=1e-12)
    assert (packed / "adapter" / "adapter_model.safetensors").is_file()
    summary = json.loads((packed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert json.loads((packed / "eval.json").read_text())["after"]["samples"] == 2


def test_a_packed_run_counts_samples_and_real_tokens_not_rows(padded, packed):
    """log_every 1: samples_per_s x step_time_s is the step's sample count (4, not 1 packed row); effective
    tokens are the samples' own tokens, the same packed or padded; packing computes fewer positions."""
    for p, q in zip(_logged(padded), _logged(packed)):
        assert q["samples_per_s"] * q["step_time_s"] == pytest.approx(4)
        assert p["samples_per_s"] * p["step_time_s"] == pytest.approx(4)
        real_p, real_q = (m["effective_tokens_per_s"] * m["step_time_s"] for m in (p, q))
        assert real_q == pytest.approx(real_p) and real_q == pytest.approx(round(real_q))
        assert q["tokens_per_s"] == pytest.approx(q["effective_tokens_per_s"])  # one row: no padding at all
    assert any(p["tokens_per_s"] > p["effective_tokens_per_s"] * 1.05 for p in _logged(padded))


def test_a_packed_run_killed_mid_way_resumes_exactly(varied, packed, tmp_path, monkeypatch):
    values = _values(varied, tmp_path / "run", packing="on")
    out = _run(values, monkeypatch, die_at_step=6)  # after the step-4 checkpoint
    assert [m["step"] for m in _logged(out)] == [1, 2, 3, 4, 5]
    _run({**values, "resume": True})
    _same_losses(packed, out)


OFT = dict(method="oft", adapter={"module_dropout": 0.0}, steps=4, save_every=0)


@pytest.fixture(scope="module")
def padded_oft(varied, tmp_path_factory) -> Path:
    return _run(_values(varied, tmp_path_factory.mktemp("padded-oft") / "run", packing="off", **OFT))


@pytest.mark.parametrize("method", ["lora", "oft"])
def test_two_data_parallel_processes_packed_train_as_one_padded_process(varied, padded, padded_oft, tmp_path, method):
    """``--packing on`` (the segments path on the CPU); 2 processes of batch 2 (mixed text-only and image
    micro-batches: the vision warm-up runs) against 1 of batch 4, padded. Each process evaluates 2 batches of
    2: the 4 records the single process evaluates in one batch."""
    reference, over = (padded, {}) if method == "lora" else (padded_oft, OFT)
    out = _cli(
        _values(varied, tmp_path / "run", packing="on", batch_size=2, eval_batches=2, **over), "--nproc-per-node", "2"
    )
    assert _plan(out)["packing"]["enabled"] and _plan(out)["packing"]["path"] == "segments"
    assert _plan(out)["method"]["name"] == method
    _same_losses(reference, out, steps=over.get("steps", STEPS))
    assert _val_losses(out) == pytest.approx(_val_losses(reference), rel=1e-6)  # as the gradient norm


@pytest.mark.parametrize("method", ["lora", "oft"])
def test_two_sharded_processes_packed_train_as_one_padded_process(varied, padded, padded_oft, tmp_path, method):
    reference, over = (padded, {}) if method == "lora" else (padded_oft, OFT)
    out = _cli(
        _values(varied, tmp_path / "run", packing="on", batch_size=2, eval_batches=2, shard="fsdp", **over),
        "--nproc-per-node",
        "2",
    )
    assert _plan(out)["sharding"]["strategy"] == "fsdp" and _plan(out)["packing"]["enabled"]
    assert _plan(out)["method"]["name"] == method
    _same_losses(reference, out, steps=over.get("steps", STEPS))
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_packing_matches_padding_for_oft(varied, padded_oft, tmp_path):
    out = _run(_values(varied, tmp_path / "on", packing="on", **OFT))
    assert _plan(out)["packing"]["enabled"]
    _same_losses(padded_oft, out, steps=4)


@pytest.mark.parametrize(
    "case",
    [
        dict(model="embedded:qwen3-vl"),
        dict(model="embedded:qwen3-vl-moe", adapter={"lora_dropout": 0.0, "target_experts": True}),
    ],
    ids=["qwen3-vl", "qwen3-vl-moe-experts"],
)
def test_packing_matches_padding_for_the_qwen3_families(varied, tmp_path, case):
    runs = {
        p: _run(_values(varied, tmp_path / p, packing=p, steps=4, save_every=0, eval_every=0, **case))
        for p in ("off", "on")
    }
    assert _plan(runs["on"])["packing"]["enabled"]
    _same_losses(runs["off"], runs["on"], steps=4)
