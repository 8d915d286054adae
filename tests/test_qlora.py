"""QLoRA on the CPU with real bitsandbytes: a 4-bit run trains, its plan counts what bitsandbytes stores,
`vlft export` merges its adapter into the NF4 weights it trained on, and `vlft predict` and `vlft eval` run its
adapter on the 4-bit base (one shared 4-bit run for all of them).

bitsandbytes is not in the dev install: where it is importable, every ``import peft`` loads it (about 1.2 s
per process here, and a warning on stderr), which every other test's subprocess would pay. ``make test``
installs it into a folder of its own (``.venv/qlora-site``) and runs this module a second time with that
folder on PYTHONPATH and ``VLFT_REQUIRE_QLORA=1``, under which a missing bitsandbytes fails instead of
skipping.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_after_training import tiny_data, vlft  # noqa: F401 - tiny_data is a fixture
from test_tuning import _cfg, _train

if os.environ.get("VLFT_REQUIRE_QLORA") != "1":
    pytest.importorskip(
        "bitsandbytes",
        reason="bitsandbytes is not importable here; `make test` runs this module again with it (.venv/qlora-site)",
    )
import bitsandbytes as bnb


def test_nf4_on_cpu_trains_and_the_plan_counts_the_stored_4bit_tensors(small_data, tmp_path):
    """A real 4-bit run, and the plan's weight bytes equal to the bytes of the tensors bitsandbytes keeps
    (packed weights and quantization constants)."""
    from vlft.registry import load_registry
    from vlft.training.trainer import build_trainer

    s = build_trainer(
        load_registry(),
        _cfg(small_data, tmp_path / "run", param_dtype="nf4", double_quant=True, steps=2, warmup_ratio=0.0),
    )
    assert s.plan.precision.quantization == "nf4" and s.plan.precision.autocast_dtype == "bfloat16"
    base = s.model.get_base_model()
    four = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four and not isinstance(base.lm_head, bnb.nn.Linear4bit)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in base.model.visual.merger.modules())
    stored, seen = 0, set()
    for m in base.modules():
        for p in m.parameters(recurse=False):
            if p.requires_grad or id(p) in seen:  # tied embeddings: one tensor
                continue
            seen.add(id(p))
            stored += p.numel() * p.element_size()
            qs = getattr(p, "quant_state", None)
            if qs is not None:
                parts = [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else [])
                stored += sum(t.numel() * t.element_size() for t in parts)
    assert sum(s.plan.memory.base_weights.values()) == stored
    start = {n: p.detach().clone() for n, p in s.model.named_parameters() if p.requires_grad}
    losses = _train(s, 2)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(p, start[n]) for n, p in s.model.named_parameters() if p.requires_grad)


# -- export of a 4-bit run ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nf4_run(tmp_path_factory, tiny_data):  # noqa: F811 - the fixture imported above
    """A 3-step LoRA run on NF4 base weights with double quantization, through `vlft run`'s own code."""
    from test_after_training import _short_run

    return _short_run(tmp_path_factory, tiny_data, "lora", param_dtype="nf4", double_quant=True)[0]


@pytest.fixture(scope="module")
def probe(nf4_run, tiny_data):  # noqa: F811 - pytest passes the imported tiny_data fixture by name
    """Two validation records encoded as the run encodes them, and the trained model's logits on them: the
    4-bit base with the adapter on top, computing in bf16 as in training."""
    from vlft.data.batching import collator_for
    from vlft.data.records import read_records
    from vlft.evaluation.inference import LoadOptions, load_for_inference
    from vlft.registry import load_registry

    loaded = load_for_inference(
        load_registry(), str(nf4_run), None, LoadOptions(backend="cpu", param_dtype="nf4", double_quant=True)
    )
    four_bit = [m for m in loaded.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    # the CPU backend keeps them off bitsandbytes' packed inference path (on AVX512-BF16 CPUs it asserts on
    # these shapes, and rounds differently from training)
    assert four_bit and not any(m.support_avx512bf16_for_cpu for m in four_bit)
    collate = collator_for(loaded.processor, loaded.encoder.family)
    batch = collate([loaded.encoder.encode(r) for r in read_records(tiny_data[1])[:2]])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trained = loaded.model(**inputs).logits.float()
    return inputs, trained


def _merged_logits(folder, inputs):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**inputs).logits


def test_export_merges_into_the_dequantized_nf4_weights_it_trained_on(nf4_run, probe, tmp_path):
    inputs, trained = probe
    code, output = vlft("export", "--adapter", nf4_run, "--output", tmp_path / "merged")
    assert code == 0, output
    assert "(its NF4 weights, dequantized)" in output and "(bfloat16," in output
    assert "caveat: this run trained on 4-bit NF4 base weights" in output
    assert "## Merged from a 4-bit run" in (tmp_path / "merged" / "README.md").read_text()
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    # the two merges in fp32, against the trained 4-bit model: the default merge differs from it by bf16
    # compute rounding only; a merge into the checkpoint's own weights adds the 4-bit rounding the adapter
    # was trained on top of
    assert vlft("export", "--adapter", nf4_run, "--output", tmp_path / "deq", "--dtype", "fp32")[0] == 0
    code, output = vlft(
        "export", "--adapter", nf4_run, "--output", tmp_path / "orig", "--dtype", "fp32", "--merge-into", "original"
    )
    assert code == 0, output
    assert "into the original checkpoint's weights (--merge-into original)" in output
    off_dequantized = (_merged_logits(tmp_path / "deq", inputs) - trained).abs().max().item()
    off_original = (_merged_logits(tmp_path / "orig", inputs) - trained).abs().max().item()
    bf16_export = (_merged_logits(tmp_path / "merged", inputs) - trained).abs().max().item()
    print(
        f"max |logit - trained 4-bit model's|: dequantized fp32 {off_dequantized:.4f}, dequantized bf16 "
        f"{bf16_export:.4f}, original fp32 {off_original:.4f}"
    )
    # the two error sources, not a tolerance: bf16 compute rounds each op by at most 2^-8 relative, while NF4
    # moves each weight by up to half a step of its 16-level code (about 1/15 of the block's absmax), an
    # order of magnitude more; measured 0.06 to 0.07 of it here on the AVX512, AVX2 and generic kernels
    assert off_dequantized < 0.25 * off_original


def test_the_dequantized_merge_is_the_4bit_weight_plus_the_update(nf4_run, tmp_path):
    """Weight by weight: every quantized linear of the export is bitsandbytes' dequantization of the trained
    4-bit weight plus the LoRA update (B A scaled), to fp32 rounding."""
    from transformers import AutoModelForImageTextToText

    from vlft.evaluation.inference import LoadOptions, load_for_inference
    from vlft.registry import load_registry

    assert vlft("export", "--adapter", nf4_run, "--output", tmp_path / "deq", "--dtype", "fp32")[0] == 0
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "deq", dtype=torch.float32).state_dict()
    loaded = load_for_inference(
        load_registry(), str(nf4_run), None, LoadOptions(backend="cpu", param_dtype="nf4", double_quant=True)
    )
    checked = 0
    for name, module in loaded.model.named_modules():
        if not (hasattr(module, "lora_A") and isinstance(module.base_layer, bnb.nn.Linear4bit)):
            continue
        base = module.base_layer
        four_bit = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
        b, a, scale = module.lora_B["default"].weight, module.lora_A["default"].weight, module.scaling["default"]
        update = (b @ a) * scale
        # fp32 rounding of PEFT's merge against this one: a rank-r dot product in either summation order, the
        # scaling and the addition, each within eps of the magnitudes involved (the dequantized weight is exact)
        bound = torch.finfo(torch.float32).eps * ((a.shape[0] + 2) * (b.abs() @ a.abs()) * scale + four_bit.abs())
        key = name.removeprefix("base_model.model.") + ".weight"
        assert ((merged[key] - (four_bit + update)).abs() <= bound).all(), key
        assert update.abs().max() > 0  # trained
        checked += 1
    assert checked >= 8


def test_a_bare_adapter_folder_cannot_be_merged_as_dequantized(nf4_run, tmp_path):
    """A bare PEFT folder does not say how its base was quantized: the default is the original weights, and
    asking for the dequantized ones is refused before anything is written."""
    import shutil

    bare = shutil.copytree(nf4_run / "adapter", tmp_path / "adapter")
    code, output = vlft("export", "--adapter", bare, "--output", tmp_path / "m", "--merge-into", "dequantized")
    assert code != 0 and "bare adapter folder" in output and "--merge-into original" in output
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m-*"))


def test_eval_scores_the_trained_4bit_model_quantized_as_the_run_was(nf4_run, tiny_data, tmp_path):  # noqa: F811 - the imported fixture
    """`vlft eval --param-dtype nf4` loads the base in 4-bit with the run's double quantization, and says so."""
    out = tmp_path / "scores.json"
    code, output = vlft(
        "eval",
        "--adapter",
        nf4_run,
        "--data",
        tiny_data[1],
        "--param-dtype",
        "nf4",
        "--backend",
        "cpu",
        "--max-new-tokens",
        4,
        "--output",
        out,
    )
    assert code == 0, output
    precision = json.loads(out.read_text())["precision"]
    assert precision["quantization"] == "nf4" and precision["double_quant"] is True
    assert json.loads(out.read_text())["scores"]["samples"] == 4


def test_predict_answers_every_record_with_the_trained_adapter_on_the_4bit_base(
    nf4_run,
    probe,
    tiny_data,  # noqa: F811 - the imported fixture
    tmp_path,
    monkeypatch,
):
    """`vlft predict --param-dtype nf4`: one prediction per record, in the data's order, made by the model the
    run trained: bitsandbytes' 4-bit linears under the LoRA layers, the saved adapter's weights on them, and
    the trained 4-bit model's logits (the ``probe``'s)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    import vlft.evaluation.generation as generation
    from vlft.data.records import read_records

    used = []  # the model predict generated with (watched, not replaced: the real generation runs)
    real_generate = generation.generate_answers

    def watched(model, *args, **kwargs):
        used.append(model)
        return real_generate(model, *args, **kwargs)

    monkeypatch.setattr(generation, "generate_answers", watched)
    out = tmp_path / "predictions.jsonl"
    code, output = vlft(
        "predict",
        "--adapter",
        nf4_run,
        "--data",
        tiny_data[1],
        "--param-dtype",
        "nf4",
        "--backend",
        "cpu",
        "--max-new-tokens",
        4,
        "--output",
        out,
        "--quiet",
    )
    assert code == 0, output
    records = read_records(tiny_data[1])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["where"] for p in lines] == [r.where for r in records] and len(lines) == 4
    assert all(isinstance(p["prediction"], str) for p in lines)

    [model] = used
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert any(isinstance(m.base_layer, bnb.nn.Linear4bit) for m in adapted), (
        "no LoRA layer sits on a 4-bit linear: the base was not loaded in 4-bit"
    )
    saved = load_file(str(nf4_run / "adapter" / "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(model)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k].cpu(), saved[k]) for k in saved)
    assert any("lora_B" in k and saved[k].abs().max() > 0 for k in saved)  # trained, not the zero init
    inputs, trained = probe
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(**inputs).logits.float(), trained)
