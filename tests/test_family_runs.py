"""Every embedded family as a user runs it: trained on mixed data (text-only records beside records of 1-2
images, so a micro-batch often has no image and the vision warm-up must run the tower), then ``vlft
predict``, ``vlft eval`` and ``vlft export`` on the run, the merged model checked against base + adapter.

Every family trains under 2 processes (``vlft run --nproc-per-node 2``), where a warm-up that went wrong
stops the run (a collective mismatch, an unused parameter): SigLIP towers (Gemma 3 from the example plugin,
which ``make test`` installs; SmolVLM's tiles; LLaVA-OneVision's any-resolution tiles, a record of 2 images
tiled otherwise than one of 1), the Qwen towers (windowed, deepstack, MoE and hybrid text models), GLM-4.1V's
and GLM-4.6V's (the processor writing the image tokens, a Conv2d merge before the merger) and Gemma 4's (2-D
rotary positions, k x k pooled patches padded to the image budget) data parallel; Qwen3-VL's sharded
(``--shard fsdp``, whose gathers and reductions must run in the same order on every process). The families
declared on the generic family (InternVL, LLaVA-NeXT(-Video), Mistral 3, Llama 4, MiniCPM-V 4.6), PaliGemma and
Idefics3 train in one process here (PaliGemma: each multi-turn record's earlier replies in its prompt, the last reply
trained): their 2-process runs are test_mixed_ddp.py's, which puts a text-only record on one process at every step.
Llama 4 adapts its routed experts too. One run per family, shared by its checks.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import brief_flags, cli_invoke, export_logits, vlft_command

FAMILIES = [
    "qwen2-vl",
    "qwen2.5-vl",
    "qwen3-vl",
    "qwen3-vl-moe",
    "qwen3.5",
    "qwen3.5-moe",
    "gemma3",
    "smolvlm",
    "llava-onevision",
    "glm4.1v",
    "glm4.6v",
    "gemma4",
    "internvl",
    "llava-next",
    "llava-next-video",
    "mistral3",
    "llama4",
    "minicpmv4.6",
    "paligemma",
]
# every family under 2-process DDP on the mixed data, but those test_mixed_ddp runs so
TWO_PROCESSES = set(FAMILIES) - {
    *("internvl", "llava-next", "llava-next-video", "mistral3", "llama4", "minicpmv4.6", "paligemma")
}
# Llama 4 adapts its routed experts too (PEFT target_parameters), as the Qwen MoE families can
ADAPTER_OPTS = {"llama4": ["--adapter-opt", "target_experts=true"]}
SHARDED = {"qwen3-vl"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path]:
    from vlft.data.demo import write_varied_dataset

    root = tmp_path_factory.mktemp("mixed")
    shape = dict(min_side=28, max_side=96, max_images=2, answer_words=(1, 8), max_turns=2)
    return (
        write_varied_dataset(root / "train", n=16, seed=4, **shape),
        write_varied_dataset(root / "val", n=4, seed=5, **shape),
    )


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, mixed, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    if family == "gemma3":
        pytest.importorskip("vlft_example_plugin", reason="the example plugin (make test installs it)")
    train, val = mixed
    out = tmp_path_factory.mktemp(family) / "run"
    processes = 2 if family in TWO_PROCESSES else 1
    args = [
        "run",
        "--nproc-per-node",
        str(processes),
        *brief_flags(
            model=f"embedded:{family}", data=train, val_data=val, output=out, steps=3, batch_size=2,
            max_new_tokens=2, lr=3e-3, seed=2,
        ),
    ]  # fmt: skip
    if family in SHARDED:
        args += ["--shard", "fsdp"]
    args += ADAPTER_OPTS.get(family, [])
    if processes == 1:
        _vlft(*args)
    else:
        proc = subprocess.run([*vlft_command(), *args], capture_output=True, text=True, env=ENV, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return family, out


def _vlft(*args) -> str:
    code, output = cli_invoke(*args)
    assert code == 0, output
    return output


def test_every_family_trains_on_mixed_data(family_run, mixed):
    from safetensors.torch import load_file

    family, out = family_run
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert config["world_size"] == (2 if family in TWO_PROCESSES else 1)
    assert summary["status"] == "completed" and summary["steps"] == 3
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model_family"]["name"] == family
    assert plan["sharding"]["strategy"] == ("fsdp" if family in SHARDED else "none")
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "loss" in m] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged if "loss" in m)
    # the vision adapters trained too (LoRA B starts at 0): the tower ran on every process
    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    vision_b = [v for k, v in weights.items() if "lora_B" in k and any(t in k for t in ("visual", "vision"))]
    assert vision_b and max(float(v.abs().max()) for v in vision_b) > 0
    if family in ADAPTER_OPTS:  # the routed experts trained too (their 3-D weights), the router never
        experts_b = [v for k, v in weights.items() if "lora_B" in k and ".experts." in k]
        assert experts_b and max(float(v.abs().max()) for v in experts_b) > 0
        assert not any(".router." in k for k in weights)


@pytest.fixture
def prompt_logits(monkeypatch) -> list:
    """For each model ``vlft predict`` / ``vlft eval`` load in this process, in order: the logits of its first
    forward pass (the prompts' prefill in ``generate``) at the last prompt position, ``[records, vocab]``."""
    import vlft.evaluation.inference as inference

    seen: list = []
    load = inference.load_for_inference

    def loading(*args, **kwargs):
        loaded = load(*args, **kwargs)
        model = loaded.model.get_base_model() if hasattr(loaded.model, "get_base_model") else loaded.model
        mine = len(seen)

        def keep(module, inputs, output):
            if len(seen) == mine:
                seen.append(output.logits[:, -1].detach().float().clone())

        model.register_forward_hook(keep)
        return loaded

    monkeypatch.setattr(inference, "load_for_inference", loading)
    return seen


def test_predict_and_eval_read_every_familys_run(family_run, mixed, tmp_path, prompt_logits):
    """``vlft predict`` and ``vlft eval`` answer with the run's adapter: the model they run gives other logits on
    the prompts than the base model (``vlft predict --model``, no adapter), and the two give the same logits and
    so the same answers. (Logits, not answers: two greedy tokens of a tiny model often stay the base's, and the
    Gemma models answer blank lines either way.)"""
    family, out = family_run
    _, val = mixed

    def predicted(*source) -> list[str]:
        path = tmp_path / f"p{len(prompt_logits)}.jsonl"
        _vlft("predict", *source, "--data", val, "--output", path, "--max-new-tokens", "2", "--quiet")
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(lines) == 4 and all(isinstance(line["prediction"], str) for line in lines)
        return [line["prediction"] for line in lines]

    adapted = predicted("--adapter", out)
    predicted("--model", f"embedded:{family}")  # the base the run trained, without the adapter
    scores = tmp_path / "e.json"
    quiet = _vlft("eval", "--adapter", out, "--data", val, "--output", scores, "--max-new-tokens", "2", "--quiet")
    result = json.loads(scores.read_text())
    assert result["samples"] == 4
    scored = [e["prediction"] for e in result["scores"]["examples"]]  # every record (the first 5 are kept)
    assert len(prompt_logits) == 3
    with_adapter, without, evaluated = prompt_logits
    # the same weights, prompts, batch and arithmetic: equal; with the adapter off they would equal the base's too,
    # while three steps at lr 3e-3 move the logits by more than 1e-2 (the export test's bound, on these runs)
    assert torch.equal(evaluated, with_adapter), f"{family}: vlft eval and vlft predict ran different models"
    difference = float((with_adapter - without).abs().max())
    assert difference > 1e-2, (
        f"{family}: vlft predict --adapter gave the base model's logits (largest difference "
        f"{difference:.2e}): the adapter was not loaded"
    )
    assert scored == adapted, f"{family}: vlft eval scored {scored}, vlft predict answered {adapted}"
    shown = _vlft("eval", "--adapter", out, "--data", val, "--output", tmp_path / "e2.json", "--max-new-tokens", "2")
    assert "eval: 100%" in shown and "4/4" in shown  # the progress bar, which --quiet leaves out
    assert "eval:" not in quiet


def test_export_of_every_family_gives_the_adapters_logits(family_run, mixed, tmp_path):
    """The merged model, loaded by plain transformers, against the trained model (base + adapter) on
    records with and without images; and against the base, so the comparison is not of base models."""
    from vlft.data.records import read_records

    _, out = family_run
    _, val = mixed
    merged = tmp_path / "merged"
    _vlft("export", "--adapter", out, "--output", merged, "--dtype", "fp32")
    records = read_records(val)
    assert any(r.images for r in records) and any(not r.images for r in records)
    # the attention the run used (the CPU reference: eager)
    logits = export_logits(out, merged, records, attn="eager", backend="cpu", precision="fp32", param_dtype="fp32")
    # fp32 merge: W x + B A x against (W + B A) x differ in summation order only
    assert (logits["exported"] - logits["adapted"]).abs().max() < 1e-4
    assert (logits["adapted"] - logits["base"]).abs().max() > 1e-2


def test_packing_on_is_refused_for_a_family_whose_token_inputs_it_cannot_carry(mixed, tmp_path):
    """Gemma 3's token_type_ids (image tokens attend both ways) would be dropped from packed rows: ``--packing
    on`` stops before anything is written, naming them; ``auto`` pads."""
    pytest.importorskip("vlft_example_plugin", reason="the example plugin (make test installs it)")
    train, val = mixed
    args = [
        "run",
        "--quiet",
        "--backend",
        "cpu",
        "--model",
        "embedded:gemma3",
        "--data",
        train,
        "--val-data",
        val,
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--eval-every",
        "0",
        "--eval-samples",
        "1",
        "--max-new-tokens",
        "1",
    ]
    code, output = cli_invoke(*args, "--packing", "on", "--output", tmp_path / "on")
    assert code != 0 and "token_type_ids" in output and "cannot pack" in output
    assert not (tmp_path / "on").exists()
    _vlft(*args, "--packing", "auto", "--output", tmp_path / "auto")
    packing = json.loads((tmp_path / "auto" / "plan.json").read_text())["packing"]
    assert not packing["enabled"] and "token_type_ids" in packing["reason"]
