"""Each kernel patch a device backend offers, run on the device against the unpatched model.

Marked ``cuda`` / ``npu`` (skipped with the probe's reason elsewhere; ``bench/device_check.py`` runs these
markers). For every patch whose condition holds on this machine (``--kernels NAME``, opt-in ones included):
the embedded model loaded twice in the backend's precision, one patched, the same batch forward and
backward under the backend's autocast; the loss and every gradient must agree within the precision's
tolerance, and the patched step's time is printed beside the unpatched one (the docs' device table).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

# loss and gradient tolerance per compute dtype: relative error of the loss, relative norm error of each grad
TOLERANCE = {None: (1e-4, 1e-3), "float32": (1e-4, 1e-3), "bfloat16": (2e-2, 8e-2), "float16": (1e-2, 5e-2)}


def _setup(backend: str):
    from vlft.config import RunConfig
    from vlft.models.embedded import embedded_model_dir
    from vlft.models.loading import model_config_and_family
    from vlft.planning.plan import resolve_plan
    from vlft.registry import load_registry

    registry = load_registry()
    model_dir = str(embedded_model_dir())
    config = RunConfig(backend=backend, kernels="none")
    device = registry.first("vlft_setup_device", backend=backend, config=config).device
    model_config, family = model_config_and_family(model_dir, registry)
    base_plan = resolve_plan(registry, config, model_dir, model_config, family=family)
    offered = [k for ks in registry.hook.vlft_kernel_patches(backend=backend, config=config,
                                                             model_config=model_config, family=family) if ks for k in ks]
    return registry, model_dir, device, model_config, family, base_plan, offered


def _step(model, batch, device, dtype):
    from vlft.data.batching import model_inputs
    from vlft.models.loss import autocast_context, token_loss_sum

    model.zero_grad(set_to_none=True)
    sync = getattr(torch, device.type).synchronize
    sync()
    t0 = time.perf_counter()
    with autocast_context(device, dtype):
        out = model(**model_inputs(batch))
    loss = token_loss_sum(out.logits, batch["labels"]) / (batch["labels"] != -100).sum()
    loss.backward()
    sync()
    return loss.detach().float().item(), time.perf_counter() - t0, {
        n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_each_patch(backend: str) -> None:
    from vlft.config import RunConfig
    from vlft.data.batching import Collator, to_device
    from vlft.data.demo import write_demo_dataset
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.loading import load_model, load_processor
    from vlft.planning.kernels import (
        apply_kernels,
        choose_kernels,
        with_kernel_attention,
    )

    registry, model_dir, device, model_config, family, plan, offered = _setup(backend)
    usable = [k for k in offered if k.available]
    print(f"{backend}: offered {[k.name for k in offered]}; usable here {[k.name for k in usable]}")
    for k in offered:
        if not k.available:
            print(f"  declined {k.name}: {k.reason}")
    if not usable:
        pytest.skip(f"no kernel patch of {backend} can run here")
    processor = load_processor(model_dir, family, registry)
    import tempfile

    ds = write_demo_dataset(tempfile.mkdtemp(prefix="kernels-"), 8, 2)
    enc = SampleEncoder(processor, family=family)
    batch = Collator(processor.tokenizer.pad_token_id, processor.image_token_id)(
        [enc.encode(r) for r in read_records(ds.train)[:4]])
    batch = to_device(batch, device)
    dtype_name = plan.precision.autocast_dtype
    dtype = getattr(torch, dtype_name) if dtype_name else None
    loss_tol, grad_tol = TOLERANCE[dtype_name]
    failures = []
    for k in usable:
        choice = choose_kernels(offered, dataclasses.replace(RunConfig(backend=backend), kernels=k.name))
        ref = load_model(model_dir, plan.attention, plan.precision).to(device).train()
        patched = load_model(model_dir, with_kernel_attention(plan.attention, choice), plan.precision)
        lines = apply_kernels(choice, patched)
        patched = patched.to(device).train()
        _step(ref, batch, device, dtype)  # warm-up, both
        _step(patched, batch, device, dtype)
        loss_ref, t_ref, g_ref = _step(ref, batch, device, dtype)
        loss, t, g = _step(patched, batch, device, dtype)
        rel = abs(loss - loss_ref) / max(abs(loss_ref), 1e-6)
        worst = max((float((g[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-12)), n)
                    for n in g_ref if n in g) if g_ref else (0.0, "-")
        print(f"  {k.name}: {lines}; loss {loss:.6f} vs {loss_ref:.6f} (rel {rel:.2e}); worst grad rel "
              f"{worst[0]:.2e} ({worst[1]}); step {t * 1e3:.1f} ms vs {t_ref * 1e3:.1f} ms unpatched")
        if set(g) != set(g_ref):
            failures.append(f"{k.name}: gradients of different parameters")
        if rel > loss_tol or worst[0] > grad_tol:
            failures.append(f"{k.name}: loss rel {rel:.2e} (tol {loss_tol}), grad rel {worst[0]:.2e} (tol {grad_tol})")
        del ref, patched
    assert not failures, failures


@pytest.mark.cuda
def test_cuda_kernel_matches_the_unpatched_model():
    check_each_patch("cuda")


@pytest.mark.npu
def test_npu_kernel_matches_the_unpatched_model():
    check_each_patch("ascend")
