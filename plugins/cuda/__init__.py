"""The NVIDIA CUDA backend, device type ``cuda``.

Resolved once at set-up:

- bf16 autocast only where the GPU computes it natively (compute
  capability >= 8.0, Ampere or newer; not ``is_bf16_supported()``, which
  also says yes to emulation), else fp16 with ``torch.amp.GradScaler``;
- ``flash_attention_2`` where the flash-attn package imports and the GPU is
  8.0 or newer, else ``sdpa``; per tower overridable with ``--attn``;
- TF32 for matmul and cuDNN, turned off for an explicit ``--precision fp32``;
  pinned memory and two DataLoader workers; ``nccl``; ``CUBLAS_WORKSPACE_CONFIG`` when determinism is asked;
- kernel patches (``kernels.py``): the Conv3d patch embedding as a matmul, Liger's kernels as an opt-in
  extra; each listed in the plan, chosen or declined with the reason.

``torch_npu.contrib.transfer_to_npu`` makes ``torch.cuda`` answer for an
Ascend NPU; when it is loaded this backend reports itself unavailable, and
``--backend auto`` asks the NPU backend first anyway (higher priority).

Imports inside functions: `vlft plugins`, `vlft doctor` and `--backend auto` import
every backend plugin on every machine to list and probe it, so torch loads only when a hook of this backend
runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from vlft import (
    AttentionPolicy,
    BackendInfo,
    ConfigError,
    DataLoaderOptions,
    DeviceCapacity,
    DeviceSetup,
    DistributedOptions,
    DoctorCheck,
    MemoryStats,
    PrecisionPolicy,
    ProbeResult,
    hookimpl,
    hookimpl_for,
    parse_attn,
)

from .doctor import doctor_checks
from .kernels import kernel_patches
from .probing import (  # noqa: F401 - re-exported: the package's public helpers
    BF16_CAPABILITY,
    FLASH_ATTN_MIN,
    TRANSFER_TO_NPU,
    _first_line,
    capability,
    driver_version,
    flash_attn_status,
    probe,
    transfer_to_npu_loaded,
)

NAME = "cuda"
cuda_hookimpl = hookimpl_for(NAME)  # a backend hook that answers for "cuda" only, None for others
DEVICE_TYPE = "cuda"
PRIORITY = 10
LOSS_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
CUBLAS_WORKSPACE = ":4096:8"


# -- hooks ----------------------------------------------------------------------------


@hookimpl
def vlft_backends():
    return [
        BackendInfo(
            NAME,
            "NVIDIA GPU via CUDA (bf16 on Ampere+, flash-attention 2 where installed, nccl)",
            DEVICE_TYPE,
            priority=PRIORITY,
        )
    ]


@cuda_hookimpl
def vlft_probe_backend(backend):
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - a probe must never raise
        return ProbeResult(False, f"probing CUDA failed unexpectedly ({_first_line(e)})")


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and cuDNN convolutions, on or off (the switches are process-wide)."""
    import torch

    # the legacy switches: mixing them with torch's newer fp32_precision API makes torch raise
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled  # torch's own default is True: "off" must say so


def enable_tf32() -> None:
    set_tf32(True)


@cuda_hookimpl
def vlft_setup_device(backend, config):
    import torch

    torch.cuda.set_device(config.local_rank)
    # TF32 rounds fp32 matmuls to 10-bit mantissas: fast, and right for "auto", but an explicit
    # --precision fp32 (parity checks against the CPU reference) must get true fp32, even when an
    # earlier run in this process (a test session, a notebook) turned TF32 on
    set_tf32(config.precision != "fp32")
    return DeviceSetup(torch.device(DEVICE_TYPE, config.local_rank), local_rank=config.local_rank)


@cuda_hookimpl
def vlft_attention_implementation(backend, config, model_config):
    asked = parse_attn(config.attn) or {}
    fa_ok, fa_why = flash_attn_status()
    cap = capability(config)
    for impl in asked.values():
        if impl != "flash_attention_2":
            continue
        if not fa_ok:
            raise ConfigError(
                f"--attn {config.attn}: {fa_why}; pip install flash-attn --no-build-isolation, or use sdpa"
            )
        if cap is not None and cap < BF16_CAPABILITY:
            raise ConfigError(
                f"--attn {config.attn}: flash_attention_2 needs compute capability 8.0 or newer; "
                f"this GPU has {cap[0]}.{cap[1]}: use sdpa"
            )
    if not fa_ok:
        default, why = "sdpa", f"sdpa: {fa_why}"
    elif cap is not None and cap < BF16_CAPABILITY:
        default, why = "sdpa", f"sdpa: {fa_why} present, but compute capability {cap[0]}.{cap[1]} < 8.0"
    elif config.precision == "fp32":
        default, why = "sdpa", "sdpa: flash-attention needs fp16/bf16 and fp32 was asked"
    else:
        default = "flash_attention_2"
        why = f"flash_attention_2: {fa_why}" + (
            ", compute capability >= 8.0 assumed (no GPU visible here)"
            if cap is None
            else f", compute capability {cap[0]}.{cap[1]}"
        )
    if asked:
        why = "as asked; default " + why
    text = asked.get("text", default)
    # packing: flash_attention_2 runs varlen (cu_seqlens from the text position row), sdpa/eager per sample
    packing, packing_why = AttentionPolicy(text, text).packing_path()
    return AttentionPolicy(asked.get("vision", default), text, why, packing=packing, packing_reason=packing_why)


def _make_scaler(init_scale: float, growth_interval: int):
    import torch

    return torch.amp.GradScaler("cuda", init_scale=init_scale, growth_interval=growth_interval)


def _fp16(reason: str) -> PrecisionPolicy:
    # half-precision base weights halve the memory of the frozen model; adapters stay fp32
    return PrecisionPolicy(
        "fp16",
        param_dtype="float16",
        autocast_dtype="float16",
        loss_scaling=True,
        init_scale=LOSS_SCALE,
        growth_interval=GROWTH_INTERVAL,
        reason=reason,
        param_reason="fp16 weights, matching fp16 compute",
        make_scaler=functools.partial(_make_scaler, LOSS_SCALE, GROWTH_INTERVAL),
    )


def _four_bit() -> tuple[bool, str]:
    """NF4 on CUDA: bitsandbytes' own home. Offered for planning where it is not installed (a dry run for a
    card elsewhere); loading the model then names the install."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return True, (
            "NF4 through bitsandbytes (CUDA kernels); it is not installed here: "
            "pip install 'vlft[qlora]' before a real run"
        )
    return True, "NF4 through bitsandbytes (CUDA kernels)"


@cuda_hookimpl
def vlft_precision_policy(backend, config):
    policy = _precision(config)
    policy.four_bit, policy.four_bit_reason = _four_bit()
    # torch's fused AdamW (with found_inf, as GradScaler uses it) runs on CUDA: the non-finite guard copies nothing
    policy.fused_optimizer = True
    return policy


def _precision(config):
    p = config.precision
    if p == "fp32":
        return PrecisionPolicy("fp32", reason="full precision, as asked", param_reason="fp32 weights for fp32 compute")
    if p == "fp16":
        return _fp16("fp16 autocast with dynamic loss scaling, as asked")
    if p not in ("auto", "bf16"):
        raise ConfigError(f"backend {NAME} does not support precision '{p}'")
    cap = capability(config)
    if cap is not None and cap < BF16_CAPABILITY:
        if p == "bf16":
            raise ConfigError(
                f"--precision bf16: this GPU (compute capability {cap[0]}.{cap[1]}) has no native "
                "bf16 (needs 8.0, Ampere or newer); use --precision fp16 or auto"
            )
        return _fp16(
            f"fp16 autocast with dynamic loss scaling: compute capability {cap[0]}.{cap[1]} < 8.0 has no native bf16"
        )
    if cap is None:
        why = (
            "bf16 autocast: compute capability >= 8.0 assumed (no GPU visible here); "
            "below 8.0 a run gets fp16 with dynamic loss scaling"
        )
    else:
        why = f"bf16 autocast: compute capability {cap[0]}.{cap[1]} computes bf16 natively"
    return PrecisionPolicy(
        "bf16",
        param_dtype="bfloat16",
        autocast_dtype="bfloat16",
        reason=why if p == "auto" else why + "; as asked",
        param_reason="bf16 weights (the checkpoints' own dtype), matching bf16 compute",
    )


@cuda_hookimpl
def vlft_dataloader_options(backend, config, options: DataLoaderOptions):
    options.pin_memory = True
    options.num_workers = 2
    options.prefetch_factor = 2
    options.reasons.append(
        "cuda: pinned host memory for asynchronous copies; 2 workers encode images while the GPU trains"
    )


@cuda_hookimpl
def vlft_distributed_options(backend, config):
    return DistributedOptions(
        "nccl",
        timeout_s=1800,
        reason="nccl is torch's process group for NVIDIA GPUs",
        fsdp=True,
        fsdp_reason="FSDP2 on nccl (ReduceOp.AVG in the reduce-scatter)",
    )


@cuda_hookimpl
def vlft_seed(backend, seed, deterministic):
    import torch

    torch.cuda.manual_seed_all(seed)  # lazy: safe before the device is initialised
    if deterministic:
        # read by cuBLAS when its first handle is made, so it must be set before the first matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)


# The CUDA context, cuBLAS workspaces and NCCL buffers live outside torch's allocator statistics.
CUDA_RESERVED = 1 * 2**30


@cuda_hookimpl
def vlft_device_capacity(backend, config):
    import torch

    try:
        if transfer_to_npu_loaded() or not torch.cuda.is_available():
            return DeviceCapacity(None, CUDA_RESERVED, "no GPU visible here")
        index = config.local_rank if config.local_rank < torch.cuda.device_count() else 0
        props = torch.cuda.get_device_properties(index)
        return DeviceCapacity(
            int(props.total_memory),
            CUDA_RESERVED,
            f"cuda:{index} {props.name}",
            peak_flops=peak_flops(props.name, config.precision),
        )
    except Exception as e:  # noqa: BLE001 - planning must not crash on a driver hiccup
        return DeviceCapacity(None, CUDA_RESERVED, f"cannot read the GPU's memory ({_first_line(e)})")


# dense (no sparsity) peak FLOP/s from the vendor's data sheets: (name fragment, bf16/fp16 tensor, fp32 tf32)
PEAK_FLOPS = (
    ("H200", 989e12, 494e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("A10G", 70e12, 35e12),
    ("L4", 121e12, 60e12),
)


def peak_flops(name: str, precision: str) -> float | None:
    """The card's dense peak at the run's precision (fp32 runs as TF32 is not assumed: its CUDA-core figure is
    not listed, so None), or None for a card not in ``PEAK_FLOPS``."""
    if precision == "fp32":
        return None
    for fragment, half, _ in PEAK_FLOPS:
        if fragment in name:
            return half
    return None


@cuda_hookimpl
def vlft_memory_reader(backend, device):
    import torch

    def read() -> MemoryStats:
        return MemoryStats(
            peak_bytes=int(torch.cuda.max_memory_allocated(device)),
            current_bytes=int(torch.cuda.memory_allocated(device)),
        )

    return read


@cuda_hookimpl
def vlft_doctor_checks(backend):
    try:
        return doctor_checks()
    except Exception as e:  # noqa: BLE001 - diagnosis must not crash
        return [DoctorCheck("cuda checks", False, f"failed unexpectedly ({_first_line(e)})")]


@cuda_hookimpl
def vlft_kernel_patches(backend, config, model_config, family):
    return kernel_patches(config, model_config, family)
