"""The generic family (plugins/models/generic.py) on checkpoints of model types no vlft family owns, written by
plain transformers with their processor and a real-style chat template (tests/generic_checkpoints.py).

One real run through the CLI on a tiny LLaVA checkpoint whose template has no ``{% generation %}`` markers (CLIP +
Llama; labels from each turn's rendered prefix), on mixed data (text-only records beside records of 1-2 images, so
the vision warm-up runs), shared by the checks: the plan names the generic family and what it found, the labels
are the template's assistant spans, then ``vlft predict``, ``vlft eval``, ``vlft export`` and plain PEFT reload
of the adapter. LLaVA with its markers is read and planned with ``--dry-run``; the refusals name what is missing.
Mistral 3 and InternVL are built in (plugins/models/declared.py): the same label oracle checks their families.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from generic_checkpoints import MARKED, build

from helpers import cli_invoke, export_logits, installed


def _vlft(*args) -> str:
    code, output = cli_invoke(*args)
    assert code == 0, output
    return output


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory) -> Path:
    return build("mistral3", tmp_path_factory.mktemp("ckpt") / "mistral3")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path]:
    from vlft.data.demo import write_varied_dataset

    root = tmp_path_factory.mktemp("mixed")
    shape = dict(min_side=28, max_side=96, max_images=2, answer_words=(1, 6), max_turns=2)
    return (
        write_varied_dataset(root / "train", n=8, seed=4, **shape),
        write_varied_dataset(root / "val", n=3, seed=5, **shape),
    )


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return build("llava-plain", tmp_path_factory.mktemp("ckpt") / "llava-plain")


@pytest.fixture(scope="module")
def run(plain, mixed, tmp_path_factory) -> Path:
    train, val = mixed
    out = tmp_path_factory.mktemp("generic") / "run"
    _vlft(
        "run", "--quiet", "--backend", "cpu", "--model", plain, "--data", train, "--val-data", val,
        "--output", out, "--steps", "3", "--batch-size", "2", "--log-every", "1", "--eval-every", "0",
        "--eval-samples", "1", "--max-new-tokens", "2", "--save-every", "0", "--lr", "3e-3", "--seed", "2",
        "--packing", "on",
    )  # fmt: skip
    return out


def _messages(record) -> list[dict]:
    """The record as transformers' chat messages, its images in the image parts (the oracle's input)."""
    from vlft.data.encoding import _chat_messages
    from vlft.data.records import load_image

    images = iter(load_image(s) for s in record.images)
    messages = _chat_messages(record.turns)
    for m in messages:
        for part in m["content"]:
            if part["type"] == "image":
                part["image"] = next(images)
    return messages


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return build("llava", tmp_path_factory.mktemp("ckpt") / "llava")


@pytest.fixture(scope="module")
def internvl(tmp_path_factory) -> Path:
    return build("internvl", tmp_path_factory.mktemp("ckpt") / "internvl")


@pytest.mark.parametrize("kind", ["mistral3", "llava", "internvl"])
def test_labels_are_the_templates_assistant_spans(kind, request, mixed):
    """Every sample's trained positions are exactly those the template marks as the assistant's, through
    transformers' ``return_assistant_tokens_mask``: replies and their </s>, never the prompt, the image tokens the
    processor wrote ([IMG]/[IMG_BREAK]/[IMG_END]) or the turn markers. Mistral 3's template has no markers (vlft
    splits it prefix by prefix; the oracle is the same template with markers added), nor has InternVL 3's (tiles of
    <img><IMG_CONTEXT>...</img>: built in, declared.py, whose labels the same oracle checks); LLaVA's has them (vlft
    cuts at its spans)."""
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import IGNORE_INDEX, read_records
    from vlft.models.loading import load_processor, model_config_and_family

    folder = request.getfixturevalue(kind)
    registry = installed()
    _, family = model_config_and_family(str(folder), registry)
    assert family.name == {"internvl": "internvl", "mistral3": "mistral3"}.get(kind, "generic")  # built in: declared.py
    processor = load_processor(str(folder), family, registry)
    encoder = SampleEncoder(processor, family)
    records = read_records(mixed[0])
    assert any(len(r.images) == 2 for r in records) and any(len(r.turns) > 2 for r in records)
    image_ids = set(getattr(processor, "image_token_ids", None) or [processor.image_token_id])
    for record in records:
        sample = encoder.encode(record)
        oracle = processor.apply_chat_template(
            _messages(record),
            chat_template=MARKED.get(kind),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert sample["input_ids"].tolist() == list(oracle["input_ids"][0]), record.where
        trained = (sample["labels"] != IGNORE_INDEX).int().tolist()
        assert trained == list(oracle["assistant_masks"][0]), record.where
        assert sum(trained) > 0
        assert not image_ids & {int(i) for i in sample["labels"] if i != IGNORE_INDEX}
        assert image_ids <= set(sample["input_ids"].tolist()) or not record.images


def test_the_run_trains_the_generic_family_and_the_plan_says_what_it_found(run):
    from safetensors.torch import load_file

    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    plan = json.loads((run / "plan.json").read_text())
    fam = plan["model_family"]
    assert fam["name"] == "generic" and fam["model_types"] == ["llava"]
    for found in ("model.vision_tower", "model.multi_modal_projector", "model.language_model.layers", "<image>"):
        assert found in fam["description"], fam["description"]
    assert "no generation markers" in fam["description"]
    # packed (the start-up probe passed: CLIP + Llama's text model keeps packed samples apart on the segments path)
    assert plan["packing"]["enabled"] and plan["packing"]["path"] == "segments", plan["packing"]
    # CLIP resizes every image to its square: --max-pixels would change nothing, and the plan says so
    assert "max pixels none in effect: the processor resizes every image to a fixed size" in fam["description"]
    # the memory plan counts the processor's image tokens and traces the tower (CLIP runs on the meta device)
    assert "tower traced" in fam["description"], fam["description"]
    batch = plan["memory"]["batch"]
    assert batch["images"] >= 1 and batch["image_patches"] == batch["images"] * 16, batch  # 32 px / 8 px patches
    assert not [n for n in plan["notes"] if "vision activations" in n], plan["notes"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "loss" in m] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged if "loss" in m)
    weights = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    text_b = [v for k, v in weights.items() if "lora_B" in k and "language_model" in k]
    vision_b = [v for k, v in weights.items() if "lora_B" in k and "vision_tower" in k]
    assert text_b and max(float(v.abs().max()) for v in text_b) > 0
    assert vision_b and max(float(v.abs().max()) for v in vision_b) > 0  # the tower ran, warm-up included


def test_predict_eval_export_and_plain_peft_reload(run, plain, mixed, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from vlft.data.records import read_records

    _, val = mixed
    predictions = tmp_path / "p.jsonl"
    _vlft("predict", "--adapter", run, "--data", val, "--output", predictions, "--max-new-tokens", "2", "--quiet")
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(lines) == 3 and all(isinstance(line["prediction"], str) for line in lines)
    scores = tmp_path / "e.json"
    _vlft("eval", "--adapter", run, "--data", val, "--output", scores, "--max-new-tokens", "2", "--quiet")
    result = json.loads(scores.read_text())
    assert result["samples"] == 3
    assert [e["prediction"] for e in result["scores"]["examples"]] == [line["prediction"] for line in lines]

    merged = tmp_path / "merged"
    _vlft("export", "--adapter", run, "--output", merged, "--dtype", "fp32")
    records = read_records(val)
    logits = export_logits(run, merged, records, attn="eager", backend="cpu", precision="fp32", param_dtype="fp32")
    assert (logits["exported"] - logits["adapted"]).abs().max() < 1e-4
    assert (logits["adapted"] - logits["base"]).abs().max() > 1e-2

    # the adapter folder loads with plain PEFT on the user's own checkpoint, giving the merged model's weights
    base = AutoModelForImageTextToText.from_pretrained(plain, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, run / "adapter").merge_and_unload()
    plain = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32)
    theirs = dict(plain.named_parameters())
    assert all(torch.allclose(p, theirs[n], atol=1e-6) for n, p in reloaded.named_parameters())


def test_a_second_model_type_is_read_and_planned(llava, mixed):
    """LLaVA (CLIP + Llama; a template with {% generation %} markers): the dry run names what it found."""
    code, output = cli_invoke("run", "--model", llava, "--data", mixed[0], "--dry-run", "--backend", "cpu")
    assert code == 0, output
    assert "generic (llava)" in output and "model.vision_tower" in output and "<image>" in output
    assert "{% generation %} markers" in output


def test_packed_and_padded_losses_are_equal_on_a_generic_checkpoint(plain, tmp_path):
    """check_family's packing check on the plain transformers checkpoint: the mixed records (text-only, one and
    two images, one and two turns) packed into one row on the segments attention give the loss they give padded,
    in float64 (each sample's first label ignored, so no label predicts across a boundary)."""
    from vlft.testing import FAMILY_CHECKS, check_family

    skip = {name: "another test's" for name in FAMILY_CHECKS if name != "packing"}
    report = check_family(str(plain), tmp_path, skip=skip)
    assert [c.status for c in report.checks if c.name == "packing"] == ["passed"], str(report)


def test_the_packing_probe_passes_a_text_model_that_keeps_samples_apart_and_stops_one_that_does_not(plain):
    """The start-up probe (two token runs, packed in one row against each alone) on real text models: the LLaVA
    checkpoint's Llama on vlft's per-sample attention gives what they give alone; LFM2's (a tiny one built from
    its config class, a short-convolution layer before the attention) carries state across the boundary, and
    the probe says so with the numbers; the checkpoint reader refuses it before any probe, naming the layer."""
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    from vlft.models.loading import load_model, model_config_and_family
    from vlft.models.segments import segments_name
    from vlft.policies import AttentionPolicy, PrecisionPolicy
    from vlft_models import generic_packing

    _, family = model_config_and_family(str(plain), installed())
    assert family.packing is not None and family.packing.probe is not None and not family.packing.refusal
    policy = AttentionPolicy("sdpa", segments_name("sdpa"))
    llava = load_model(str(plain), policy, PrecisionPolicy("fp32"), family=family).eval()
    with torch.no_grad():
        assert family.packing.probe(llava) == ""

    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = Lfm2VlConfig(
        text_config=dict(text, num_key_value_heads=1, layer_types=["conv", "full_attention"], vocab_size=64),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
    )
    config._attn_implementation = segments_name("sdpa")
    lfm2 = Lfm2VlForConditionalGeneration(config).eval()
    assert "decoder layers include conv" in generic_packing.packing(lfm2, "model.language_model.layers", {}).refusal
    with torch.no_grad():
        answer = generic_packing.probe("model.language_model", lfm2)
    assert "two token runs (7 and 5 tokens) packed in one row give hidden states" in answer, answer


def test_a_checkpoint_it_cannot_read_is_refused_naming_what_is_missing(plain, mixed, tmp_path):
    """No chat template, then no processor at all: refused before any step, naming the part."""
    bare = tmp_path / "no-template"
    shutil.copytree(plain, bare)
    for name in ("chat_template.jinja", "chat_template.json"):
        (bare / name).unlink(missing_ok=True)
    for name in ("processor_config.json", "tokenizer_config.json"):
        if (bare / name).exists():
            cfg = json.loads((bare / name).read_text())
            cfg.pop("chat_template", None)
            (bare / name).write_text(json.dumps(cfg))
    code, output = cli_invoke("run", "--model", bare, "--data", mixed[0], "--dry-run", "--backend", "cpu")
    assert code != 0 and "generic family cannot read this 'llava' checkpoint" in output
    assert "no chat template" in output and "Traceback" not in output

    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    shutil.copy(plain / "config.json", weights_only / "config.json")
    code, output = cli_invoke("run", "--model", weights_only, "--data", mixed[0], "--dry-run", "--backend", "cpu")
    assert code != 0 and "its processor does not load" in output and "Traceback" not in output


def test_vlft_plugins_lists_the_reader_after_the_families():
    readers = [r for answer in installed().hook.vlft_family_readers() for r in answer]
    assert [r.name for r in readers] == ["generic"]
    code, output = cli_invoke("plugins")
    assert code == 0 and "any other model_type: generic family, any model_type transformers maps" in output


def test_a_processor_that_disagrees_with_its_model_is_refused_before_step_1(plain, mixed, tmp_path):
    """The processor's patch size doubled (it writes a quarter of the <image> tokens the tower gives features
    for): refused before any step, naming both counts, not a traceback in the first forward with an image."""
    bad = tmp_path / "bad-processor"
    shutil.copytree(plain, bad)
    cfg = json.loads((bad / "processor_config.json").read_text())
    cfg["patch_size"] *= 2
    (bad / "processor_config.json").write_text(json.dumps(cfg))
    code, output = cli_invoke(
        "run", "--quiet", "--backend", "cpu", "--model", bad, "--data", mixed[0], "--output", tmp_path / "run",
        "--steps", "1", "--batch-size", "2",
    )  # fmt: skip
    assert code != 0 and "image tokens for a 64x64 image but its vision tower gives" in output, output
    assert "Traceback" not in output and not (tmp_path / "run" / "metrics.jsonl").exists()
