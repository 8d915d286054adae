"""``vlft run --dry-run`` for backends this machine lacks, ``vlft run`` refusing them, and ``vlft doctor``.

The CLI runs in-process (click's CliRunner), so torch_npu is forced absent
through ``sys.modules`` and ``torch.cuda`` is patched to STAND IN for a GPU
where a test fixes the GPU's compute capability.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner

from vlft.cli import cli


@pytest.fixture
def clean(monkeypatch):
    """No torch_npu, no transfer_to_npu, no flash-attn, no HCCL or visibility variables: the same on every machine."""
    for name in ("torch_npu", "torch_npu.contrib.transfer_to_npu", "flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)
    for key in (
        "HCCL_CONNECT_TIMEOUT",
        "HCCL_EXEC_TIMEOUT",
        "HCCL_OP_TIMEOUT",
        "HCCL_DETERMINISTIC",
        "CUDA_VISIBLE_DEVICES",
        "ASCEND_RT_VISIBLE_DEVICES",
    ):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def stand_in_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    if not torch.version.cuda:
        monkeypatch.setattr(torch.version, "cuda", "12.8")


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def dry_run_json(*args) -> dict:
    result = invoke("run", *args, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_ascend_dry_run_on_a_machine_without_an_npu(clean, model_dir):
    plan = dry_run_json("--backend", "ascend", "--method", "oft")
    b = plan["backend"]
    assert (b["name"], b["device_type"], b["available"]) == ("ascend", "npu", False)
    assert b["reason"].startswith("torch_npu is not installed") and b["chosen_because"] == "asked for by name"
    a = plan["attention"]
    assert (a["vision"], a["text"]) == ("eager", "eager")
    p = plan["precision"]
    assert (p["name"], p["param_dtype"], p["autocast_dtype"]) == ("fp16", "float16", "float16")
    assert (p["loss_scaling"], p["init_scale"], p["growth_interval"]) == (True, 65536.0, 2000)
    assert plan["dataloader"]["pin_memory"] is False
    d = plan["distributed"]
    assert d["process_group_backend"] == "hccl"
    assert d["env"] == {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1800"}
    m = plan["method"]
    assert m["name"] == "oft" and m["lr"] > 0 and m["hyperparameters"]
    t = plan["targets"]
    vision = [name for name in t["modules"] if ".visual.blocks." in name]
    assert vision and t["towers"] == "both" and len(t["vision_blocks"]) == min(6, t["vision_depth"])
    assert {int(name.split(".blocks.")[1].split(".")[0]) for name in vision} == set(t["vision_blocks"])
    assert all(count and count > 0 for count in t["modules"].values())
    assert t["adapter_parameters"] == sum(t["modules"].values())


def test_ascend_dry_run_human_readable(clean, model_dir):
    result = invoke("run", "--backend", "ascend", "--method", "oft", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "backend      ascend (device type npu): UNAVAILABLE here (torch_npu is not installed" in out
    assert "attention    vision=eager text=eager" in out
    assert "precision    fp16: params float16, autocast float16, dynamic loss scaling (initial scale 65536" in out
    assert "dataloader   pin_memory=False" in out
    assert "distributed  hccl" in out and "HCCL_CONNECT_TIMEOUT=1200" in out and "HCCL_EXEC_TIMEOUT=1800" in out
    assert "             vision blocks 2-7: qkv, proj (12 modules, " in out  # grouped (--verbose lists each)


def test_ascend_dry_run_honours_the_users_settings(clean, model_dir, monkeypatch):
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "3600")
    plan = dry_run_json("--backend", "ascend", "--attn", "vision=eager,text=sdpa", "--deterministic")
    assert (plan["attention"]["vision"], plan["attention"]["text"]) == ("eager", "sdpa")
    assert plan["distributed"]["env"]["HCCL_CONNECT_TIMEOUT"] == "3600"
    assert plan["distributed"]["env"]["HCCL_DETERMINISTIC"] == "true"


@pytest.mark.parametrize(
    "capability, name, autocast, scaling",
    [
        ((8, 6), "bf16", "bfloat16", False),
        ((7, 5), "fp16", "float16", True),
    ],
)
def test_cuda_dry_run(capability, name, autocast, scaling, clean, model_dir, monkeypatch):
    stand_in_gpu(monkeypatch, capability)
    plan = dry_run_json("--backend", "cuda", "--method", "lora")
    b = plan["backend"]
    assert (b["name"], b["device_type"], b["available"], b["device_count"]) == ("cuda", "cuda", True, 1)
    assert f"compute capability {capability[0]}.{capability[1]}" in b["versions"]["gpu"]
    p = plan["precision"]
    assert (p["name"], p["autocast_dtype"], p["loss_scaling"]) == (name, autocast, scaling)
    if scaling:
        assert p["init_scale"] == 65536.0
    a = plan["attention"]
    assert (a["vision"], a["text"]) == ("sdpa", "sdpa") and "flash-attn" in a["reason"]
    dl = plan["dataloader"]
    assert dl["pin_memory"] is True and dl["num_workers"] == 2
    assert plan["distributed"]["process_group_backend"] == "nccl" and plan["distributed"]["env"] == {}
    assert plan["method"]["name"] == "lora" and any(".visual.blocks." in m for m in plan["targets"]["modules"])


def test_cuda_dry_run_without_a_gpu_is_marked_unavailable(clean, model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = dry_run_json("--backend", "cuda")
    assert plan["backend"]["available"] is False and "sees no GPU" in plan["backend"]["reason"]
    assert plan["precision"]["name"] == "bf16" and "assumed" in plan["precision"]["reason"]


def test_run_on_an_unavailable_backend_stops_at_once(clean, model_dir, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--backend", "ascend", "--output", str(out)])
    assert result.exit_code == 1
    assert "backend 'ascend' is not available here: torch_npu is not installed" in result.output
    assert "vlft doctor --backend ascend" in result.output
    assert not out.exists()


# -- vlft doctor -------------------------------------------------------------------------------


def test_doctor_explains_the_missing_backends_and_passes_on_cpu(clean, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("doctor", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["chosen"] == "cpu" and report["usable"] is True
    sections = {s["name"]: s for s in report["backends"]}
    assert list(sections)[:2] == ["ascend", "cuda"]  # highest priority first
    assert not sections["ascend"]["available"] and "torch_npu is not installed" in sections["ascend"]["reason"]
    assert not sections["cuda"]["available"] and "sees no GPU" in sections["cuda"]["reason"]
    failing = {c["name"]: c for c in sections["ascend"]["checks"] if not c["ok"]}
    assert "vlft[ascend]" in failing["torch_npu"]["fix"]
    assert {c["name"] for c in report["common"]} >= {"python", "torch", "transformers", "peft"}


def test_doctor_for_an_unavailable_backend_fails_with_the_reason(clean, monkeypatch):
    monkeypatch.setenv("HCCL_OP_TIMEOUT", "900")
    result = invoke("doctor", "--backend", "ascend")
    assert result.exit_code == 1
    assert "backend ascend is NOT usable here: torch_npu is not installed" in result.stdout
    assert "HCCL_OP_TIMEOUT" in result.stdout and "use HCCL_EXEC_TIMEOUT" in result.stdout
    assert "cuda (device type" not in result.stdout  # only the backend asked for


def test_doctor_passes_for_a_stand_in_gpu(clean, monkeypatch):
    stand_in_gpu(monkeypatch, (9, 0))
    result = invoke("doctor", "--backend", "cuda", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["usable"] and report["chosen"] == "cuda"


def test_doctor_rejects_an_unknown_backend():
    result = invoke("doctor", "--backend", "tpu")
    assert result.exit_code == 1 and "unknown backend 'tpu'" in result.output


# -- the adapted modules at a glance ---------------------------------------------------------------


def test_the_plan_groups_adapted_modules_per_tower_and_layer_range_and_verbose_lists_each(model_dir):
    plan = dry_run_json("--backend", "cpu")
    modules = plan["targets"]["modules"]
    assert len(modules) == 20  # the JSON keeps every module and its parameters
    text = invoke("run", "--backend", "cpu", "--dry-run").output
    block = text[text.index("\ntargets ") : text.index("\nweights ")].splitlines()[1:]
    assert "vision blocks 2-7 of 8" in text
    vision = sum(n for name, n in modules.items() if ".blocks." in name)
    lm = sum(n for name, n in modules.items() if ".layers." in name)
    assert [line.strip() for line in block[1:]] == [
        f"vision blocks 2-7: qkv, proj (12 modules, {vision / 1e3:.1f} K)",
        f"text layers 0-1: q_proj, k_proj, v_proj, o_proj (8 modules, {lm / 1e3:.1f} K)",
    ]
    verbose = invoke("run", "--backend", "cpu", "--dry-run", "--verbose").output
    listed = [line.split()[0] for line in verbose.splitlines() if line.strip().endswith("params)")]
    assert listed == list(modules)


def test_grouping_reads_layers_from_any_dotted_names_and_towers_from_the_summary():
    from vlft.planning.plan import group_modules

    # another family's names: no `visual`, no `language_model`; the text stack listed first
    modules = {f"dec.h.{i}.attn.{k}": 1000 for i in range(4) for k in ("c_attn", "c_proj")}
    modules |= {f"enc.stages.{i}.mix.{k}": 2_000_000 for i in (5, 6, 9) for k in ("qkv",)}
    modules |= {"dec.h.4.attn.c_attn": 1000, "head": 7}
    lines = group_modules(modules, {"towers": "both", "vision_blocks": [5, 6, 9]})
    assert lines == [
        "text h 0-3: c_attn, c_proj (8 modules, 8.0 K)",
        "text h 4: c_attn (1 module, 1.0 K)",  # other modules than the layers before: a line of its own
        "vision stages 5-6: qkv (2 modules, 4.0 M)",
        "vision stages 9: qkv (1 module, 2.0 M)",  # not consecutive
        "head (1 module, 7)",
    ]
    assert group_modules({"m.layers.0.a.q": 5, "m.layers.0.b.q": 5}, {"towers": "text"}) == [
        "text layers 0: a.q, b.q (2 modules, 10)"
    ]  # leaves that clash: the path after the layer
