"""Real training steps on each accelerator, checked against what the device and the request say.

Marked ``cuda`` or ``npu``: skipped (with the probe's reason) where the device is absent, see
``conftest.py`` here. The checks (``checks.py``) read what really ran: the dtype the linear layers
computed in during the training steps, the attention each tower dispatched on, where and in which
dtype the parameters live, the TF32 switches and a matmul's precision, vlft's step on an overflowing
fp16 step, the memory the reader sees. Expected values come from the hardware (compute capability, the
flash-attn package) or from the request, not from the run's plan; ``tests/test_device_checks.py`` shows
on the CPU that each check fails when a plugin answers wrongly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hardware.checks import (
    check_attention,
    check_autocast,
    check_memory_readers_per_device,
    check_non_finite_step_is_undone_on_the_device,
    check_overflowing_step_is_skipped,
    check_parameters,
    check_tf32,
    check_tf32_in_effect,
    observed_run,
    prepared,
)

REPO = Path(__file__).resolve().parents[2]
STEPS = 8  # two passes over 32 samples in batches of 8: the second pass must see a lower loss


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(tmp_path_factory.mktemp("device-data") / "demo", 32, 8)
    return ds.train, ds.val


def train(tmp_path, data, backend: str, method: str, **extra):
    """``vlft run`` on the device with an observer; returns (result, observer) after the run-level checks."""
    result, observer = observed_run(
        tmp_path,
        *data,
        backend=backend,
        method=method,
        steps=STEPS,
        batch_size=8,
        eval_samples=4,
        max_new_tokens=8,
        lr=3e-3,
        warmup_ratio=0.0,
        **extra,
    )
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    # a sanity check only: a wrong but finite policy lowers the loss too; the checks of each test decide
    half = STEPS // 2
    assert sum(losses[half:]) / (STEPS - half) < sum(losses[:half]) / half, f"loss did not fall: {losses}"
    summary = json.loads((result.output / "summary.json").read_text())
    # the parameters live on the device, so its peak holds at least their bytes: a reader of the host,
    # or of another device, reports less
    param_bytes = sum(p.numel() * p.element_size() for p in observer.model.parameters())
    assert summary["peak_memory_bytes"] >= param_bytes, (summary["peak_memory_bytes"], param_bytes)
    assert (result.output / "adapter" / "adapter_model.safetensors").is_file()
    print(
        f"{backend} {method} {extra}: losses {[round(x, 4) for x in losses]}, peak memory "
        f"{summary['peak_memory_bytes'] / 2**20:.1f} MiB, {summary['train_time_s']:.1f} s"
    )
    return result, observer


def run_reversed(marker: str) -> None:
    """The device tests for ``marker`` (and the accelerator parity tests) again, in reverse order."""
    if os.environ.get("VLFT_TEST_ORDER") == "reverse":
        pytest.skip("this is the reversed run")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            marker,
            "-k",
            "not reverse_order",
            str(REPO / "tests" / "hardware"),
            str(REPO / "tests" / "parity"),
        ],
        env={**os.environ, "VLFT_TEST_ORDER": "reverse"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]


# -- CUDA ----------------------------------------------------------------------------------------------


def capability(index: int = 0) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def flash_attn_2_importable() -> bool:
    try:
        import flash_attn
    except Exception:  # noqa: BLE001 - a build for another torch fails with undefined symbols
        return False
    return str(getattr(flash_attn, "__version__", "")).startswith("2.")


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["lora", "oft"])
def test_cuda_default_policy_is_what_the_gpu_allows(method, tmp_path, data):
    cap = capability()
    ampere = cap >= (8, 0)  # native bf16 and flash-attention 2 from compute capability 8.0 on
    attn = "flash_attention_2" if ampere and flash_attn_2_importable() else "sdpa"
    result, observer = train(tmp_path, data, "cuda", method)
    check_autocast(observer, torch.bfloat16 if ampere else torch.float16)
    check_attention(observer, {"vision": attn, "text": attn})
    # base weights in the run's parameter dtype (issue 8: half where the GPU allows), adapters fp32
    check_parameters(observer.model, "cuda", getattr(torch, result.plan.precision.param_dtype))
    check_tf32(True)
    if ampere:
        check_tf32_in_effect(torch.device("cuda", 0), True)
    else:
        assert all("loss_scale" in r for r in result.metrics), "fp16 trained without a loss scaler"


@pytest.mark.cuda
def test_cuda_honours_an_explicit_precision_and_attention_per_tower(tmp_path, data):
    result, observer = train(tmp_path, data, "cuda", "lora", precision="fp16", attn="vision=eager,text=sdpa")
    check_autocast(observer, torch.float16)
    check_attention(observer, {"vision": "eager", "text": "sdpa"})
    check_tf32(True)
    assert all("loss_scale" in r for r in result.metrics), "fp16 trained without a loss scaler"


@pytest.mark.cuda
def test_cuda_explicit_fp32_turns_tf32_off_after_a_default_set_up(tmp_path, data):
    from vlft.config import build_config
    from vlft.registry import load_registry

    device = torch.device("cuda", 0)
    load_registry().first("vlft_setup_device", backend="cuda", config=build_config({}, {"backend": "cuda"}))
    check_tf32(True)  # what a default run earlier in this process leaves behind
    if capability() >= (8, 0):
        check_tf32_in_effect(device, True)
    result, observer = train(tmp_path, data, "cuda", "lora", precision="fp32")
    check_tf32(False)
    check_tf32_in_effect(device, False)
    check_autocast(observer, torch.float32)
    check_attention(observer, {"vision": "sdpa", "text": "sdpa"})  # flash-attention computes in half only
    check_parameters(observer.model, "cuda", torch.float32)


@pytest.mark.cuda
def test_cuda_fp16_overflowing_step_is_skipped_by_vlfts_step(tmp_path, data):
    check_overflowing_step_is_skipped(prepared(data[0], tmp_path, backend="cuda", precision="fp16"))


@pytest.mark.cuda
def test_cuda_memory_reader_reads_its_own_device(registry):
    check_memory_readers_per_device(registry, "cuda", "cuda", torch.cuda.device_count())


@pytest.mark.cuda
def test_cuda_default_bf16_non_finite_step_is_undone_on_the_device(tmp_path, data):
    """The default path from Ampere on: bf16, no loss scaler, the step's flag left on the device; a NaN step
    is taken and undone by guarded_step (weights and AdamW state bit for bit, host step counters settled)."""
    if capability() < (8, 0):
        pytest.skip("the default below compute capability 8.0 is fp16 with a loss scaler")
    session = prepared(data[0], tmp_path, backend="cuda")
    assert session.policy.autocast_dtype == torch.bfloat16
    check_non_finite_step_is_undone_on_the_device(session)


@pytest.mark.cuda
def test_cuda_local_rank_1_trains_on_device_1_with_its_capability(registry, tmp_path, data, monkeypatch):
    """A process with LOCAL_RANK 1 (as torchrun starts the second one) trains on cuda:1: its parameters live
    there, it computes in the precision device 1 allows, and it allocates nothing on device 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from vlft.config import RunConfig

    config = RunConfig(backend="cuda")
    config.local_rank = 1
    precision = registry.first("vlft_precision_policy", backend="cuda", config=config)
    expected = torch.bfloat16 if capability(1) >= (8, 0) else torch.float16
    assert precision.autocast_dtype == str(expected).removeprefix("torch.")
    monkeypatch.setenv("LOCAL_RANK", "1")  # build_config reads it, as under torchrun
    previous = torch.cuda.current_device()
    torch.cuda.synchronize(0)
    on_device_0 = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    try:
        result, observer = train(tmp_path, data, "cuda", "lora")
        assert torch.cuda.current_device() == 1
        assert {p.device for p in observer.model.parameters()} == {torch.device("cuda", 1)}
        check_parameters(observer.model, "cuda", getattr(torch, result.plan.precision.param_dtype))
        check_autocast(observer, expected)
        torch.cuda.synchronize(0)
        assert torch.cuda.max_memory_allocated(0) == on_device_0, "the run allocated memory on device 0"
    finally:
        torch.cuda.set_device(previous)


@pytest.mark.cuda
def test_cuda_nf4_trains_on_4bit_weights_and_exports_merged_into_them(tmp_path, data):
    """QLoRA on the GPU: the base's linears are bitsandbytes' 4-bit layers on the device, the step computes in
    bf16, the loss falls, and `vlft export` merges into the dequantized NF4 weights: the merged model's logits
    are the trained 4-bit model's (base + adapter) to bf16 rounding, and not the base's."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes: pip install 'vlft[qlora]'")
    import bitsandbytes as bnb

    from helpers import cli_invoke, export_logits
    from vlft.data.records import read_records

    if capability() < (8, 0):
        pytest.skip("nf4 computes in bf16, native from compute capability 8.0")
    result, observer = train(tmp_path, data, "cuda", "lora", param_dtype="nf4")
    check_autocast(observer, torch.bfloat16)
    four_bit = [m for m in observer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit and all(m.weight.device.type == "cuda" for m in four_bit)
    merged = tmp_path / "m"
    code, output = cli_invoke("export", "--adapter", result.output, "--output", merged, "--dtype", "fp32")
    assert code == 0, output
    assert "(its NF4 weights, dequantized)" in output
    logits = export_logits(
        result.output,
        merged,
        read_records(data[1]),
        attn="sdpa",
        backend="cuda",
        param_dtype="nf4",
        rounded=torch.bfloat16,
    )
    # The trained model computes in bf16 on its 4-bit weights dequantized to bf16; the fp32 merge of those same
    # dequantized weights is the exact answer. Its own run under bf16 autocast rounds weights and activations
    # as the trained model does: that distance, measured on the same inputs, is bf16's share. Within twice it,
    # as flash-attention's tests bound a kernel by twice PyTorch's own half-precision error.
    rounding = float((logits["exported_rounded"] - logits["exported"]).abs().max())
    off_merged = float((logits["adapted"] - logits["exported"]).abs().max())
    off_base = float((logits["adapted"] - logits["base"]).abs().max())
    print(
        f"nf4 export: max |logit| difference: trained vs merged {off_merged:.4f}, trained vs base {off_base:.4f}, "
        f"bf16 rounding of the merged model {rounding:.4f}"
    )
    assert rounding > 0, "the merged model gave the same logits in fp32 and bf16: autocast did not run"
    assert off_merged <= 2 * rounding
    assert off_base > 2 * rounding, "the adapter moves the logits no more than bf16 rounding does"


@pytest.mark.cuda
def test_cuda_device_tests_pass_in_reverse_order():
    run_reversed("cuda")


# -- Ascend NPU ---------------------------------------------------------------------------------------

EAGER = {"vision": "eager", "text": "eager"}


@pytest.mark.npu
@pytest.mark.parametrize("method", ["lora", "oft"])
def test_npu_default_policy_is_fp16_with_loss_scaling_and_eager_attention(method, tmp_path, data):
    # --kernels none: the field report's recipe (the npu-flash-attention-* kernels, where torch_npu and
    # transformers have them, are checked in tests/hardware/test_kernels_on_device.py)
    result, observer = train(tmp_path, data, "ascend", method, kernels="none")
    check_autocast(observer, torch.float16)
    check_attention(observer, EAGER)  # and no scaled_dot_product_attention call in any training step
    check_parameters(observer.model, "npu", getattr(torch, result.plan.precision.param_dtype))
    assert all("loss_scale" in r for r in result.metrics), "fp16 trained without a loss scaler"


@pytest.mark.npu
def test_npu_patch_reroutes_a_model_loaded_with_sdpa_to_eager_on_the_device(model_dir, processor, data):
    from hardware.checks import Observer

    from helpers import base_model
    from vlft.config import RunConfig
    from vlft.data.batching import collator_for, model_inputs, to_device
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.families import resolve_family
    from vlft.models.loss import autocast_context
    from vlft.registry import load_registry

    registry = load_registry()
    config = RunConfig(backend="ascend")
    device = registry.first("vlft_setup_device", backend="ascend", config=config).device
    policy = registry.first("vlft_attention_implementation", backend="ascend", config=config, model_config=None)
    model = base_model(model_dir, attn="sdpa").to(device)  # as a torch_npu-unaware loader would leave it
    family = resolve_family(registry, model.config)
    patched = [
        p
        for ps in registry.hook.vlft_patch_model(
            backend="ascend", model=model, config=config, attention=policy, family=family
        )
        if ps
        for p in ps
    ]
    assert patched, "nothing was patched, though both towers were loaded with sdpa"
    observer = Observer()
    observer.watch(model)
    enc = SampleEncoder(processor, family)
    batch = collator_for(processor, family)([enc.encode(r) for r in read_records(data[0])[:2]])
    model.train()
    with observer.counting_sdpa(), autocast_context(device, torch.float16):
        model(**model_inputs(to_device(batch, device))).logits.float().sum().backward()
    check_attention(observer, EAGER)


@pytest.mark.npu
def test_npu_overflowing_step_is_skipped_by_vlfts_step(tmp_path, data):
    check_overflowing_step_is_skipped(prepared(data[0], tmp_path, backend="ascend"))


@pytest.mark.npu
def test_npu_memory_reader_reads_its_own_device(registry):
    import torch_npu  # noqa: F401 - registers the npu device type

    check_memory_readers_per_device(registry, "ascend", "npu", torch.npu.device_count())


@pytest.mark.npu
def test_npu_device_tests_pass_in_reverse_order():
    run_reversed("npu")
