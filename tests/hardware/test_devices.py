"""A few real training steps on each accelerator, through the same ``execute`` a user's ``vlft run`` takes.

Marked ``cuda`` or ``npu``: skipped (with the probe's reason) where the device is absent, see
``conftest.py`` here. On a device machine: LoRA and OFT on the embedded default model and a small
synthetic data set, loss finite and falling, peak device memory reported, adapter saved.
"""

from __future__ import annotations

import json
import math

import pytest

STEPS = 8  # two passes over 32 samples in batches of 8: the second pass must see a lower loss


def train(tmp_path, backend: str, method: str, **extra):
    from vlft.config import build_config
    from vlft.demo_data import write_demo_dataset
    from vlft.plugins import load_registry
    from vlft.run import execute

    ds = write_demo_dataset(tmp_path / "data", 32, 8)
    config = build_config({}, {
        "backend": backend, "method": method, "steps": STEPS, "batch_size": 8, "eval_samples": 4, "eval_every": 0,
        "save_every": 0, "log_every": 1, "data": str(ds.train), "val_data": str(ds.val),
        "output": str(tmp_path / "run"), **extra,
    })
    result = execute(load_registry(), config, progress=False)
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    half = STEPS // 2
    assert sum(losses[half:]) / (STEPS - half) < sum(losses[:half]) / half, f"loss did not fall: {losses}"
    summary = json.loads((result.output / "summary.json").read_text())
    assert summary["backend"] == backend and summary["steps"] == STEPS
    assert summary["peak_memory_bytes"] and summary["peak_memory_bytes"] > 0, summary
    assert all(r["peak_memory_bytes"] > 0 for r in result.metrics)
    assert (result.output / "adapter" / "adapter_model.safetensors").is_file()
    print(f"{backend} {method}: losses {[round(x, 4) for x in losses]}, "
          f"peak memory {summary['peak_memory_bytes'] / 2**20:.1f} MiB, {summary['train_time_s']:.1f} s")
    return result


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["lora", "oft"])
def test_cuda_trains(method, tmp_path):
    import torch

    result = train(tmp_path, "cuda", method)
    plan = result.plan
    native_bf16 = torch.cuda.get_device_capability() >= (8, 0)
    assert plan.precision.name == ("bf16" if native_bf16 else "fp16")
    assert plan.dataloader.pin_memory is True and plan.distributed.process_group_backend == "nccl"


@pytest.mark.cuda
def test_cuda_fp16_with_dynamic_loss_scaling(tmp_path):
    result = train(tmp_path, "cuda", "lora", precision="fp16")
    assert result.plan.precision.loss_scaling
    assert all(r["loss_scale"] > 0 for r in result.metrics)


@pytest.mark.npu
@pytest.mark.parametrize("method", ["lora", "oft"])
def test_npu_trains(method, tmp_path):
    result = train(tmp_path, "ascend", method)
    plan = result.plan
    assert (plan.attention.vision, plan.attention.text) == ("eager", "eager")
    assert plan.precision.name == "fp16" and plan.precision.init_scale == 2.0 ** 16
    assert all(r["loss_scale"] > 0 for r in result.metrics)  # torch.npu.amp.GradScaler at work
    assert plan.dataloader.pin_memory is False and plan.distributed.process_group_backend == "hccl"
