"""Real checkpoints on real cards: half-precision base weights, activation checkpointing, sample lengths,
the memory plan and the bundled configs of models that are not on this disk."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from helpers import cli_invoke, embedded_family, installed, run_flags
from vlft.cli import cli
from vlft.config import build_config


def _values(small_data, out, **over) -> dict:
    train, val = small_data
    values = dict(
        backend="cpu",
        method="lora",
        data=str(train),
        val_data=str(val),
        output=str(out),
        steps=5,
        batch_size=4,
        log_every=1,
        eval_every=0,
        eval_samples=2,
        max_new_tokens=4,
        save_every=0,
        seed=1,
        warmup_ratio=0.0,
        lr=2e-3,
    )
    values.update(over)
    return values


def _cfg(small_data, out, **over):
    return build_config({}, _values(small_data, out, **over))


def _steps(registry, config, n):
    """``n`` optimizer steps through vlft's own set-up and step; (losses, grad norms, model)."""
    from vlft.training.trainer import build_trainer

    s = build_trainer(registry, config)
    s.model.train()
    losses, norms = [], []
    for group in s.batches():
        out = s.train_step(group)
        losses.append(out.loss)
        norms.append(float(out.grad_norm))
        if len(losses) == n:
            break
    return losses, norms, s


# -- parameter dtype -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def bf16_run(small_data, tmp_path_factory):
    from vlft.commands.run import execute
    from vlft.registry import load_registry

    out = tmp_path_factory.mktemp("bf16") / "run"
    return execute(load_registry(), _cfg(small_data, out, param_dtype="bf16", steps=6), progress=False)


def test_bf16_base_weights_train_and_the_saved_adapter_is_fp32(bf16_run):
    from safetensors.torch import load_file

    plan = bf16_run.plan
    assert (plan.precision.param_dtype, plan.precision.autocast_dtype) == ("bfloat16", "bfloat16")
    losses = [m["loss"] for m in bf16_run.metrics]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[3:]) < sum(losses[:3]), losses
    saved = load_file(str(bf16_run.output / "adapter" / "adapter_model.safetensors"))
    assert saved and {t.dtype for t in saved.values()} == {torch.float32}
    summary = json.loads((bf16_run.output / "summary.json").read_text())
    assert summary["param_dtype"] == "bfloat16"


def test_half_base_weights_on_the_model_and_fp32_trainable_weights(registry, small_data, tmp_path):
    """fp16 weights with a loss scaler: the frozen base is fp16, every trainable weight fp32 (else unscale_ fails)."""
    _, _, s = _steps(registry, _cfg(small_data, tmp_path / "r", param_dtype="fp16"), 2)
    frozen = {p.dtype for p in s.model.parameters() if not p.requires_grad}
    trainable = {p.dtype for p in s.model.parameters() if p.requires_grad}
    assert frozen == {torch.float16} and trainable == {torch.float32}
    assert s.policy.scaler is not None


def test_a_half_weight_dtype_under_another_compute_dtype_is_refused(registry, small_data, tmp_path):
    from vlft.commands.run import execute
    from vlft.errors import ConfigError

    with pytest.raises(ConfigError, match="--param-dtype fp16 needs fp16 compute"):
        execute(registry, _cfg(small_data, tmp_path / "r", param_dtype="fp16", precision="bf16"))
    assert not (tmp_path / "r").exists()


# -- activation checkpointing ----------------------------------------------------------------------


def test_checkpointing_gives_every_trainable_parameter_a_gradient_and_the_same_steps(registry, small_data, tmp_path):
    on = _steps(registry, _cfg(small_data, tmp_path / "on", grad_checkpointing="on"), 5)
    model = on[2].model
    assert on[2].plan.checkpointing
    base = model.get_base_model()
    assert any(getattr(m, "gradient_checkpointing", False) for m in base.model.visual.blocks)
    assert all(getattr(m, "gradient_checkpointing", False) for m in base.model.language_model.layers)
    # one more forward/backward to look at gradients (the step above zeroed them)
    from vlft.data.batching import model_inputs
    from vlft.models.loss import token_loss_sum

    batch = next(iter(torch.utils.data.DataLoader(on[2].dataset, batch_size=4, collate_fn=on[2].collate)))
    token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"]).backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any(".visual." in n for n in trainable)
    missing = [n for n, p in trainable.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing[:5]

    off = _steps(registry, _cfg(small_data, tmp_path / "off", grad_checkpointing="off"), 5)
    assert not off[2].plan.checkpointing
    for a, b in zip(on[0], off[0]):
        assert a == pytest.approx(b, rel=1e-6)
    for a, b in zip(on[1], off[1]):
        assert a == pytest.approx(b, rel=1e-6)


def test_a_frozen_vision_tower_builds_no_autograd_graph(registry, small_data, tmp_path):
    _, _, s = _steps(registry, _cfg(small_data, tmp_path / "t", targets="text", grad_checkpointing="on"), 1)
    seen = []
    visual = s.model.get_base_model().model.visual
    handle = visual.register_forward_hook(lambda m, i, o: seen.append(o.pooler_output.requires_grad))
    from vlft.data.batching import model_inputs

    batch = next(iter(torch.utils.data.DataLoader(s.dataset, batch_size=2, collate_fn=s.collate)))
    s.model.train()
    s.model(**model_inputs(batch))
    handle.remove()
    assert seen == [False]


# -- sample lengths ---------------------------------------------------------------------------------


def test_measured_length_equals_the_encoded_length(processor, small_data):
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records

    encoder = SampleEncoder(processor, embedded_family(), max_pixels=56 * 56)
    for rec in read_records(small_data[0])[:8]:
        n, grids = encoder.measure(rec)
        enc = encoder.encode(rec)
        assert n == len(enc["input_ids"])
        assert [list(g) for g in grids] == enc["image_grid_thw"].tolist()


def test_too_long_samples_stop_the_run_with_their_lines_and_write_nothing(small_data, tmp_path):
    code, msg = cli_invoke("run", *run_flags(_values(small_data, tmp_path / "r", max_length=40)))
    assert code != 0
    assert "longer than --max-length 40" in msg and "train.jsonl:1: " in msg and "tokens" in msg
    assert "--skip-too-long" in msg
    assert not (tmp_path / "r").exists()


def test_skipped_samples_are_counted_and_listed(small_data, tmp_path, processor):
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records

    encoder = SampleEncoder(processor, embedded_family())
    lengths = sorted(encoder.measure(r)[0] for r in read_records(small_data[0]))
    limit = lengths[len(lengths) // 2]
    over = sum(n > limit for n in lengths)
    assert 0 < over < len(lengths)
    result, plan = dry_json(*run_flags(_values(small_data, tmp_path / "r", max_length=limit, skip_too_long=True)))
    assert result.exit_code == 0, result.output
    assert plan["lengths"]["skipped"] >= over  # validation samples over the limit are listed too
    assert all(s["length"] > limit and ".jsonl:" in s["where"] for s in plan["lengths"]["skipped_samples"])
    assert plan["lengths"]["longest"] <= limit


# -- the memory plan --------------------------------------------------------------------------------


def test_traced_activations_equal_what_a_real_step_saves(registry, small_data, tmp_path):
    """The meta-device trace counts exactly the tensors autograd saves on the CPU (fp32, eager)."""
    from vlft.data.batching import model_inputs
    from vlft.measure import SavedTensorMeter
    from vlft.models.loss import token_loss_sum
    from vlft.planning.memory import MemoryBasis, plan_memory
    from vlft.planning.preflight import plan_run, plan_targets
    from vlft.planning.trace import BatchShape, skeleton

    config = _cfg(small_data, tmp_path / "r")
    plan = plan_run(registry, config)
    with pytest.raises(dataclasses.FrozenInstanceError):  # the plan is not changed after planning
        plan.notes = ()
    _, _, s = _steps(registry, config, 1)
    batch = next(iter(torch.utils.data.DataLoader(s.dataset, batch_size=4, collate_fn=s.collate)))
    shape = BatchShape(4, batch["input_ids"].shape[1], [tuple(g) for g in batch["image_grid_thw"].tolist()])
    sk, _ = plan_targets(registry, plan, skeleton(plan.model_config, plan.attention, torch.float32))
    estimate = plan_memory(MemoryBasis(sk, plan.model_config, "float32", None, plan.family), shape)
    meter = SavedTensorMeter(s.model)
    s.model.train()
    with meter.hooks():
        token_loss_sum(s.model(**model_inputs(batch)).logits, batch["labels"])
    assert estimate.activations.full == pytest.approx(meter.bytes, rel=0.02)
    assert estimate.adapter_parameters == sum(p.numel() for p in s.model.parameters() if p.requires_grad)
    # backward's working space: at least the gradient of eager attention's [B, heads, T, T] probabilities
    heads = plan.model_config.text_config.num_attention_heads
    probabilities = shape.samples * heads * shape.tokens**2 * 4
    assert probabilities <= estimate.activations.backward_transient < estimate.activations.full / 2
    assert estimate.total_bytes() == (
        estimate.counted_bytes() + estimate.activations.backward_transient + estimate.logits_bytes
    )


def dry_json(*args):
    result = CliRunner().invoke(cli, ["run", "--dry-run", "--json", *args])
    return result, (
        json.loads(result.stdout[result.stdout.index("{") : result.stdout.rindex("}") + 1])
        if "{" in result.stdout
        else None
    )


@pytest.mark.parametrize("backend, dtype", [("cuda", "bfloat16"), ("ascend", "float16")])
def test_a_7b_plan_for_a_24gib_card_offline(backend, dtype, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    result, plan = dry_json(
        "--model", "qwen2.5-vl-7b", "--backend", backend, "--device-memory", "24GiB", "--max-length", "512"
    )
    assert result.exit_code == 0, result.output
    assert plan["param_dtype"]["dtype"] == dtype and plan["param_dtype"]["trainable"] == "float32"
    mem = plan["memory"]
    assert mem["capacity_bytes"] == 24 * 2**30 and mem["fits"] is True
    # 8.29 B parameters in 2 bytes each
    assert sum(mem["base_weights_bytes"].values()) == pytest.approx(8.29e9 * 2, rel=0.01)
    assert plan["checkpointing"]["enabled"] is False and plan["targets"]["adapter_parameters"] > 0
    assert plan["lengths"]["max_length"] == 512


def test_a_plan_that_cannot_fit_exits_non_zero_and_names_the_fixes():
    result, plan = dry_json(
        "--model", "qwen2.5-vl-7b", "--backend", "cpu", "--param-dtype", "fp32", "--device-memory", "24GiB"
    )
    assert result.exit_code != 0
    mem = plan["memory"]
    assert mem["fits"] is False and mem["estimate_bytes"] > 24 * 2**30
    assert any(f.startswith("--param-dtype bf16") for f in mem["fixes"])
    # the CPU backend offers sharding, so splitting the model over processes is one of the fixes
    assert any(f.startswith("--shard fsdp over ") and f.endswith("(fits)") for f in mem["fixes"]), mem["fixes"]
    assert "will not fit" in result.output


def test_a_72b_plan_sharded_over_8_processes_gives_each_its_share():
    """The issue's command, offline: the bundled 72B config, FSDP over 8 CUDA processes of 80 GiB."""
    from vlft.planning.plan import format_plan

    result, plan = dry_json(
        "--model",
        "qwen2.5-vl-72b",
        "--shard",
        "fsdp",
        "--nproc-per-node",
        "8",
        "--backend",
        "cuda",
        "--device-memory",
        "80GiB",
    )
    assert result.exit_code == 0, result.output
    sh, mem = plan["sharding"], plan["memory"]
    assert sh["strategy"] == "fsdp" and sh["world_size"] == 8 and sh["param_dtype"] == "bfloat16"
    assert sh["wrapped"] == {"Qwen2_5_VLVisionBlock": 32, "Qwen2_5_VLDecoderLayer": 80}
    base = sum(mem["base_weights_bytes"].values())
    assert base == pytest.approx(73.4e9 * 2, rel=0.01)  # 73.4 B parameters in bf16, 147 GB: no single card
    assert mem["sharded_over"] == 8 and mem["base_bytes_per_process"] == -(-base // 8)
    # each process: its eighth of everything sharded, plus what is gathered whole at a time
    assert mem["estimate_bytes"] == (
        mem["base_bytes_per_process"]
        + mem["adapter_state_bytes_per_process"]
        + mem["gathered_bytes"]
        + mem["activation_bytes"]
        + mem["backward_transient_bytes"]
        + mem["logits_bytes"]
        + mem["reserved_bytes"]
    )
    assert 0 < mem["gathered_bytes"] < base / 8 and mem["fits"] is True
    text = format_plan(plan)
    assert "sharding     fsdp over 8 process(es)" in text
    assert "fully_shard on 32 Qwen2_5_VLVisionBlock + 80 Qwen2_5_VLDecoderLayer, then the root" in text
    assert "sharded over 8 processes" in text


def test_checkpointing_auto_turns_on_when_only_it_makes_the_run_fit(tmp_path):
    _, tight = dry_json(
        "--model", "qwen2.5-vl-7b", "--backend", "cuda", "--device-memory", "80GiB", "--batch-size", "64"
    )
    need_off = tight["memory"]["activation_bytes_without_checkpointing"]
    need_on = tight["memory"]["activation_bytes_with_checkpointing"]
    assert need_on < 0.5 * need_off
    fixed = tight["memory"]["estimate_bytes"] - tight["memory"]["activation_bytes"]
    between = int((fixed + (need_on + need_off) / 2) / 0.95)
    result, plan = dry_json(
        "--model", "qwen2.5-vl-7b", "--backend", "cuda", "--device-memory", str(between), "--batch-size", "64"
    )
    assert result.exit_code == 0, result.output
    assert plan["checkpointing"]["enabled"] is True and plan["checkpointing"]["reason"].startswith("auto: on")


def test_a_run_that_cannot_fit_stops_before_loading_and_writes_nothing(registry, small_data, tmp_path):
    from vlft.commands.run import execute
    from vlft.errors import ConfigError

    with pytest.raises(ConfigError, match="will not fit") as e:
        execute(registry, _cfg(small_data, tmp_path / "r", device_memory="300MiB"))
    assert "fix " in str(e.value)
    assert not (tmp_path / "r").exists()


def test_a_bundled_config_plans_but_a_real_run_says_where_the_weights_go(registry, small_data, tmp_path):
    from vlft.commands.run import execute
    from vlft.errors import ConfigError

    with pytest.raises(ConfigError, match="huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct"):
        execute(registry, _cfg(small_data, tmp_path / "r", model="qwen2.5-vl-3b", device_memory="1TiB"))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "name, total",
    [
        ("qwen2.5-vl-3b", 3_754_622_976),
        ("qwen2.5-vl-7b", 8_292_166_656),
        ("qwen2.5-vl-32b", 33_452_718_336),
        ("qwen2.5-vl-72b", 73_410_777_344),
    ],
)
def test_bundled_configs_have_the_published_parameter_counts(name, total):
    """3B: the checkpoint's index (7,509,245,952 bytes / 2); 7B: 8.29 B; 32B: 33.5 B; 72B: 73.4 B."""
    from transformers import AutoModelForImageTextToText

    from vlft.models.loading import load_model_config, resolve_model_path

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            load_model_config(resolve_model_path(name, installed()), installed())
        )
    assert sum(p.numel() for p in model.parameters()) == total


def test_device_memory_sizes_parse():
    from vlft.config import parse_bytes
    from vlft.errors import ConfigError

    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("64GB") == 64 * 10**9
    assert parse_bytes("1.5 TiB") == int(1.5 * 2**40) and parse_bytes("4096") == 4096
    with pytest.raises(ConfigError, match="cannot read 'lots'"):
        parse_bytes("lots", "--device-memory")


def _long_data(folder, repeats: int):
    """The demo set with each question made about ``12 * repeats`` tokens longer."""
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(folder, n_train=4, n_val=2, seed=0)
    records = [json.loads(line) for line in ds.train.read_text().splitlines()]
    for r in records:
        r["conversations"][0]["value"] += " Look closely." * repeats
    ds.train.write_text("".join(json.dumps(r) + "\n" for r in records))
    return ds.train


def test_when_no_single_fix_fits_the_plan_names_the_fewest_that_fit_together(tmp_path):
    """The 7B at batch 4 of about 2k tokens on 20 GiB, checkpointing off: checkpointing alone and batch 1
    alone are each still over; the two together fit, with the figure a plan for those flags gives."""
    train = _long_data(tmp_path / "long", 165)
    args = ["--model", "qwen2.5-vl-7b", "--backend", "cuda", "--device-memory", "20GiB", "--data", str(train)]
    result, plan = dry_json(*args, "--grad-checkpointing", "off")
    assert result.exit_code != 0 and 2000 < plan["lengths"]["longest"] < 2100
    fixes = plan["memory"]["fixes"]
    assert not any(f.endswith("(fits)") for f in fixes if not f.startswith("together: ")), fixes
    combined = [f for f in fixes if f.startswith("together: ")]
    assert (
        len(combined) == 1
        and combined[0].startswith("together: --grad-checkpointing on --batch-size 1 --grad-accum 4: ")
        and combined[0].endswith(" (fits)")
    )
    # re-estimated, not added up: the plan for those flags gives the same figure, and fits
    from vlft.planning.memory import gib

    result, fixed = dry_json(*args, "--grad-checkpointing", "on", "--batch-size", "1", "--grad-accum", "4")
    assert result.exit_code == 0 and fixed["memory"]["fits"] is True
    assert (
        combined[0] == f"together: --grad-checkpointing on --batch-size 1 --grad-accum 4: "
        f"{gib(fixed['memory']['estimate_bytes'])} (fits)"
    )
    from vlft.planning.plan import format_plan

    assert f"fix          {combined[0]}" in format_plan(plan).splitlines()


def test_gemma3_traced_activations_are_what_a_real_step_saves(registry, small_data, tmp_path):
    """The example plugin's Gemma 3 (its processor writes the image tokens): its image_grids give the plan one
    grid per image and its tracer runs SigLIP's layers on the tower's own patch count, so the plan counts the
    vision activations (no "not traced" note) and they are what autograd saves in a real fp32 eager step, LoRA on
    both towers."""
    gemma3 = pytest.importorskip("vlft_example_plugin.gemma3", reason="the example plugin (make test installs it)")
    from vlft.data.batching import model_inputs
    from vlft.measure import SavedTensorMeter
    from vlft.models.loss import token_loss_sum
    from vlft.planning.memory import MemoryBasis, plan_memory
    from vlft.planning.preflight import plan_run, plan_targets
    from vlft.planning.trace import BatchShape, skeleton

    config = _cfg(small_data, tmp_path / "r", model="embedded:gemma3")
    plan = plan_run(registry, config)
    assert not [n for n in plan.notes if "not traced" in n], plan.notes
    _, _, s = _steps(registry, config, 1)
    batch = next(iter(torch.utils.data.DataLoader(s.dataset, batch_size=4, collate_fn=s.collate)))
    images = batch["pixel_values"].shape[0]
    grids = gemma3.image_grids(s.plan.processor, [(32, 32)] * images, None)
    shape = BatchShape(4, batch["input_ids"].shape[1], grids)
    sk, _ = plan_targets(registry, plan, skeleton(plan.model_config, plan.attention, torch.float32))
    estimate = plan_memory(MemoryBasis(sk, plan.model_config, "float32", None, plan.family), shape)
    assert estimate.activations.untraced == []
    without_images = plan_memory(
        MemoryBasis(sk, plan.model_config, "float32", None, plan.family), BatchShape(4, shape.tokens, [])
    )
    assert estimate.activations.full > without_images.activations.full  # the tower's share is counted
    meter = SavedTensorMeter(s.model)
    s.model.train()
    with meter.hooks():
        token_loss_sum(s.model(**model_inputs(batch)).logits, batch["labels"])
    assert estimate.activations.full == pytest.approx(meter.bytes, rel=0.02)


def test_gemma4_traced_activations_are_what_a_real_step_saves(registry, small_data, tmp_path):
    """Gemma 4's vision tracer (its processor pads every image to the budget's patches, then k x k pooling) with
    the text layers run through the family's trace_layer_kwargs: the meta-device trace against the tensors
    autograd saves in a real fp32 eager step on the tiny model, LoRA on both towers."""
    from vlft.data.batching import model_inputs
    from vlft.measure import SavedTensorMeter
    from vlft.models.loss import token_loss_sum
    from vlft.planning.memory import MemoryBasis, plan_memory
    from vlft.planning.preflight import plan_run, plan_targets
    from vlft.planning.trace import BatchShape, skeleton

    config = _cfg(small_data, tmp_path / "r", model="embedded:gemma4")
    plan = plan_run(registry, config)
    _, _, s = _steps(registry, config, 1)
    batch = next(iter(torch.utils.data.DataLoader(s.dataset, batch_size=4, collate_fn=s.collate)))
    real = (batch["image_position_ids"] != -1).all(-1)
    grids = [
        (1, int(p[m][:, 1].max()) + 1, int(p[m][:, 0].max()) + 1) for p, m in zip(batch["image_position_ids"], real)
    ]
    shape = BatchShape(4, batch["input_ids"].shape[1], grids)
    sk, _ = plan_targets(registry, plan, skeleton(plan.model_config, plan.attention, torch.float32))
    estimate = plan_memory(MemoryBasis(sk, plan.model_config, "float32", None, plan.family), shape)
    assert estimate.activations.untraced == []
    meter = SavedTensorMeter(s.model)
    s.model.train()
    with meter.hooks():
        token_loss_sum(s.model(**model_inputs(batch)).logits, batch["labels"])
    assert estimate.activations.full == pytest.approx(meter.bytes, rel=0.02)  # measured: 51.16 MB against 51.11
