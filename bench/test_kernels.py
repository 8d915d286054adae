"""Group ``kernels``: CPU step time of the vision patch embedding as a ``Linear`` (the CUDA plugin's
``linear-patch-embed``) against the ``Conv3d`` it replaces, forward and backward, side by side in one run.

Shape: Qwen2.5-VL-7B's patch embedding (3 x 2 x 14 x 14 -> 1280, no bias) over 256 patches (one 224 x 224
image), input and weight trainable, fp32. The ratio is conv time / linear time
(> 1: the matmul is faster). Device figures (where cuDNN's Conv3d is the slow one) go in
docs/kernels-device.md when a device is lent; nothing here is asserted.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.support.figures import figure, record

PATCHES, EMBED, PATCH = 256, 1280, 14
ROUNDS = 3


def _step(module, x, grad):
    x.grad = None
    module.weight.grad = None
    module(x).backward(grad)


def _time(module, x, grad, rounds):
    t0 = time.perf_counter()
    for _ in range(rounds):
        _step(module, x, grad)
    return (time.perf_counter() - t0) / rounds


@pytest.mark.benchmark(group="kernels")
def test_linear_vs_conv3d_patch_embed(benchmark, env):
    import vlft_cuda.kernels as cuda_kernels

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, EMBED, kernel_size=(2, PATCH, PATCH), stride=(2, PATCH, PATCH), bias=False)
    lin = cuda_kernels.linear_patch_embed(conv)
    patches = 16 if benchmark.disabled else PATCHES
    x = torch.randn(patches, 3, 2, PATCH, PATCH, requires_grad=True)
    grad = torch.randn(patches, EMBED, 1, 1, 1)
    rounds = 1 if benchmark.disabled else ROUNDS
    for m in (conv, lin):  # warm-up
        _step(m, x, grad)
    times = {"conv3d": [], "linear": []}
    for _ in range(3):  # interleaved, so a busy moment hits both
        for name, m in (("conv3d", conv), ("linear", lin)):
            times[name].append(_time(m, x, grad, rounds))
    best = {k: min(v) for k, v in times.items()}
    benchmark.pedantic(_step, args=(lin, x, grad), rounds=rounds, iterations=1)
    ratio = best["conv3d"] / best["linear"]
    record(
        benchmark,
        env,
        None,
        "kernels",
        figures={
            "conv3d_over_linear": figure(
                ratio, None, "x", f"forward + backward, best of 3 x {rounds} rounds, {patches} patches"
            )
        },
        variants={k: {"step_s": v} for k, v in best.items()},
        notes=[f"threads {torch.get_num_threads()}"],
    )
    print(
        f"\npatch embedding fwd+bwd on CPU, {patches} patches: conv3d {best['conv3d'] * 1e3:.2f} ms, "
        f"linear {best['linear'] * 1e3:.2f} ms, ratio {ratio:.2f}x"
    )
