"""2-process DDP on mixed text/image data for Qwen3-VL, as a user runs it (``vlft run --nproc-per-node 2``).

At every step one process holds a text-only record and the other a record with an image: the data set is
those two records, and each epoch's two indices are split one per process whatever the shuffle. The
text-only process runs the vision tower on the family's dummy image (``ModelFamily.vision_dummy``; the
model's inputs untouched, so Qwen3-VL never sees ``inputs_embeds`` beside ``input_ids``), or DDP stops at
the first step on parameters that took no part in the loss. Qwen3-VL's deepstack mergers make it the
strictest of the built-in towers (their outputs join decoder layers only where image tokens are). One run,
shared by the checks (module scope).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import vlft_command

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def two_records(tmp_path_factory) -> Path:
    """One text-only record and one with an image (demo data, images beside the file)."""
    from vlft.data.demo import write_varied_dataset

    root = tmp_path_factory.mktemp("two")
    full = write_varied_dataset(
        root, n=16, seed=4, min_side=28, max_side=64, max_images=1, answer_words=(1, 4), max_turns=1
    )
    records = [json.loads(line) for line in full.read_text().splitlines()]

    def has_image(record) -> bool:
        return "<image>" in json.dumps(record) or bool(record.get("images"))

    text_only = next(r for r in records if not has_image(r))
    with_image = next(r for r in records if has_image(r))
    path = full.with_name("two.jsonl")
    path.write_text(json.dumps(text_only) + "\n" + json.dumps(with_image) + "\n")
    return path


@pytest.fixture(scope="module")
def ddp_run(two_records, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-vl-ddp") / "run"
    args = [
        "run",
        "--nproc-per-node",
        "2",
        "--quiet",
        "--backend",
        "cpu",
        "--model",
        "embedded:qwen3-vl",
        "--data",
        str(two_records),
        "--val-data",
        str(two_records),
        "--output",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-samples",
        "1",
        "--max-new-tokens",
        "1",
        "--save-every",
        "0",
        "--lr",
        "3e-3",
        "--seed",
        "2",
    ]
    proc = subprocess.run([*vlft_command(), *args], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_the_data_puts_a_text_only_record_beside_an_image_record(two_records):
    from vlft.data.records import read_records

    records = read_records(two_records)
    assert sorted(bool(r.images) for r in records) == [False, True]


def test_qwen3_vl_trains_under_two_process_ddp_on_mixed_data(ddp_run):
    from safetensors.torch import load_file

    config = json.loads((ddp_run / "config.json").read_text())
    plan = json.loads((ddp_run / "plan.json").read_text())
    summary = json.loads((ddp_run / "summary.json").read_text())
    assert config["world_size"] == 2 and plan["sharding"]["strategy"] == "none"  # DDP, not FSDP
    assert plan["model_family"]["name"] == "qwen3-vl"
    assert summary["status"] == "completed" and summary["steps"] == 2
    logged = [json.loads(line) for line in (ddp_run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logged if "loss" in m]
    assert len(losses) == 2 and all(loss == loss and abs(loss) < 1e6 for loss in losses)
    # the vision adapters trained (LoRA B starts at 0): the tower's gradients were reduced across processes
    weights = load_file(str(ddp_run / "adapter" / "adapter_model.safetensors"))
    vision_b = [v for k, v in weights.items() if "lora_B" in k and ".visual." in k]
    assert vision_b and max(float(v.abs().max()) for v in vision_b) > 0


@pytest.mark.parametrize(
    ("family", "tower"),
    [
        ("llava-onevision", ".vision_tower."),
        ("idefics3", ".vision_model."),
        ("internvl", ".vision_tower."),
        ("llava-next", ".vision_tower."),
        ("mistral3", ".vision_tower."),
        ("llama4", ".vision_model."),
        ("minicpmv4.6", ".vision_tower."),
        ("llava-next-video", ".vision_tower."),
        ("paligemma", ".vision_tower."),
    ],
)
def test_a_tiled_tower_trains_under_two_process_ddp_with_a_text_only_process(two_records, tmp_path, family, tower):
    """The same two records on LLaVA-OneVision (SigLIP on any-resolution tiles, the projector and image_newline
    beside the tower): the text-only process runs the family's dummy tile, or DDP stops at the second step on
    parameters that took no part in the first step's loss. And on Idefics3, whose model drops an all-zero tile
    as padding and then ran its tower on no image at all (``pos_ids.reshape(0, -1)`` on the first step). And on
    the families declared on the generic family (InternVL, LLaVA-NeXT(-Video), Mistral 3: the generic warm-up with one
    blank tile). And on PaliGemma, whose text-only record is a prefix of text alone (no image tokens, no pixels)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = [
        "run",
        "--nproc-per-node",
        "2",
        "--quiet",
        "--backend",
        "cpu",
        "--model",
        f"embedded:{family}",
        "--data",
        str(two_records),
        "--val-data",
        str(two_records),
        "--output",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-samples",
        "1",
        "--max-new-tokens",
        "1",
        "--save-every",
        "0",
        "--lr",
        "3e-3",
        "--seed",
        "2",
    ]
    proc = subprocess.run([*vlft_command(), *args], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert summary["status"] == "completed" and summary["steps"] == 2
    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    vision_b = [v for k, v in weights.items() if "lora_B" in k and tower in k]
    assert vision_b and max(float(v.abs().max()) for v in vision_b) > 0


@pytest.fixture(scope="module")
def generic_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint no family plugin owns (CLIP + Llama, written by plain transformers): the generic family."""
    from generic_checkpoints import build

    return build("llava-plain", tmp_path_factory.mktemp("ckpt") / "llava-plain")


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_a_generic_checkpoint_trains_on_two_processes_with_a_text_only_process(
    two_records, generic_checkpoint, tmp_path, shard
):
    """The generic family under 2-process DDP and under ``--shard fsdp`` on the same two records: the text-only
    process runs the tower on the probe's blank image (the generic warm-up through ``get_image_features``), so
    DDP finds every parameter used and FSDP's gathers stay in step; the vision adapters move on both. Both runs pack
    (the generic family packs this checkpoint: 1-D positions, full attention; the start-up probe runs under DDP and
    is skipped under FSDP), so packing meets both here."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = [
        "run", "--nproc-per-node", "2", "--quiet", "--backend", "cpu", "--model", str(generic_checkpoint),
        "--data", str(two_records), "--val-data", str(two_records), "--output", str(out), "--steps", "2",
        "--batch-size", "2", "--log-every", "1", "--eval-samples", "1",
        "--eval-every", "0", "--max-new-tokens", "1", "--save-every", "0", "--lr", "3e-3", "--seed", "2",
        "--packing", "on", *(["--shard", "fsdp"] if shard == "fsdp" else []),
    ]  # fmt: skip
    proc = subprocess.run([*vlft_command(), *args], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model_family"]["name"] == "generic" and plan["sharding"]["strategy"] == shard, plan["sharding"]
    assert plan["packing"]["enabled"], plan["packing"]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    vision_b = [v for k, v in weights.items() if "lora_B" in k and ".vision_tower." in k]
    assert vision_b and max(float(v.abs().max()) for v in vision_b) > 0
