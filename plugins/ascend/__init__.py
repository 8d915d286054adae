"""The Huawei Ascend NPU backend (torch_npu on CANN), device type ``npu``.

What the field learned, resolved once at set-up:

- attention ``eager`` (flash-attention and SDPA paths fail or give NaN on
  some torch_npu versions), per tower overridable with ``--attn``; where
  eager is chosen, ``vlft_patch_model`` switches any tower still set to
  SDPA back to eager;
- fp16 autocast with dynamic loss scaling (initial scale 2**16) through
  ``torch.npu.amp.GradScaler``; bf16 only on request, where the NPU has it;
- ``pin_memory=False``; ``hccl`` with ``HCCL_CONNECT_TIMEOUT`` raised and
  ``HCCL_EXEC_TIMEOUT`` (``HCCL_OP_TIMEOUT`` is not read by CANN);
- torch_npu ``X.Y.Z[.postN]`` runs only on torch ``X.Y.Z``;
- kernel patches (``kernels.py``): ``flash_attention_2`` on npu_fusion_attention per tower where torch_npu and
  transformers have it (eager stays otherwise, with the reason), cu_seqlens once per forward, fused
  RMSNorm / SwiGLU / rotary (opt-in), fp32 before FSDP2 sharding of bf16 weights; each listed in the plan.

Imports inside functions: importing this module imports neither torch nor torch_npu: torch_npu
without CANN raises at import (sometimes already inside ``import torch``,
through torch's device-backend autoload), so only the hooks import it,
inside ``try``. ``torch_npu.contrib.transfer_to_npu`` is never imported.
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

from . import probing  # noqa: F401 - tests reach the probe's internals through it
from .doctor import doctor_checks
from .kernels import kernel_patches
from .patching import patch_attention
from .probing import (  # noqa: F401 - re-exported: the package's public helpers
    HCCL_CONNECT_DEFAULT,
    HCCL_EXEC_DEFAULT,
    INSTALL_HINT,
    PINNED,
    TRANSFER_TO_NPU,
    _first_line,
    _npu,
    base_version,
    cann_version,
    probe,
    version_mismatch,
)

NAME = "ascend"
ascend_hookimpl = hookimpl_for(NAME)  # a backend hook that answers for "ascend" only, None for others
DEVICE_TYPE = "npu"
PRIORITY = 20  # above cuda: transfer_to_npu makes torch.cuda claim the NPU, so the NPU is asked first
LOSS_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


# -- hooks ----------------------------------------------------------------------------


@hookimpl
def vlft_backends():
    return [
        BackendInfo(
            NAME,
            "Huawei Ascend NPU via torch_npu/CANN (eager attention, fp16 with loss scaling, hccl)",
            DEVICE_TYPE,
            priority=PRIORITY,
        )
    ]


@ascend_hookimpl
def vlft_probe_backend(backend):
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - a probe must never raise
        return ProbeResult(False, f"probing the NPU failed unexpectedly ({_first_line(e)})")


@ascend_hookimpl
def vlft_setup_device(backend, config):
    import torch

    _npu().set_device(config.local_rank)
    return DeviceSetup(torch.device(DEVICE_TYPE, config.local_rank), local_rank=config.local_rank)


def attention_policy(config) -> AttentionPolicy:
    asked = parse_attn(config.attn) or {}
    vision, text = asked.get("vision", "eager"), asked.get("text", "eager")
    if not asked:
        why = "eager: flash-attention and SDPA paths fail or give NaN on some torch_npu versions"
    else:
        why = "as asked (the NPU default is eager)"
        if "flash_attention_2" in (vision, text):
            why += "; transformers runs flash_attention_2 on torch_npu's fused attention kernel"
    # packing: eager/sdpa run per sample (segments); flash_attention_2 (npu_fusion_attention) runs varlen from
    # the text position row, moving cu_seqlens to the host in every layer (a sync per layer)
    packing, packing_why = AttentionPolicy(text, text).packing_path()
    if packing == "varlen":
        packing_why += " (torch_npu moves cu_seqlens to the host in every layer: one sync per layer)"
    return AttentionPolicy(vision, text, why, packing=packing, packing_reason=packing_why)


@ascend_hookimpl
def vlft_attention_implementation(backend, config, model_config):
    return attention_policy(config)


def _make_scaler(init_scale: float, growth_interval: int):
    """The NPU's own gradient scaler; imports torch_npu, so it is built only when training starts."""
    npu = _npu()
    return npu.amp.GradScaler(init_scale=init_scale, growth_interval=growth_interval)


def _four_bit() -> tuple[bool, str]:
    """NF4 on Ascend: only where the installed bitsandbytes carries an NPU backend."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False, (
            "NF4 (QLoRA) needs bitsandbytes, whose kernels are CUDA (and CPU) ones; it is not installed, "
            "and Ascend needs a build with its NPU backend; use --param-dtype bf16 or fp16"
        )
    if importlib.util.find_spec("bitsandbytes.backends.npu") is None:
        return False, (
            "the installed bitsandbytes has no NPU backend (bitsandbytes.backends.npu): its 4-bit "
            "kernels do not run on Ascend; use --param-dtype bf16 or fp16"
        )
    return True, "NF4 through bitsandbytes' NPU backend"


@ascend_hookimpl
def vlft_precision_policy(backend, config):
    policy = _precision(config)
    policy.four_bit, policy.four_bit_reason = _four_bit()
    return policy


def _precision(config):
    if config.precision in ("auto", "fp16"):
        return PrecisionPolicy(
            "fp16",
            param_dtype="float16",
            autocast_dtype="float16",
            loss_scaling=True,
            init_scale=LOSS_SCALE,
            growth_interval=GROWTH_INTERVAL,
            param_reason="fp16 weights, matching fp16 compute",
            reason=(
                "fp16 autocast with dynamic loss scaling (torch.npu.amp.GradScaler); "
                + ("the NPU default" if config.precision == "auto" else "as asked")
            ),
            make_scaler=functools.partial(_make_scaler, LOSS_SCALE, GROWTH_INTERVAL),
        )
    if config.precision == "fp32":
        return PrecisionPolicy("fp32", reason="full precision, as asked", param_reason="fp32 weights for fp32 compute")
    if config.precision == "bf16":
        found = probe()
        if not found.available:
            why = "bf16 autocast, as asked; not checked here (NPU unavailable): 910B has bf16, 910A does not"
        else:
            npu = _npu()
            if not npu.is_bf16_supported():
                name = _device_name(npu)
                raise ConfigError(
                    f"--precision bf16: this NPU ({name}) has no bf16 (Ascend 910A and 310P lack it); "
                    "use --precision fp16 or auto"
                )
            why = "bf16 autocast, as asked (torch.npu.is_bf16_supported())"
        return PrecisionPolicy(
            "bf16",
            param_dtype="bfloat16",
            autocast_dtype="bfloat16",
            reason=why,
            param_reason="bf16 weights, matching bf16 compute",
        )
    raise ConfigError(f"backend {NAME} does not support precision '{config.precision}'")


def _device_name(npu) -> str:
    try:
        return str(npu.get_device_name(0))
    except Exception:  # noqa: BLE001 - the name is only for display
        return "unknown NPU"


@ascend_hookimpl
def vlft_dataloader_options(backend, config, options: DataLoaderOptions):
    options.pin_memory = False
    options.num_workers = 2
    options.prefetch_factor = 2
    options.reasons.append(
        "ascend: pin_memory off (pinned host memory is a known source of torch_npu failures); "
        "2 workers encode images while the NPU trains"
    )


@ascend_hookimpl
def vlft_distributed_options(backend, config):
    connect = os.environ.get("HCCL_CONNECT_TIMEOUT", HCCL_CONNECT_DEFAULT)
    execute = os.environ.get("HCCL_EXEC_TIMEOUT", HCCL_EXEC_DEFAULT)
    env = {"HCCL_CONNECT_TIMEOUT": connect, "HCCL_EXEC_TIMEOUT": execute}
    if config.deterministic:
        env["HCCL_DETERMINISTIC"] = os.environ.get("HCCL_DETERMINISTIC", "true")
    try:  # the process group must not give up before HCCL does
        timeout = max(1800, int(execute) + 60)
    except ValueError:
        timeout = 1800
    return DistributedOptions(
        "hccl",
        timeout_s=timeout,
        env=env,
        reason=(
            "hccl is torch_npu's process group; HCCL_CONNECT_TIMEOUT raised from CANN's 120 s, "
            "HCCL_EXEC_TIMEOUT bounds each collective (HCCL_OP_TIMEOUT is not read by CANN); "
            "choose devices with ASCEND_RT_VISIBLE_DEVICES"
        ),
        # FSDP2 runs on HCCL through torch_npu's DTensor support; HCCL's reduce ops are SUM/PROD/MAX/MIN
        # (no AVG or PreMulSum), so FSDP divides the summed gradients itself
        fsdp=True,
        sum_reductions=True,
        fsdp_reason="FSDP2 on hccl through torch_npu; gradients reduce with SUM (HCCL has no ReduceOp.AVG)",
    )


@ascend_hookimpl
def vlft_seed(backend, seed, deterministic):
    _npu().manual_seed_all(seed)
    if deterministic:
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("HCCL_DETERMINISTIC", "true")


# CANN's runtime, HCCL buffers and the operator workspace live outside torch_npu's allocator statistics.
NPU_RESERVED = 2 * 2**30


@ascend_hookimpl
def vlft_device_capacity(backend, config):
    try:
        if not probe().available:
            return DeviceCapacity(None, NPU_RESERVED, "no NPU usable here")
        npu = _npu()
        index = config.local_rank if config.local_rank < npu.device_count() else 0
        props = npu.get_device_properties(index)
        return DeviceCapacity(int(props.total_memory), NPU_RESERVED, f"npu:{index} {props.name}")
    except Exception as e:  # noqa: BLE001 - planning must not crash on a driver hiccup
        return DeviceCapacity(None, NPU_RESERVED, f"cannot read the NPU's memory ({_first_line(e)})")


@ascend_hookimpl
def vlft_memory_reader(backend, device):
    npu = _npu()

    def read() -> MemoryStats:
        return MemoryStats(
            peak_bytes=int(npu.max_memory_allocated(device)), current_bytes=int(npu.memory_allocated(device))
        )

    return read


@ascend_hookimpl
def vlft_patch_model(backend, model, config, attention, family):
    return patch_attention(model, attention, family) or None


@ascend_hookimpl
def vlft_doctor_checks(backend):
    try:
        return doctor_checks()
    except Exception as e:  # noqa: BLE001 - diagnosis must not crash
        return [DoctorCheck("ascend checks", False, f"failed unexpectedly ({_first_line(e)})")]


@ascend_hookimpl
def vlft_kernel_patches(backend, config, model_config, family):
    return kernel_patches(config, model_config, family)
