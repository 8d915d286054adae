"""The CPU reference backend: every other backend is compared with this one.

fp32 by default (bf16 autocast on request), eager attention unless asked
otherwise, gloo for several processes, no pinned memory.

Imports inside functions: `vlft plugins` imports every plugin to list it, so torch loads only when a
hook runs.
"""

from __future__ import annotations

from vlft import (
    AttentionPolicy,
    BackendInfo,
    ConfigError,
    DataLoaderOptions,
    DeviceCapacity,
    DeviceSetup,
    DistributedOptions,
    MemoryStats,
    PrecisionPolicy,
    ProbeResult,
    hookimpl,
    hookimpl_for,
)

NAME = "cpu"
cpu_hookimpl = hookimpl_for(NAME)  # a backend hook that answers for "cpu" only, None for others


@hookimpl
def vlft_backends():
    return [BackendInfo(NAME, "CPU reference backend (fp32; bf16 autocast on request)", "cpu", priority=0)]


@cpu_hookimpl
def vlft_probe_backend(backend):
    import torch

    return ProbeResult(True, device_count=1, versions={"torch": torch.__version__})


@cpu_hookimpl
def vlft_setup_device(backend, config):
    import torch

    return DeviceSetup(torch.device("cpu"), local_rank=config.local_rank)


@cpu_hookimpl
def vlft_attention_implementation(backend, config, model_config):
    from vlft import parse_attn

    asked = parse_attn(config.attn) or {}
    # eager is the reference: it is the plain math every other path must agree with
    text = asked.get("text", "eager")
    # packing (--packing): sample by sample on the reference's sdpa or eager (the segments path)
    packing, why = AttentionPolicy(text, text).packing_path()
    return AttentionPolicy(
        asked.get("vision", "eager"),
        text,
        "reference backend: eager unless asked" if not asked else "as asked",
        packing="segments" if packing == "segments" else "",
        packing_reason=why,
    )


def _four_bit() -> tuple[bool, str]:
    """NF4 on the CPU: bitsandbytes' CPU kernels (checked to train LoRA with 0.50.2: forward, backward, saving)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return False, "NF4 needs bitsandbytes, which is not installed: pip install 'vlft[qlora]'"
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (0, 48):
        return (
            False,
            f"bitsandbytes {version} has no CPU 4-bit kernels (0.48 or newer has); pip install -U bitsandbytes",
        )
    return True, f"NF4 through bitsandbytes {version}'s CPU kernels"


@cpu_hookimpl
def vlft_patch_model(backend, model, config, attention):
    """4-bit linears compute through bitsandbytes' general CPU path in inference too, as in training.

    bitsandbytes 0.50, in eval mode without grad on CPUs with AVX512-BF16, repacks each 4-bit weight on its
    first forward (32-row tiles, scales rounded to bf16). On the tiny models it asserts (out_features not a
    multiple of 32; Qwen2.5-VL's vision MLP has 3,420) or fails adding the bias in place; where it runs,
    evaluation would round differently from training, and differently on CPUs without the extension.
    """
    import sys

    if "bitsandbytes" not in sys.modules:  # no 4-bit model can have been loaded
        return None
    from bitsandbytes.nn import Linear4bit  # pyright: ignore[reportMissingImports]  # the qlora extra, kept out of the venv

    packed = [
        m for m in model.modules() if isinstance(m, Linear4bit) and getattr(m, "support_avx512bf16_for_cpu", False)
    ]
    for module in packed:
        module.support_avx512bf16_for_cpu = False
    return (
        [
            f"{len(packed)} 4-bit linear(s) kept off bitsandbytes' packed AVX512-BF16 inference path (computes "
            "as training does)"
        ]
        if packed
        else None
    )


@cpu_hookimpl
def vlft_precision_policy(backend, config):
    policy = _precision(config)
    policy.four_bit, policy.four_bit_reason = _four_bit()
    # torch's fused AdamW (with found_inf) runs on the CPU; a CPU run reads the flag on the host and keeps the
    # default AdamW (the reference), but a step taken as on a device (bench, tests) may use it
    policy.fused_optimizer = True
    return policy


def _precision(config):
    # the reference keeps fp32 base weights whatever it autocasts to; --param-dtype asks otherwise
    if config.precision in ("auto", "fp32"):
        return PrecisionPolicy(
            "fp32", reason="CPU reference: full precision", param_reason="CPU reference: fp32 weights"
        )
    if config.precision == "bf16":
        return PrecisionPolicy(
            "bf16",
            autocast_dtype="bfloat16",
            reason="bf16 autocast, as asked",
            param_reason="CPU reference: fp32 weights under autocast",
        )
    if config.precision == "fp16":
        import torch

        return PrecisionPolicy(
            "fp16",
            autocast_dtype="float16",
            loss_scaling=True,
            init_scale=2.0**16,
            reason="fp16 autocast with dynamic loss scaling, as asked",
            param_reason="CPU reference: fp32 weights under autocast",
            make_scaler=lambda: torch.amp.GradScaler("cpu", init_scale=2.0**16),
        )
    raise ConfigError(f"backend cpu does not support precision '{config.precision}'")


@cpu_hookimpl
def vlft_dataloader_options(backend, config, options: DataLoaderOptions):
    options.pin_memory = False
    # workers would compete with the training threads for the same cores
    options.num_workers = 0
    options.reasons.append("cpu: no pinned memory (nothing to copy to); no workers (they share the compute cores)")


@cpu_hookimpl
def vlft_distributed_options(backend, config):
    return DistributedOptions(
        "gloo",
        timeout_s=600,
        reason="gloo is torch's CPU process group",
        fsdp=True,
        sum_reductions=True,
        fsdp_reason=(
            "FSDP2 on gloo; its gradients reduce with SUM and are divided by FSDP itself, because "
            "gloo's averaged reduce-scatter has summed instead of averaged in some torch versions"
        ),
    )


@cpu_hookimpl
def vlft_seed(backend, seed, deterministic):
    if deterministic:
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)


def available_ram() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else physical RAM."""
    import os

    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@cpu_hookimpl
def vlft_device_capacity(backend, config):
    # the interpreter, torch and transformers themselves take about half a GiB of RAM
    return DeviceCapacity(available_ram(), reserved_bytes=512 * 2**20, source="available RAM (/proc/meminfo)")


@cpu_hookimpl
def vlft_memory_reader(backend, device):
    return lambda: MemoryStats(peak_bytes=peak_resident_bytes())


def peak_resident_bytes() -> int:
    """The process's peak resident set: ``VmHWM`` where Linux has it, else ``ru_maxrss``.

    Linux keeps ``ru_maxrss`` across fork and exec, so a run started by a large parent (a notebook, a pytest
    session holding models) would report the parent's size at the fork as its own peak; ``VmHWM`` belongs to the
    address space, which exec replaces."""
    import resource
    import sys

    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024
