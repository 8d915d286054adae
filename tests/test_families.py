"""Model families wired into the core (issue 20): each family's tiny embedded model trains through `vlft run`,
its adapter loads with plain PEFT, a folder written by plain transformers trains, bundled configs plan offline,
and an unknown model_type names the installed families. Runs are shared (session fixtures) and short.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_run import read_metrics, short_config

from vlft import ConfigError

# qwen3-vl-moe is not here yet: transformers 5.24 runs its fused experts with torch._grouped_mm, which on the
# CPU refuses fp32 ("Expected mat_a to be BFloat16"); the family needs experts_implementation="eager" there.
FAMILY_RUNS = ["qwen3-vl", "qwen3.5"]


@pytest.fixture(scope="session")
def family_runs(small_data, tmp_path_factory):
    """One 30-step LoRA run per family on the demo task (text attention + last vision blocks)."""
    from vlft.commands.run import execute
    from vlft.registry import load_registry

    runs = {}
    for name in FAMILY_RUNS:
        out = tmp_path_factory.mktemp(name.replace(".", "_")) / "run"
        execute(load_registry(), short_config(small_data, out, model=f"embedded:{name}", steps=30, log_every=1,
                                              eval_every=0, save_every=0, eval_samples=2, max_new_tokens=4),
                progress=False)
        runs[name] = out
    return runs


@pytest.mark.parametrize("name", FAMILY_RUNS)
def test_each_family_trains_with_falling_loss_and_its_plan_names_the_family(family_runs, name):
    out = family_runs[name]
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first * 0.9, (name, first, last)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model_family"]["name"] == name and plan["model_family"]["box_coordinates"] == "relative-1000"


@pytest.mark.parametrize("name", FAMILY_RUNS)
def test_each_family_adapter_loads_with_plain_peft(family_runs, name):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = family_runs[name]
    base = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), str(out / "adapter"))
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_a_qwen3_vl_folder_written_by_plain_transformers_trains_and_peft_loads_it_without_vlft(
        small_data, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlft.commands.run import execute
    from vlft.models.loading import resolve_model_path
    from vlft.registry import load_registry

    tiny = resolve_model_path("embedded:qwen3-vl")
    folder = tmp_path / "qwen3-vl-plain"
    AutoModelForImageTextToText.from_pretrained(tiny).save_pretrained(folder)
    AutoProcessor.from_pretrained(tiny).save_pretrained(folder)
    out = tmp_path / "run"
    execute(load_registry(), short_config(small_data, out, model=str(folder), steps=4, eval_every=0, save_every=0,
                                          eval_samples=2, max_new_tokens=4), progress=False)
    script = (
        "import sys\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForImageTextToText\n"
        f"m = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained({str(folder)!r}), "
        f"{str(out / 'adapter')!r})\n"
        "assert 'vlft' not in sys.modules and not any(k.startswith('vlft') for k in sys.modules)\n"
        "print(type(m.get_base_model()).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Qwen3VLForConditionalGeneration" in done.stdout


def test_export_merges_a_qwen3_vl_adapter(family_runs, tmp_path):
    from click.testing import CliRunner

    from vlft.cli import cli

    result = CliRunner().invoke(cli, ["export", "--adapter", str(family_runs["qwen3-vl"]), "--output",
                                      str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "merged" / "config.json").is_file()
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "qwen3_vl"


def _dry_run(**values):
    """What `vlft run ... --dry-run` prints, as data (plan_run is what --dry-run stops after)."""
    from vlft.config import build_config
    from vlft.planning.preflight import plan_run
    from vlft.registry import load_registry

    return json.loads(json.dumps(plan_run(load_registry(), build_config({}, values)).plan.describe(), default=str))


def test_bundled_qwen3_vl_8b_plans_offline_with_its_published_parameter_count():
    plan = _dry_run(model="qwen3-vl-8b", backend="cuda", device_memory="24GiB")
    fam = plan["model_family"]
    assert fam["name"] == "qwen3-vl"
    assert fam["parameters"]["total"] == 8_767_123_696  # configs/published.json: the safetensors' tensor sum
    assert plan["memory"] is not None


def test_bundled_moe_config_counts_its_experts():
    plan = _dry_run(model="qwen3-vl-30b-a3b", backend="cuda", device_memory="80GiB")
    counts = plan["model_family"]["parameters"]
    assert counts["total"] == 31_070_754_032
    # 48 layers x 128 experts x (2048x1536 + 768x2048)
    assert counts["experts"] == 48 * 128 * (2 * 768 * 2048 + 2048 * 768)


def test_an_unknown_model_type_names_the_installed_families_and_how_to_add_one(tmp_path):
    from vlft.models.loading import load_model_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ConfigError) as e:
        load_model_config(str(tmp_path))
    text = str(e.value)
    assert "'llava'" in text and "qwen3-vl" in text and "qwen2.5-vl" in text and "vlft_model_family" in text


def test_multi_turn_qwen3_5_records_split_at_each_reply():
    """The thinking template renders earlier replies without their think block: the render-once split."""
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import Turn
    from vlft.models.loading import load_processor, model_config_and_family, resolve_model_path

    path = resolve_model_path("embedded:qwen3.5")
    _, family = model_config_and_family(path)
    enc = SampleEncoder(load_processor(path, family), family=family)
    turns = [Turn("user", "What colour is the product?"), Turn("assistant", "red"),
             Turn("user", "What defect does the product have?"), Turn("assistant", "a scratch")]
    trained = [text for text, t in enc.pieces(turns) if t]
    assert len(trained) == 2
    assert trained[0].startswith("red") and trained[0].endswith(family.reply_end_token)
    assert "a scratch" in trained[1] and trained[1].endswith(family.reply_end_token)
