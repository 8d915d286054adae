"""``vlft run --sequence-parallel 2`` as a user runs it: 2 processes split each sample's tokens (Ulysses), and the
run trains exactly what one process trains, with about half the text model's activations per process.

Each check compares a real 2-process run (``--nproc-per-node 2 --sequence-parallel 2``, gloo) with a 1-process run
of the same batches: per-step losses and gradient norms equal to summation order. LoRA's dropout is off in both
(``lora_dropout=0``): each process draws its own chunk's dropout masks, so with dropout the runs differ by design.

- the default family (Qwen2.5-VL, mRoPE positions) on long video records, whose plan at one process does not fit
  a device that the split fits: refused at 1 process with ``--sequence-parallel 2`` among the fixes, trained at 2;
- Qwen2.5-VL packed, on records with images (the packed row's samples kept apart across the chunks);
- SmolVLM (a Llama text model, 1-D positions) padded, and packed under ``--shard fsdp``;
- Qwen3-VL, whose deepstack features (one row per image token) are cut with the tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import brief_flags, installed, vlft_command

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WORDS = "near worn visible box clean colour bottom edge corner seal hole left panel label right product scratch".split()


def _run(out: Path, data: Path, processes: int, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    args = [
        "run",
        "--nproc-per-node",
        str(processes),
        *brief_flags(data=data, val_data=data, output=out, steps=2, lr=3e-3, seed=2, adapter={"lora_dropout": 0}),
        *extra,
    ]
    proc = subprocess.run([*vlft_command(), *args], capture_output=True, text=True, env=ENV, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _steps(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "loss" in m]


def _same_training(one: Path, split: Path) -> None:
    a, b = _steps(one), _steps(split)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    # the split reorders fp32 sums only: the attention's softmax and matmuls over each head's whole row are the
    # same products, but kernels block them by head count and length, and the gradients are summed over the group
    # and averaged by DDP/FSDP in another order. The same bounds as every data-parallel comparison in the suite
    # (parity/test_several_processes.py): a step's loss to 1e-5, its gradient norm (a sum of squares over every
    # adapter weight, after the AdamW step's sensitivity) to 1e-4. A wrong split is far outside them: without the
    # gather's gradient sum the norm halves.
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), (x, y)
    plan = json.loads((split / "plan.json").read_text())
    assert plan["sequence_parallel"] == {"size": 2, "heads_per_process": 2}
    assert plan["memory"]["sequence_split"] == 2


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    from vlft.data.demo import write_varied_dataset

    root = tmp_path_factory.mktemp("sp-mixed")
    return write_varied_dataset(
        root, n=8, seed=3, min_side=28, max_side=96, max_images=1, answer_words=(20, 60), max_turns=2
    )


@pytest.fixture(scope="module")
def far_images(mixed) -> Path:
    """Records with an image at the start and one after a long text, so both chunks of a split row hold image
    tokens (a short reply: the row is mostly prompt)."""
    rows = [json.loads(line) for line in mixed.read_text().splitlines()]
    images = [r["images"][0] for r in rows if r["images"]]
    filler = " ".join(WORDS * 4)
    far = [
        {
            "messages": [
                {"role": "user", "content": f"<image>\n{filler}\n<image>\nWhat colour is the second one?"},
                {"role": "assistant", "content": " ".join(WORDS[i : i + 4])},
            ],
            "images": [images[i % len(images)], images[(i + 1) % len(images)]],
        }
        for i in range(4)
    ]
    path = mixed.with_name("far.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in far))
    return path


@pytest.fixture(scope="module")
def long_records(tmp_path_factory) -> Path:
    """Two records of a video (8 s of 112 x 112 at 8 fps: 512 video tokens) and a long description of it
    (about 1,500 tokens), the kind of sample whose text activations outgrow a device."""
    av = pytest.importorskip("av", reason="writing a test video needs PyAV (a vlft dependency)")
    import numpy as np

    root = tmp_path_factory.mktemp("sp-long")
    rows = []
    for i in range(2):
        with av.open(str(root / f"clip{i}.mp4"), "w") as container:
            stream = container.add_stream("mpeg4", rate=8)
            stream.width, stream.height, stream.pix_fmt = 112, 112, "yuv420p"
            for f in range(64):
                pixels = np.full((112, 112, 3), (f * 9 + i * 60) % 256, dtype=np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(700))
        rows.append(
            {
                "video": f"clip{i}.mp4",
                "conversations": [
                    {"from": "human", "value": "<video>\nDescribe the clip at length."},
                    {"from": "gpt", "value": text},
                ],
            }
        )
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


VIDEO = ("--video-fps", "8", "--video-max-frames", "64", "--batch-size", "1", "--grad-checkpointing", "on")


def _estimate(data: Path, processes: int) -> tuple[int, int]:
    """The plan's bytes per process for ``data``, and its runtime reserve (a dry run: nothing is loaded)."""
    extra = ["--nproc-per-node", "2", "--sequence-parallel", "2"] if processes == 2 else []
    args = ["run", "--dry-run", "--json", "--backend", "cpu", "--data", str(data), *VIDEO, *extra]
    proc = subprocess.run([*vlft_command(), *args], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = json.loads(proc.stdout)["memory"]
    return memory["estimate_bytes"], memory["reserved_bytes"]


def test_a_long_video_record_refused_at_one_process_trains_split_over_two(long_records, tmp_path):
    (one, reserve), (two, _) = _estimate(long_records, 1), _estimate(long_records, 2)
    assert two - reserve < 0.7 * (one - reserve)  # the text model's activations are most of it, halved
    device = f"{int((one + two) / 2 / 0.95)}B"  # the plan uses 95% of a device: between the two estimates
    refused = _run(tmp_path / "one", long_records, 1, *VIDEO, "--device-memory", device, check=False)
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "DOES NOT FIT" in said and "--sequence-parallel 2 (--nproc-per-node 2" in said, said[-3000:]
    assert not (tmp_path / "one" / "metrics.jsonl").exists()
    _run(tmp_path / "split", long_records, 2, *VIDEO, "--device-memory", device, "--sequence-parallel", "2")
    _run(tmp_path / "whole", long_records, 1, *VIDEO, "--no-memory-check")
    _same_training(tmp_path / "whole", tmp_path / "split")


def test_qwen2_5_vl_packed_with_images_trains_one_processes_steps(mixed, tmp_path):
    _run(tmp_path / "one", mixed, 1, "--batch-size", "2", "--packing", "on")
    _run(tmp_path / "split", mixed, 2, "--batch-size", "2", "--packing", "on", "--sequence-parallel", "2")
    assert json.loads((tmp_path / "split" / "plan.json").read_text())["packing"]["enabled"]
    _same_training(tmp_path / "one", tmp_path / "split")


@pytest.mark.parametrize(
    "extra", [("--packing", "off"), ("--packing", "on", "--shard", "fsdp")], ids=["padded", "packed-fsdp"]
)
def test_smolvlm_trains_one_processes_steps(mixed, tmp_path, extra):
    family = ("--model", "embedded:smolvlm", "--batch-size", "2")
    _run(tmp_path / "one", mixed, 1, *family, *extra[:2])
    _run(tmp_path / "split", mixed, 2, *family, *extra, "--sequence-parallel", "2")
    _same_training(tmp_path / "one", tmp_path / "split")


def test_qwen3_vl_cuts_its_deepstack_features_with_the_tokens_and_trains_one_processes_steps(far_images, tmp_path):
    """Qwen3-VL's text model adds the deepstack mergers' features at the image tokens of its first layers
    (``Sharding.marked_inputs``): each process keeps the features of the image tokens in its chunk (both
    chunks hold some: an image at each end of the prompt)."""
    family = ("--model", "embedded:qwen3-vl", "--batch-size", "2")
    _run(tmp_path / "one", far_images, 1, *family)
    _run(tmp_path / "split", far_images, 2, *family, "--sequence-parallel", "2")
    _same_training(tmp_path / "one", tmp_path / "split")


def test_a_text_model_input_no_family_marks_is_refused_with_the_reason():
    """Without its declared marked inputs, Qwen3-VL's text model takes two inputs the split does not know: refused
    at plan time, named."""
    from dataclasses import replace

    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlft.models.families import family_named
    from vlft.planning.sequence import split_problem
    from vlft_models.qwen3_vl import tiny_dir

    family = family_named(installed(), "qwen3-vl")
    config = AutoConfig.from_pretrained(tiny_dir())
    with torch.device("meta"):
        skeleton = AutoModelForImageTextToText.from_config(config)
    assert split_problem(2, config, family, skeleton) is None
    assert family.sharding is not None
    unmarked = replace(family, sharding=replace(family.sharding, marked_inputs={}))
    said = split_problem(2, config, unmarked, skeleton)
    assert said and "takes deepstack_visual_embeds, visual_pos_masks beside its tokens" in said
