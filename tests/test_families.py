"""Model families wired into the core (issue 20): each family's tiny embedded model trains through `vlft run`,
its adapter loads with plain PEFT, a folder written by plain transformers trains, bundled configs plan offline,
and an unknown model_type names the installed families. Runs are shared (session fixtures) and short.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import installed
from test_run import read_metrics, short_config
from vlft import ConfigError

# The MoE families run on the CPU in fp32 through their load_kwargs (experts_implementation="eager": transformers'
# default torch._grouped_mm takes 16-bit weights only). Qwen3-VL MoE trains its fused experts too
# (target_experts=true, PEFT target_parameters); Qwen3.5 MoE keeps the default (attention only). Shorter runs.
FAMILY_RUNS = ["qwen3-vl", "qwen3.5", "qwen3-vl-moe", "qwen3.5-moe", "smolvlm", "llava-onevision", "glm4.1v", "gemma4"]
STEPS = {
    "qwen3-vl": 30,
    "qwen3.5": 30,
    "qwen3-vl-moe": 16,
    "qwen3.5-moe": 16,
    "smolvlm": 30,
    "llava-onevision": 30,
    "glm4.1v": 30,
    "gemma4": 30,
}
# the Qwen3 and GLM families: relative-1000; LLaVA's boxes are fractions of the image; SmolVLM has no grounding
# format; Gemma 4: absolute pixels of the resized image
BOXES = {"smolvlm": "absolute", "llava-onevision": "relative-1", "gemma4": "absolute"}
ADAPTER = {"qwen3-vl-moe": {"target_experts": True}}


@pytest.fixture(scope="session")
def family_runs(small_data, tmp_path_factory):
    """One LoRA run per family on the demo task (text attention + last vision blocks; experts where asked)."""
    from vlft.commands.run import execute
    from vlft.registry import load_registry

    runs = {}
    for name in FAMILY_RUNS:
        out = tmp_path_factory.mktemp(name.replace(".", "_")) / "run"
        execute(
            load_registry(),
            short_config(
                small_data,
                out,
                model=f"embedded:{name}",
                steps=STEPS[name],
                log_every=1,
                eval_every=0,
                save_every=0,
                eval_samples=2,
                max_new_tokens=4,
                adapter=ADAPTER.get(name, {}),
            ),
            progress=False,
        )
        runs[name] = out
    return runs


@pytest.mark.parametrize("name", FAMILY_RUNS)
def test_each_family_trains_with_falling_loss_and_its_plan_names_the_family(family_runs, name):
    out = family_runs[name]
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    assert len(losses) == STEPS[name]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first * 0.9, (name, first, last)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model_family"]["name"] == name
    assert plan["model_family"]["box_coordinates"] == BOXES.get(name, "relative-1000")


@pytest.mark.parametrize("name", FAMILY_RUNS)
def test_each_family_adapter_loads_with_plain_peft(family_runs, name):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = family_runs[name]
    base = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), str(out / "adapter"))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    if name in ADAPTER:  # expert LoRA: saved as PEFT target_parameters, and loaded onto the experts
        rel = plan["targets"]["experts"]["parameters"]
        assert saved["target_parameters"] and all(t.endswith(tuple(rel)) for t in saved["target_parameters"])
        assert {t.rsplit(".", 1)[1] for t in saved["target_parameters"]} == {r.rsplit(".", 1)[1] for r in rel}
        assert plan["targets"]["experts"]["adapted"] and plan["targets"]["experts"]["adapter_parameters"] > 0
        assert any(".experts." in n and "lora_A" in n for n, _ in model.named_parameters())
    else:
        assert not saved.get("target_parameters")
        assert plan["targets"]["experts"] is None or plan["targets"]["experts"]["adapted"] is False


def test_a_qwen3_vl_folder_written_by_plain_transformers_trains_and_peft_loads_it_without_vlft(small_data, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlft.commands.run import execute
    from vlft.models.loading import resolve_model_path
    from vlft.registry import load_registry

    tiny = resolve_model_path("embedded:qwen3-vl", installed())
    folder = tmp_path / "qwen3-vl-plain"
    AutoModelForImageTextToText.from_pretrained(tiny).save_pretrained(folder)
    AutoProcessor.from_pretrained(tiny).save_pretrained(folder)
    out = tmp_path / "run"
    execute(
        load_registry(),
        short_config(
            small_data, out, model=str(folder), steps=4, eval_every=0, save_every=0, eval_samples=2, max_new_tokens=4
        ),
        progress=False,
    )
    script = (
        "import sys\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForImageTextToText\n"
        f"m = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained({str(folder)!r}), "
        f"{str(out / 'adapter')!r})\n"
        "assert 'vlft' not in sys.modules and not any(k.startswith('vlft') for k in sys.modules)\n"
        "print(type(m.get_base_model()).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Qwen3VLForConditionalGeneration" in done.stdout


def _dry_run(**values):
    """What `vlft run ... --dry-run` prints, as data (plan_run is what --dry-run stops after)."""
    from vlft.config import build_config
    from vlft.planning.preflight import plan_run
    from vlft.registry import load_registry

    return json.loads(json.dumps(plan_run(load_registry(), build_config({}, values)).describe(), default=str))


def test_bundled_qwen3_vl_8b_plans_offline_with_its_published_parameter_count():
    plan = _dry_run(model="qwen3-vl-8b", backend="cuda", device_memory="24GiB")
    fam = plan["model_family"]
    assert fam["name"] == "qwen3-vl"
    assert fam["parameters"]["total"] == 8_767_123_696  # configs/published.json: the safetensors' tensor sum
    assert plan["memory"] is not None


def test_bundled_moe_config_counts_its_experts_and_what_expert_lora_costs():
    plan = _dry_run(
        model="qwen3-vl-30b-a3b", backend="cuda", device_memory="80GiB", adapter={"target_experts": True, "r": 16}
    )
    counts = plan["model_family"]["parameters"]
    assert counts["total"] == 31_070_754_032
    # 48 layers x 128 experts x (2048x1536 + 768x2048)
    assert counts["experts"] == 48 * 128 * (2 * 768 * 2048 + 2048 * 768)
    # PEFT's fused-expert LoRA: lora_A [r*E, in], lora_B [out, r*E] per parameter per layer (NOTES.md: ~629 M)
    per_layer = 16 * 128 * ((2048 + 2 * 768) + (768 + 2048))
    experts = plan["targets"]["experts"]
    assert experts["adapted"] and experts["layers"] == 48 and experts["adapter_parameters"] == 48 * per_layer
    assert experts["routers"] == ["mlp.gate"] and plan["method"]["hyperparameters"]["lora_dropout"] == 0.0
    # the memory plan trains (and keeps AdamW state for) the expert adapters too
    assert plan["memory"]["adapter_parameters"] == plan["targets"]["adapter_parameters"] > 48 * per_layer


def test_expert_lora_on_the_tiny_moe_trains_the_experts_and_never_the_router(small_data, tmp_path):
    from vlft.models.families import frozen_router_parameters
    from vlft.models.loading import load_model
    from vlft.planning.preflight import plan_run
    from vlft.registry import load_registry

    registry = load_registry()
    config = short_config(
        small_data, tmp_path / "run", model="embedded:qwen3-vl-moe", adapter={"target_experts": True, "r": 4}
    )
    plan = plan_run(registry, config)
    assert plan.target_parameters and all(p.endswith(plan.family.experts.parameters) for p in plan.target_parameters)
    model = load_model(plan.model_path, plan.attention, plan.precision, family=plan.family)
    assert model.get_experts_implementation()["text_config"] == "eager"  # fp32 on the CPU: the family's rule
    model = registry.first(
        "vlft_apply_adapter",
        method="lora",
        model=model,
        targets=plan.targets,
        config=config,
        target_parameters=plan.target_parameters,
        family=plan.family,
    )
    with torch.no_grad():  # B starts at zero; give it values so A's gradient is not zero by construction
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    ids = torch.randint(0, 100, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    routers = set(frozen_router_parameters(model, plan.family))
    assert routers
    params = dict(model.get_base_model().named_parameters())
    assert all(not params[n].requires_grad and params[n].grad is None for n in routers)
    expert_grads = {n: p.grad for n, p in model.named_parameters() if ".experts." in n and "lora_" in n}
    assert len(expert_grads) == 4 * len(plan.target_parameters) // 2  # A and B per fused parameter
    assert all(g is not None and g.abs().sum() > 0 for g in expert_grads.values())


def test_an_unknown_model_type_names_the_installed_families_and_how_to_add_one(tmp_path):
    """A model type no family owns and no reader takes (the generic family reads image-text-to-text types only)."""
    from vlft.models.loading import load_model_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError) as e:
        load_model_config(str(tmp_path), installed())
    text = str(e.value)
    assert "'bert'" in text and "qwen3-vl" in text and "qwen2.5-vl" in text and "vlft_model_families" in text
    assert "no family reader takes it (generic: any model_type" in text


def test_multi_turn_qwen3_5_records_split_at_each_reply():
    """The thinking template renders earlier replies without their think block: the render-once split."""
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import Turn
    from vlft.models.loading import (
        load_processor,
        model_config_and_family,
        resolve_model_path,
    )

    path = resolve_model_path("embedded:qwen3.5", installed())
    _, family = model_config_and_family(path, installed())
    enc = SampleEncoder(load_processor(path, family, installed()), family=family)
    turns = [
        Turn("user", "What colour is the product?"),
        Turn("assistant", "red"),
        Turn("user", "What defect does the product have?"),
        Turn("assistant", "a scratch"),
    ]
    trained = [text for text, t in enc.pieces(turns) if t]
    assert len(trained) == 2
    assert trained[0].startswith("red") and trained[0].endswith(family.chat.reply_end_token)
    assert "a scratch" in trained[1] and trained[1].endswith(family.chat.reply_end_token)


def test_every_bundled_config_counts_within_one_percent_of_its_published_count_through_the_wired_path():
    """What `vlft run --model NAME --dry-run` counts (the registry's bundled configs, the family the hook
    answers, the plan's meta copy with the family's load arguments, count_parameters) against
    plugins/models/configs/published.json, for every bundled config the installed plugins offer."""
    from vlft.models.bundled import bundled_names
    from vlft.models.families import count_parameters, family_load_kwargs
    from vlft.models.loading import model_config_and_family, resolve_model_path
    from vlft.planning import trace
    from vlft.policies import AttentionPolicy
    from vlft.registry import load_registry
    from vlft_models import CONFIGS, qwen3_5

    registry = load_registry()
    published = {k: v for k, v in json.loads((CONFIGS / "published.json").read_text()).items() if not k.startswith("_")}
    names = sorted(bundled_names(registry))
    assert set(names) == set(published), "every bundled config needs a published count"
    off = {}
    for name in names:
        config, family = model_config_and_family(resolve_model_path(name, registry), registry)
        model = trace.skeleton(
            config, AttentionPolicy("sdpa", "sdpa"), torch.bfloat16, family_load_kwargs(family, "bfloat16")
        ).requires_grad_(False)  # as adapted: frozen
        counted = count_parameters(model, family)["total"]
        if published[name]["includes_mtp"]:  # the checkpoints carry mtp.* weights transformers drops on load
            counted += qwen3_5.mtp_parameters(model)
        want = published[name]["params"]
        if abs(counted - want) / want >= 0.01 or (published[name]["exact"] and counted != want):
            off[name] = (counted, want)
    assert off == {}, off


@pytest.mark.slow  # four worker processes (two probes, two runs): about a minute on 2 shared cores
def test_vlft_parity_cpu_cpu_passes_on_the_qwen3_vl_embedded_model(tmp_path):
    """The real command, its worker processes and all: two seeded runs of the family's tiny model agree."""
    from click.testing import CliRunner

    from vlft.cli import cli

    out = tmp_path / "parity.json"
    result = CliRunner().invoke(
        cli,
        [
            "parity",
            "--backends",
            "cpu,cpu",
            "--model",
            "embedded:qwen3-vl",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--output",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["comparison"]) == 1
    adapted = set(report["runs"][0]["steps"][0]["weights"])
    assert any("self_attn.q_proj" in n for n in adapted) and any(".visual.blocks." in n for n in adapted)
    assert not any("deepstack" in n for n in adapted)
