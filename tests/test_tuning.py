"""Tuning like practitioners do: per-tower learning rates, a merger trained in full, DoRA and rsLoRA."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from helpers import base_model, cli_invoke, installed, run_flags
from vlft.config import build_config


def _cfg(small_data, out, **over):
    train, val = small_data
    values = dict(
        backend="cpu",
        method="lora",
        data=str(train),
        val_data=str(val),
        output=str(out),
        steps=4,
        batch_size=2,
        log_every=1,
        eval_every=0,
        eval_samples=2,
        max_new_tokens=4,
        save_every=0,
        seed=1,
        warmup_ratio=0.5,
        lr=2e-3,
    )
    values.update(over)
    return build_config({}, values)


def _train(session, n):

    session.model.train()
    losses = []
    for group in session.batches():
        out = session.train_step(group)
        losses.append(out.loss)
        if len(losses) == n:
            return losses
    return losses


@pytest.fixture(scope="module")
def tower_session(small_data, tmp_path_factory):
    from vlft.registry import load_registry
    from vlft.training.trainer import build_trainer

    cfg = _cfg(small_data, tmp_path_factory.mktemp("towers") / "run", lr_vision=1e-3, lr_merger=5e-4, train_merger=True)
    s = build_trainer(load_registry(), cfg)
    merger = s.model.get_base_model().model.visual.merger
    before = {n: p.detach().clone() for n, p in merger.original_module.named_parameters()}
    losses = _train(s, 2)
    return s, before, losses


def test_each_tower_has_its_own_group_and_learning_rate_and_the_schedule_scales_them_all(tower_session):
    s, _, losses = tower_session
    groups = {g["name"]: g for g in s.optimizer.param_groups}
    assert set(groups) == {"text", "vision", "merger"}
    assert {n: g["initial_lr"] for n, g in groups.items()} == {"text": 2e-3, "vision": 1e-3, "merger": 5e-4}
    names = {id(p): n for n, p in s.model.named_parameters()}
    for name, group in groups.items():
        members = [names[id(p)] for p in group["params"]]
        assert members and all(p.requires_grad for p in group["params"])
        if name == "merger":
            assert all(".visual.merger.modules_to_save." in m for m in members)
        elif name == "vision":
            assert all(".visual.blocks." in m and "lora_" in m for m in members)
        else:
            assert all(".visual." not in m and "lora_" in m for m in members)
    # 2 of 4 steps taken, warm-up 2 steps: every group at the same fraction of its own peak (not at its peak)
    fractions = {n: g["lr"] / g["initial_lr"] for n, g in groups.items()}
    assert len({round(f, 12) for f in fractions.values()}) == 1 and 0 < fractions["text"] <= 1
    assert s.scheduler.get_last_lr() == [g["lr"] for g in s.optimizer.param_groups]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_the_plan_shows_the_groups_and_the_merger_trained_in_full(tower_session):
    from vlft.planning.plan import format_plan

    s = tower_session[0]
    desc = s.plan.describe()
    opt = desc["optimizer"]
    assert opt["train_merger"] and {g: v["lr"] for g, v in opt["groups"].items()} == {
        "text": 2e-3,
        "vision": 1e-3,
        "merger": 5e-4,
    }
    merger_params = sum(p.numel() for p in s.model.get_base_model().model.visual.merger.modules_to_save.parameters())
    assert opt["merger_parameters"] == merger_params == opt["groups"]["merger"]["parameters"]
    text = format_plan(desc)
    assert "peak lr (absolute): text 0.002" in text and "vision 0.001" in text and "merger 0.0005" in text
    assert f"merger trained in full: {merger_params:,} parameters" in text


def test_the_trained_merger_is_saved_so_plain_peft_loads_it(tower_session, model_dir, tmp_path):
    from peft import PeftModel

    s, before, _ = tower_session
    wrapper = s.model.get_base_model().model.visual.merger
    trained = {n: p.detach().clone() for n, p in wrapper.modules_to_save["default"].named_parameters()}
    changed = [n for n in trained if not torch.equal(trained[n], before[n])]
    assert changed, "the merger was not updated"
    for n, p in wrapper.original_module.named_parameters():  # the frozen original is left alone
        assert torch.equal(p, before[n])
    s.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.visual.merger"]
    plain = PeftModel.from_pretrained(base_model(model_dir), str(tmp_path / "adapter"))
    loaded = plain.get_base_model().model.visual.merger.modules_to_save["default"]
    for n, p in loaded.named_parameters():
        torch.testing.assert_close(p.float(), trained[n].float())


def test_a_method_that_ignores_train_merger_is_refused(registry, model_dir):
    from peft import LoraConfig, get_peft_model

    from vlft.errors import ConfigError
    from vlft.models.families import family_of_model
    from vlft.models.groups import check_merger_trained

    model = base_model(model_dir)
    adapted = get_peft_model(model, LoraConfig(target_modules=["q_proj"]))  # no modules_to_save
    with pytest.raises(ConfigError, match="did not make the merger trainable"):
        check_merger_trained(adapted, family_of_model(adapted, installed()), "stand-in")


def test_learning_rates_must_be_positive(small_data, tmp_path):
    from vlft.errors import ConfigError

    with pytest.raises(ConfigError, match="--lr-vision must be positive"):
        _cfg(small_data, tmp_path, lr_vision=0.0)


# -- the same options through `vlft run` ---------------------------------------------------------------

LRS = {"text": 2e-3, "vision": 1e-3, "merger": 5e-4}  # --lr, --lr-vision, --lr-merger below
TOWER_FLAGS = ("--lr", LRS["text"], "--lr-vision", LRS["vision"], "--lr-merger", LRS["merger"], "--train-merger")


def _cli_run(small_data, out, *flags):
    """A short `vlft run` with a checkpoint at every step (its adapter and optimizer state), no evaluation."""
    train, val = small_data
    code, output = cli_invoke(
        "run",
        "--quiet",
        "--backend",
        "cpu",
        "--data",
        train,
        "--val-data",
        val,
        "--output",
        out,
        "--batch-size",
        2,
        "--log-every",
        1,
        "--eval-every",
        0,
        "--eval-samples",
        0,
        "--save-every",
        1,
        "--keep-checkpoints",
        4,
        *flags,
    )
    assert code == 0, output
    return out


@pytest.fixture(scope="module")
def tower_run(small_data, tmp_path_factory):
    """2 steps with a learning rate per tower and the merger trained in full, no warm-up: the first step is
    taken at each group's peak."""
    out = tmp_path_factory.mktemp("tower-cli") / "run"
    return _cli_run(small_data, out, "--steps", 2, "--seed", 1, "--warmup-ratio", 0, *TOWER_FLAGS)


@pytest.fixture(scope="module")
def warmup_run(small_data, tmp_path_factory):
    """The same options over 4 steps, half of them warming up."""
    out = tmp_path_factory.mktemp("warmup-cli") / "run"
    return _cli_run(small_data, out, "--steps", 4, "--seed", 1, "--warmup-ratio", 0.5, *TOWER_FLAGS)


def _checkpoint(run, step: int) -> tuple[dict, dict]:
    """(the optimizer's param groups by name, the adapter's tensors) of the checkpoint after ``step``."""
    from safetensors.torch import load_file

    folder = run / "checkpoints" / f"step-{step:06d}"
    state = torch.load(folder / "state.pt", weights_only=False)
    groups = {g["name"]: g for g in state["optimizer"]["param_groups"]}
    return groups, load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def _merger(tensors: dict) -> dict:
    """The merger's own weights in an adapter folder (``modules_to_save``), by their name in the merger."""
    return {k.split(".merger.", 1)[1]: v for k, v in tensors.items() if ".merger." in k and "lora_" not in k}


def test_each_towers_learning_rate_moves_its_own_parameters_in_a_real_run(tower_run):
    """AdamW's first step moves each parameter by lr x g / (|g| + eps): by its group's peak lr wherever the
    gradient is well above eps. LoRA B starts at 0, so after step 1 its largest entry is the lr of its tower:
    text at --lr, the vision blocks at --lr-vision, and the merger's own weights move by --lr-merger."""
    groups, tensors = _checkpoint(tower_run, 1)
    assert {n: g["initial_lr"] for n, g in groups.items()} == LRS
    lora_b = {
        tower: [v for k, v in tensors.items() if "lora_B" in k and (".visual." in k) == (tower == "vision")]
        for tower in ("text", "vision")
    }
    for tower, tensors_b in lora_b.items():
        assert tensors_b and max(float(v.abs().max()) for v in tensors_b) == pytest.approx(LRS[tower], rel=1e-3), tower
    base = {n: p.detach() for n, p in base_model_merger().named_parameters()}
    moved = max(float((v - base[n]).abs().max()) for n, v in _merger(tensors).items())
    assert moved == pytest.approx(LRS["merger"], rel=1e-3)


def base_model_merger():
    from vlft.models.embedded import embedded_model_dir

    return base_model(str(embedded_model_dir(installed()))).model.visual.merger


def test_train_merger_trains_the_merger_in_full_and_saves_it(tower_run):
    """--train-merger: every weight of the merger is in the saved adapter (PEFT's modules_to_save), trained:
    moved from the base's after 2 steps; the LoRA layers around it are saved as well."""
    from safetensors.torch import load_file

    config = json.loads((tower_run / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.visual.merger"]
    saved = _merger(load_file(str(tower_run / "adapter" / "adapter_model.safetensors")))
    base = dict(base_model_merger().named_parameters())
    assert saved.keys() == base.keys()
    assert all(not torch.equal(saved[n], p.detach()) for n, p in base.items() if p.dim() > 1)


def test_warmup_ratio_warms_every_group_up_over_its_share_of_the_steps(warmup_run):
    """--warmup-ratio 0.5 of 4 steps: 2 warm-up steps, the lr rising linearly from 0, then the cosine down to 0.
    Logged after each step: 1/2, 1, then 0.5 (1 + cos(pi/2)) and 0.5 (1 + cos(pi)) of the peak (without
    warm-up, 0.85, 0.5, 0.15, 0). The first step is taken at lr 0: nothing moves; every group warms alike."""
    logged = [m["lr"] for m in map(json.loads, (warmup_run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert logged == pytest.approx([LRS["text"] * f for f in (0.5, 1.0, 0.5, 0.0)], abs=1e-12)
    groups, tensors = _checkpoint(warmup_run, 1)
    assert {n: g["lr"] for n, g in groups.items()} == pytest.approx({n: lr / 2 for n, lr in LRS.items()})
    assert all(not v.any() for k, v in tensors.items() if "lora_B" in k)


def test_seed_draws_the_adapter_initialisation(tower_run, warmup_run, small_data, tmp_path):
    """--seed: LoRA A is drawn from it (its gradient is 0 while B is, so a first step leaves it as drawn): the
    two runs of seed 1 drew the same A, a run of seed 2 another."""
    other = _cli_run(small_data, tmp_path / "run", "--steps", 1, "--seed", 2, "--warmup-ratio", 0, *TOWER_FLAGS)
    drawn = [
        {k: v for k, v in _checkpoint(run, 1)[1].items() if "lora_A" in k} for run in (tower_run, warmup_run, other)
    ]
    assert drawn[0] and drawn[0].keys() == drawn[1].keys() == drawn[2].keys()
    assert all(torch.equal(v, drawn[1][k]) for k, v in drawn[0].items())
    assert not any(torch.equal(v, drawn[2][k]) for k, v in drawn[0].items())


# -- DoRA and rsLoRA ----------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["use_dora", "use_rslora"])
def test_lora_variant_trains_saves_and_loads_with_plain_peft(small_data, tmp_path, model_dir, option):
    from peft import PeftModel

    from vlft.registry import load_registry
    from vlft.training.trainer import build_trainer

    s = build_trainer(
        load_registry(), _cfg(small_data, tmp_path / "run", steps=3, warmup_ratio=0.0, adapter={option: True, "r": 8})
    )
    assert s.plan.adapter.hyperparameters[option] is True
    if option == "use_dora":
        assert any("lora_magnitude_vector" in n for n, p in s.model.named_parameters() if p.requires_grad)
    else:
        layer = s.model.get_base_model().model.language_model.layers[0].self_attn.q_proj
        assert layer.scaling["default"] == pytest.approx(64 / 8**0.5)  # alpha / sqrt(r), not alpha / r
    start = {n: p.detach().clone() for n, p in s.model.named_parameters() if p.requires_grad}
    losses = _train(s, 3)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    moved = [n for n, p in s.model.named_parameters() if p.requires_grad and not torch.equal(p, start[n])]
    assert moved
    s.save_adapter(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())[option] is True
    batch = s.collate([s.plan.encoder.encode(r) for r in s.plan.train_records[:2]])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    s.model.eval()
    plain = PeftModel.from_pretrained(base_model(model_dir), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, s.model(**inputs).logits, atol=1e-5, rtol=1e-5)


# -- adapters vLLM serves -----------------------------------------------------------------------------


def _lora_folder(registry, model_dir, path, targets="both"):
    from vlft.config import RunConfig
    from vlft.models.targets import select_targets

    cfg = RunConfig()
    model = base_model(model_dir)
    d = registry.first("vlft_adapter_defaults", method="lora", config=cfg)
    from vlft.models.families import family_of_model

    family = family_of_model(model, registry)
    chosen = select_targets(model, d, targets, 6, family).modules
    adapted = registry.first(
        "vlft_apply_adapter",
        method="lora",
        model=model,
        targets=chosen,
        config=cfg,
        target_parameters=[],
        family=family,
    )
    registry.first("vlft_save_adapter", method="lora", model=adapted, path=path)
    return chosen


def test_exported_adapter_names_are_the_models_modules_as_vllm_parses_them(registry, model_dir, tmp_path):
    from click.testing import CliRunner

    from vlft.cli import cli
    from vlft.models.serving import check_against_base, tensor_names

    chosen = _lora_folder(registry, model_dir, tmp_path / "adapter")
    result = CliRunner().invoke(
        cli,
        [
            "export",
            "--adapter",
            str(tmp_path / "adapter"),
            "--model",
            model_dir,
            "--adapter-only",
            "--output",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    # vLLM's parse_fine_tuned_lora_name, restated: strip base_model.model., take <module>.lora_A/B.weight
    keys = tensor_names(tmp_path / "out")
    assert all(k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    parsed = {k[len("base_model.model.") :].rsplit(".", 2)[0] for k in keys}
    linear = {n for n, m in base_model(model_dir).named_modules() if isinstance(m, torch.nn.Linear)}
    assert parsed == set(chosen) and parsed <= linear
    check = check_against_base(tmp_path / "out", model_dir, installed())
    assert check.servable and set(check.vision) == {m for m in chosen if ".visual." in m} and check.vision
    assert "--enable-tower-connector-lora" in result.output
    assert "--enable-tower-connector-lora" in (tmp_path / "out" / "README.md").read_text()


def test_text_only_adapters_need_no_tower_flag_and_foreign_names_are_caught(registry, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from vlft.models.serving import check_against_base

    _lora_folder(registry, model_dir, tmp_path / "adapter", targets="text")
    check = check_against_base(tmp_path / "adapter", model_dir, installed())
    assert check.servable and not check.vision
    assert not any("tower-connector" in line for line in check.lines())
    # a name that is no module of this model (another layout, another model) is named
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    key = next(iter(tensors))
    tensors[key.replace("model.language_model.layers", "model.layers")] = tensors.pop(key)
    save_file(tensors, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    check = check_against_base(tmp_path / "adapter", model_dir, installed())
    assert check.missing and check.missing[0].startswith("model.layers.") and not check.servable


def test_a_trained_merger_is_reported_as_what_vllm_refuses(tower_session, model_dir, tmp_path):
    from vlft.models.serving import check_against_base

    s = tower_session[0]
    s.save_adapter(tmp_path / "adapter")
    check = check_against_base(tmp_path / "adapter", model_dir, installed())
    assert not check.servable and any("modules_to_save" in b for b in check.blockers)
    assert "merged model" in check.lines()[0]


# -- NF4 base weights (QLoRA) ---------------------------------------------------------------------------


def test_nf4_is_refused_with_the_reason_where_the_backend_cannot(small_data, tmp_path, monkeypatch):
    from vlft.errors import ConfigError
    from vlft.planning.plan import resolve_precision
    from vlft.registry import load_registry

    registry = load_registry()
    cfg = _cfg(small_data, tmp_path, param_dtype="nf4", backend="ascend")
    if (
        importlib.util.find_spec("bitsandbytes") is None
        or importlib.util.find_spec("bitsandbytes.backends.npu") is None
    ):
        with pytest.raises(
            ConfigError,
            match="backend ascend cannot train on 4-bit weights: .*NPU backend|"
            "backend ascend cannot train on 4-bit weights: .*bitsandbytes",
        ):
            resolve_precision(registry, "ascend", cfg)
    with pytest.raises(ConfigError, match="--double-quant applies to --param-dtype nf4 only"):
        resolve_precision(registry, "cpu", _cfg(small_data, tmp_path, double_quant=True))
    cuda = resolve_precision(registry, "cuda", _cfg(small_data, tmp_path, param_dtype="nf4", backend="cuda"))
    assert cuda.quantization == "nf4" and cuda.autocast_dtype == "bfloat16" and cuda.four_bit


def test_nf4_plans_the_7b_at_batch_4_of_2k_tokens_on_a_24gib_card(tmp_path):
    from test_memory import _long_data, dry_json

    train = _long_data(tmp_path / "long", 165)
    args = [
        "--model",
        "qwen2.5-vl-7b",
        "--backend",
        "cuda",
        "--batch-size",
        "4",
        "--grad-checkpointing",
        "on",
        "--device-memory",
        "24GiB",
        "--data",
        str(train),
    ]
    result, plan = dry_json(*args, "--param-dtype", "nf4")
    assert result.exit_code == 0 and 2000 < plan["lengths"]["longest"] < 2100
    mem = plan["memory"]
    assert mem["fits"] is True and mem["base_dtype"] == "nf4 linear + bfloat16"
    _, bf16 = dry_json(*args, "--param-dtype", "bf16", "--no-memory-check")
    four, half = sum(mem["base_weights_bytes"].values()), sum(bf16["memory"]["base_weights_bytes"].values())
    assert 0.3 < four / half < 0.45  # linear at ~4.5 bits, embeddings bf16
    # the whole estimate drops by what the weights save (with logits only at labelled positions bf16 fits 24 GiB
    # at this batch too, so the comparison is of the figures)
    assert bf16["memory"]["estimate_bytes"] - mem["estimate_bytes"] >= 0.9 * (half - four)
    from vlft.planning.memory import gib
    from vlft.planning.plan import format_plan

    assert f"base weights nf4 linear + bfloat16: {gib(four)}" in format_plan(plan)


def test_a_merger_trained_in_full_under_fsdp_is_exported_whole(small_data, tmp_path, model_dir):
    """--train-merger beside --shard fsdp over 2 processes, then ``vlft export``: the merged model's merger is
    the trained one (gathered whole from the shards into the adapter folder's modules_to_save), not the base's."""
    import os
    import subprocess

    from click.testing import CliRunner
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from helpers import vlft_command
    from vlft.cli import cli

    train, val = small_data
    out = tmp_path / "run"
    values = dict(
        backend="cpu",
        data=str(train),
        val_data=str(val),
        output=str(out),
        steps=3,
        batch_size=2,
        log_every=1,
        eval_every=0,
        eval_samples=1,
        max_new_tokens=2,
        save_every=0,
        seed=1,
        lr=2e-3,
        shard="fsdp",
        train_merger=True,
    )
    proc = subprocess.run(
        [*vlft_command(), "run", "--quiet", "--nproc-per-node", "2", *run_flags(values)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    trained = {k.split("merger.", 1)[1]: v for k, v in saved.items() if ".merger." in k and "lora" not in k}
    assert trained, sorted(saved)[:5]
    merged = tmp_path / "merged"
    result = CliRunner().invoke(cli, ["export", "--adapter", str(out), "--output", str(merged), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    exported = AutoModelForImageTextToText.from_pretrained(str(merged), dtype=torch.float32).model.visual.merger
    base = base_model(model_dir).model.visual.merger
    moved = 0
    for name, p in exported.named_parameters():
        torch.testing.assert_close(p.detach(), trained[name], rtol=0, atol=0)
        moved += not torch.equal(p.detach(), dict(base.named_parameters())[name].detach())
    assert moved  # the merger trained: the export does not hold the base's
