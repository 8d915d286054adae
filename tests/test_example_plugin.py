"""The example plugin package (examples/vlft-example-plugin): installed as a user would, and tested as its author would.

`make test` installs it (`pip install -e examples/vlft-example-plugin`). The tests that go through its
entry points skip, saying so, where it is not installed; the others import its modules from the source
folder and register them by hand, with the helpers of ``vlft.testing`` a plugin author uses.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from helpers import installed as installed_registry
from helpers import vlft_command
from vlft import ConfigError, RunConfig
from vlft import hookimpl as vlft_hookimpl
from vlft.testing import check_family, check_plugin, registry_with, run, tiny_run_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vlft-example-plugin"
ENTRY_POINTS = {
    "cpu-bf16": "vlft_example_plugin.backend",
    "loha": "vlft_example_plugin.loha",
    "gemma3": "vlft_example_plugin.gemma3",
}


def installed() -> bool:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vlft")}
    return all(eps.get(name) == value for name, value in ENTRY_POINTS.items())


needs_install = pytest.mark.skipif(
    not installed(),
    reason="vlft-example-plugin is not installed in this environment (make test installs it; "
    "or: pip install -e examples/vlft-example-plugin)",
)

try:
    from vlft_example_plugin import backend, gemma3, loha
except ImportError:  # not installed: the in-process tests use the source folder
    sys.path.insert(0, str(EXAMPLE))
    from vlft_example_plugin import backend, gemma3, loha


# -- as a user: through the entry points ------------------------------------------------------------------


@needs_install
def test_vlft_plugins_lists_the_example_backend_and_method():
    from vlft.cli import cli

    result = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)
    plugins = {p["name"]: p["status"] for p in listed["plugins"]}
    assert plugins.get("cpu-bf16") == "loaded" and plugins.get("loha") == "loaded", plugins
    backends = {b["name"]: b for b in listed["backends"]}
    assert backends["cpu-bf16"]["plugin"] == "cpu-bf16" and backends["cpu-bf16"]["available"]
    assert backends["cpu-bf16"]["fsdp"] is False and "not been tried with FSDP2" in backends["cpu-bf16"]["fsdp_reason"]
    assert {m["name"]: m["plugin"] for m in listed["methods"]}.get("loha") == "loha"
    # the plugin behind each model family: the example's entry point for gemma3, the built-ins' for the others
    families = {f["name"]: f["plugin"] for f in listed["model_families"]}
    assert families.get("gemma3") == "gemma3" and families.get("qwen2.5-vl") == "models", families
    text = CliRunner().invoke(cli, ["plugins"]).output
    assert any(line.strip().startswith("gemma3 ") and line.endswith("(plugin gemma3)") for line in text.splitlines()), (
        text
    )


@needs_install
def test_vlft_run_on_the_example_backend_and_method_saves_a_plain_peft_adapter(model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from vlft.cli import cli
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(tmp_path / "data", n_train=16, n_val=4)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        [
            "run",
            "--backend",
            "cpu-bf16",
            "--method",
            "loha",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--data",
            str(ds.train),
            "--val-data",
            str(ds.val),
            "--output",
            str(out),
            "--eval-samples",
            "2",
            "--max-new-tokens",
            "4",
            "--eval-every",
            "0",
            "--save-every",
            "0",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    # the example backend's answers, not the cpu reference's, shaped the run
    assert plan["precision"]["param_dtype"] == "bfloat16" and plan["precision"]["autocast_dtype"] == "bfloat16"
    assert (plan["attention"]["vision"], plan["attention"]["text"]) == ("sdpa", "sdpa")
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    # LoHa starts with w2_b at zero (no change to the model): any non-zero one shows the steps trained it
    assert any(t.abs().max() > 0 for k, t in saved.items() if "hada_w2_b" in k), sorted(saved)[:4]
    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    loaded = PeftModel.from_pretrained(base, str(out / "adapter"))
    assert loaded.peft_config["default"].peft_type.value == "LOHA"
    state = {k: v for k, v in loaded.state_dict().items() if "hada_" in k}
    assert len(state) == len(saved) > 0
    for key, tensor in saved.items():
        match = [v for k, v in state.items() if k.replace(".default", "").endswith(key.split("base_model.model.")[-1])]
        assert len(match) == 1 and torch.equal(match[0], tensor), key


@needs_install
def test_the_gemma3_family_trains_through_its_entry_point_and_saves_a_plain_peft_adapter(tmp_path):
    """`--model embedded:gemma3` found through the example package's entry point (the registry loads every
    installed plugin); a few steps with a falling loss; the adapter loads with plain PEFT on the tiny model."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from vlft.models.embedded import embedded_family_dir

    result = run(tiny_run_config(tmp_path, model="embedded:gemma3", steps=8, batch_size=4, lr=3e-3))
    plan = json.loads((result.output / "plan.json").read_text())
    assert plan["model_family"]["name"] == "gemma3", plan.get("model_family")
    # its processor writes the image tokens; its image_grids and tracer give the plan the vision tower (the
    # traced figure against a real step: tests/test_memory.py)
    assert not [n for n in plan["notes"] if "not traced" in n], plan["notes"]
    assert plan["memory"]["batch"]["image_patches"] > 0, plan["memory"]["batch"]
    losses = [m["loss"] for m in result.metrics if "loss" in m]
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    folder = embedded_family_dir(gemma3.FAMILY)  # the folder the run trained on (built once, cached)
    saved = load_file(str(result.output / "adapter" / "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(folder), str(result.output / "adapter")
    )
    assert loaded.peft_config["default"].peft_type.value == "LORA"
    state = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(state) == len(saved) > 0 and any("vision_tower" in k for k in saved)
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key


def test_gemma3_samples_are_encoded_as_its_own_processor_encodes_them(tmp_path):
    """processor_expands_placeholders: the encoder's input_ids and token_type_ids equal Gemma3Processor's on
    the whole rendered conversation; only the reply (to <end_of_turn>) is trained; the batch carries
    token_type_ids and no Qwen keys."""
    import dataclasses

    import torch

    from vlft import processor_image_inputs
    from vlft.data.batching import collator_for
    from vlft.data.demo import write_demo_dataset
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import IGNORE_INDEX, load_image, read_records
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.loading import load_processor

    family = gemma3.FAMILY
    processor = load_processor(embedded_family_dir(family), family, installed_registry())
    encoder = SampleEncoder(processor, family=family)
    records = read_records(write_demo_dataset(tmp_path / "data", n_train=2, n_val=1).train)
    rec = records[0]
    sample = encoder.encode(rec)
    full = encoder.render(rec.turns, add_generation_prompt=False)
    own = processor(text=[full], images=[[load_image(s) for s in rec.images]], return_tensors="pt")
    assert torch.equal(sample["input_ids"], own["input_ids"][0])
    assert (
        torch.equal(sample["token_type_ids"], own["token_type_ids"][0])
        and int(sample["token_type_ids"].sum()) == len(rec.images) * processor.image_seq_length
    )
    assert torch.equal(sample["pixel_values"], own["pixel_values"])
    trained = processor.tokenizer.decode(sample["input_ids"][sample["labels"] != IGNORE_INDEX])
    assert trained == rec.turns[-1].text + family.chat.reply_end_token, trained
    assert encoder.measure(rec)[0] == len(sample["input_ids"])
    # its processor writes no grid; the family's image_grids gives one per image: (1, s, s), s x s = its tokens
    side = math.isqrt(processor.image_seq_length)
    assert encoder.measure(rec)[1] == [(1, side, side)] * len(rec.images)
    # a family that gives ImageInputs.grid gets a grid per image, from the image's own size, for the memory plan
    gridded = dataclasses.replace(
        family,
        image_inputs=processor_image_inputs(
            dict(family.image_inputs.batch_inputs), grid=lambda h, w, cap: (1, h // 8, w // 8)
        ),
    )
    width, height = load_image(rec.images[0]).size
    assert SampleEncoder(processor, family=gridded).measure(rec)[1] == [(1, height // 8, width // 8)] * len(rec.images)
    batch = collator_for(processor, family)([encoder.encode(r) for r in records])
    assert set(batch) == {"input_ids", "attention_mask", "labels", "token_type_ids", "pixel_values"}
    assert batch["token_type_ids"].shape == batch["input_ids"].shape


@needs_install
def test_the_example_command_runs_from_the_vlft_console_script():
    done = subprocess.run(
        [*vlft_command(), "bf16-speed", "--size", "64", "--repeat", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bf16 is" in done.stdout and "the speed of fp32" in done.stdout


# -- as its author: each module registered by hand ----------------------------------------------------------


@pytest.mark.parametrize("module", [backend, loha, gemma3], ids=["backend", "loha", "gemma3"])
def test_the_example_modules_match_the_specs_and_answer_only_for_their_names(module):
    check_plugin(module)


def test_the_example_backend_ranks_below_the_cpu_reference():
    registry = registry_with(backend, entry_points=False)
    offered = {info.name: info for infos in registry.hook.vlft_backends() for info in infos}
    # `--backend auto` takes the highest priority: the example must never displace the reference
    assert offered["cpu-bf16"].priority < offered["cpu"].priority
    assert registry.owners[("backend", "cpu-bf16")] == backend.__name__


def test_the_example_backend_refuses_other_precisions_naming_the_cpu_backend():
    registry = registry_with(backend, entry_points=False)
    with pytest.raises(ConfigError, match=r"cpu-bf16 computes in bf16; for --precision fp16 use --backend cpu"):
        registry.first("vlft_precision_policy", backend="cpu-bf16", config=RunConfig(precision="fp16"))


def test_loha_options_are_checked_before_anything_loads():
    registry = registry_with(loha, entry_points=False)
    d = registry.first("vlft_adapter_defaults", method="loha", config=RunConfig(adapter={"r": 4}))
    assert d.hyperparameters["r"] == 4 and set(d.help) == set(d.hyperparameters)
    with pytest.raises(ConfigError, match=r"method loha: unknown option rank; valid: r, alpha"):
        registry.first("vlft_adapter_defaults", method="loha", config=RunConfig(adapter={"rank": 4}))
    with pytest.raises(ConfigError, match=r"option r expects int, got 4.5"):
        registry.first("vlft_adapter_defaults", method="loha", config=RunConfig(adapter={"r": 4.5}))


def test_a_dry_run_plans_the_example_method_on_the_example_backend(tmp_path):
    registry = registry_with(backend, loha, entry_points=False)
    result = run(tiny_run_config(tmp_path, backend="cpu-bf16", method="loha", dry_run=True), registry)
    plan = result.plan
    assert plan.precision.param_dtype == "bfloat16" and plan.method.name == "loha"
    assert plan.targets and all(
        n.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "qkv", "proj")) for n in plan.targets
    )
    assert result.output is None and not (tmp_path / "run").exists()  # a dry run writes nothing


def test_the_example_method_trains_on_the_cpu_reference_with_the_testing_helpers(tmp_path):
    registry = registry_with(loha, entry_points=False)  # loha, plus vlft's cpu backend to run it on
    result = run(tiny_run_config(tmp_path, backend="cpu", method="loha"), registry)
    assert [m["step"] for m in result.metrics] == [1, 2]
    assert result.plan.backend.info.name == "cpu" and result.plan.method.name == "loha"
    assert (result.output / "adapter" / "adapter_model.safetensors").is_file()


def test_the_example_registers_its_command():
    group = click.Group()
    registry_with(backend, entry_points=False).hook.vlft_register_commands(cli=group)
    result = CliRunner().invoke(group, ["bf16-speed", "--size", "32", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    assert "per 32x32 product" in result.output


def test_the_gemma3_family_passes_vlft_testing_check_family(tmp_path):
    """The family contract on its real tiny model, as the example's author tests it (registered by hand): every
    check passes but those for capabilities Gemma 3 lacks, each skipped with its reason; errors would name the
    plugin (here the module, as registry_with registers it)."""
    report = check_family("gemma3", tmp_path, registry=registry_with(gemma3, entry_points=False))
    assert report.family == f"family 'gemma3' (plugin {gemma3.__name__})"
    assert {c.name for c in report.of("passed")} == {"targets", "image_tokens", "adapter", "mixed_step"}, str(report)
    skipped = {c.name: c.detail for c in report.of("skipped")}
    assert skipped.keys() == {"positions", "packing"} and "refuses packing: its token_type_ids" in skipped["packing"]


class _OffByOne:
    """Gemma 3 with one image token too many written for each image: a family whose count drifted from its
    processor's."""

    __name__ = "vlft_off_by_one"

    @staticmethod
    def write(processor, texts, prepared):
        written = gemma3.FAMILY.image_inputs.write(processor, texts, prepared)
        token = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
        for ids in written.ids:
            if token in ids:
                ids.insert(ids.index(token), token)
        return written

    @vlft_hookimpl
    def vlft_model_families(self):
        from dataclasses import replace

        return [replace(gemma3.FAMILY, image_inputs=replace(gemma3.FAMILY.image_inputs, write=self.write))]


def test_check_family_names_the_plugin_and_what_differed_and_skips_only_with_a_reason(tmp_path):
    from vlft.testing import FamilyCheckError

    registry = registry_with(_OffByOne(), entry_points=False)
    why = "this test is about image tokens"
    with pytest.raises(FamilyCheckError) as failed:
        check_family("gemma3", tmp_path, registry=registry, skip={"adapter": why, "mixed_step": why})
    message = str(failed.value)
    assert message.startswith("family 'gemma3' (plugin vlft_off_by_one): 1 of 6 checks failed"), message
    assert "image_tokens: failed: train.jsonl:2: the family's image_inputs wrote 47 tokens, the processor 46" in message
    assert "<image_soft_token> per image: the family [5], the processor [4]" in message, message
    assert f"adapter: skipped: {why}" in message and "targets: passed" in message
    with pytest.raises(ValueError, match="skipping adapter needs a reason"):
        check_family("gemma3", tmp_path, registry=registry, skip={"adapter": ""})
    with pytest.raises(ValueError, match="no check called tokens"):
        check_family("gemma3", tmp_path, registry=registry, skip={"tokens": why})
