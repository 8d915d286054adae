"""Can this process use an NVIDIA GPU, and which one: probing without side effects (never raises).

Imports inside functions: the probe runs for `vlft plugins` and `--backend auto` on machines without a GPU
too, and importing this module must not load torch (nor initialise CUDA).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from vlft import ProbeResult

TRANSFER_TO_NPU = "torch_npu.contrib.transfer_to_npu"
BF16_CAPABILITY = (8, 0)  # Ampere: native bf16 and flash-attention 2
FLASH_ATTN_MIN = (2, 3, 3)  # the oldest flash-attn 2 that transformers accepts
TORCH_CUDA_HINT = (
    "pip install torch --index-url https://download.pytorch.org/whl/cu128 (pick the CUDA version your driver supports)"
)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


def transfer_to_npu_loaded() -> bool:
    return sys.modules.get(TRANSFER_TO_NPU) is not None


def driver_version() -> str | None:
    """The NVIDIA kernel driver version, where Linux shows it."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return m.group(1) if m else None


def flash_attn_status() -> tuple[bool, str]:
    """(usable, why): does the flash-attn 2 package import, at a version transformers accepts?"""
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, "the flash-attn package is not installed"
    try:
        module = importlib.import_module("flash_attn")
    except Exception as e:  # noqa: BLE001 - a build for another torch fails with undefined symbols
        return False, f"flash-attn is installed but does not import ({_first_line(e)}); rebuild it for this torch"
    version = str(getattr(module, "__version__", ""))
    vt = _version_tuple(version)
    if vt is None or vt[0] != 2 or vt < FLASH_ATTN_MIN:
        return False, f"flash-attn {version or '(unknown version)'} is not the 2.x (>= 2.3.3) that transformers uses"
    return True, f"flash-attn {version}"


def probe() -> ProbeResult:
    """Can this process train on an NVIDIA GPU? Never raises."""
    import torch

    versions: dict[str, str] = {"torch": str(torch.__version__)}
    warnings: list[str] = []
    if torch.version.cuda:
        versions["cuda_runtime"] = torch.version.cuda
    if transfer_to_npu_loaded():
        return ProbeResult(
            False,
            "torch_npu.contrib.transfer_to_npu is loaded in this process: it redirects "
            "torch.cuda to the Ascend NPU, so torch.cuda.is_available() says nothing about NVIDIA "
            "GPUs; use --backend ascend (vlft needs no transfer_to_npu: remove that import)",
            versions=versions,
        )
    if sys.modules.get("torch_npu") is not None:
        warnings.append(
            "torch_npu is loaded in this process (torch autoloads it when installed); CUDA and "
            "torch_npu in one process are not supported: set TORCH_DEVICE_BACKEND_AUTOLOAD=0 or "
            "uninstall torch_npu on GPU machines"
        )
    if not torch.version.cuda and not getattr(torch.version, "hip", None):
        return ProbeResult(
            False,
            f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None): {TORCH_CUDA_HINT}",
            versions=versions,
            warnings=warnings,
        )
    try:
        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
    except Exception as e:  # noqa: BLE001 - a broken driver's error, whatever its class, is the probe's answer
        return ProbeResult(
            False, f"torch.cuda cannot query devices ({_first_line(e)})", versions=versions, warnings=warnings
        )
    driver = driver_version()
    if driver:
        versions["driver"] = driver
    if not available or count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
        cause = "no GPU visible" if driver else "no NVIDIA driver found"
        return ProbeResult(
            False,
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: {cause} ({where}); check `nvidia-smi`",
            versions=versions,
            warnings=warnings,
        )
    try:
        cap = tuple(torch.cuda.get_device_capability(0))
        versions["gpu"] = f"{torch.cuda.get_device_name(0)} (compute capability {cap[0]}.{cap[1]})"
        if cap < BF16_CAPABILITY:
            warnings.append(
                f"compute capability {cap[0]}.{cap[1]} < 8.0: no native bf16 and no flash-attention 2; "
                "fp16 with loss scaling and sdpa"
            )
    except Exception as e:  # noqa: BLE001 - an unreadable capability is a warning, not a failure
        warnings.append(f"cannot read the GPU's compute capability ({_first_line(e)})")
    return ProbeResult(True, device_count=count, versions=versions, warnings=warnings)


def capability(config=None) -> tuple[int, int] | None:
    """The compute capability of this process's GPU, or None where no GPU can be asked (a dry run elsewhere)."""
    import torch

    if transfer_to_npu_loaded():
        return None
    try:
        if not torch.cuda.is_available():
            return None
        count = torch.cuda.device_count()
        index = getattr(config, "local_rank", 0) if config is not None else 0
        return torch.cuda.get_device_capability(index if index < count else 0)
    except Exception:  # noqa: BLE001 - no readable capability means none known
        return None
