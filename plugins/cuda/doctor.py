"""``vlft doctor --backend cuda``: the torch build, the driver, each GPU, flash-attn, the environment.

Imports inside functions: `vlft doctor` lists every backend's checks on any machine; torch loads only
when this backend's checks run.
"""

from __future__ import annotations

import os
import sys

from vlft import DoctorCheck

from .probing import (
    BF16_CAPABILITY,
    TORCH_CUDA_HINT,
    _first_line,
    driver_version,
    flash_attn_status,
    probe,
    transfer_to_npu_loaded,
)


def doctor_checks() -> list[DoctorCheck]:
    import torch

    checks: list[DoctorCheck] = []
    if torch.version.cuda:
        checks.append(DoctorCheck("torch build", True, f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}"))
    elif getattr(torch.version, "hip", None):
        checks.append(DoctorCheck("torch build", True, f"torch {torch.__version__}, ROCm {torch.version.hip}"))
    else:
        checks.append(
            DoctorCheck("torch build", False, f"torch {torch.__version__} is built without CUDA", TORCH_CUDA_HINT)
        )
    driver = driver_version()
    checks.append(
        DoctorCheck(
            "NVIDIA driver",
            driver is not None,
            driver or "not found (/proc/driver/nvidia/version)",
            "" if driver else "install the NVIDIA driver; `nvidia-smi` must list the GPU",
            blocking=False,
        )
    )
    if transfer_to_npu_loaded():
        checks.append(
            DoctorCheck(
                "transfer_to_npu",
                False,
                "torch_npu.contrib.transfer_to_npu is loaded: torch.cuda answers for the Ascend NPU",
                "remove that import; use --backend ascend",
            )
        )
    found = probe()
    if found.available:
        for i in range(found.device_count):
            try:
                cap = tuple(torch.cuda.get_device_capability(i))
                bf16 = "native bf16" if cap >= BF16_CAPABILITY else "no native bf16: fp16 with loss scaling"
                detail = f"{torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]} ({bf16})"
                checks.append(DoctorCheck(f"GPU {i}", True, detail))
            except Exception as e:  # noqa: BLE001 - the doctor reports a failing GPU and goes on
                checks.append(DoctorCheck(f"GPU {i}", False, _first_line(e), "check `nvidia-smi`"))
    else:
        checks.append(
            DoctorCheck(
                "GPUs",
                False,
                "none usable (see the reason above)",
                "`nvidia-smi` must list the GPU; check the driver and CUDA_VISIBLE_DEVICES",
            )
        )
    fa_ok, fa_why = flash_attn_status()
    checks.append(
        DoctorCheck(
            "flash-attn",
            fa_ok,
            fa_why + ("" if fa_ok else "; attention falls back to sdpa"),
            "" if fa_ok else "optional: pip install flash-attn --no-build-isolation (Ampere+)",
            blocking=False,
        )
    )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        checks.append(
            DoctorCheck(
                "CUDA_VISIBLE_DEVICES",
                False,
                "set but empty: hides every GPU",
                "unset CUDA_VISIBLE_DEVICES or list the GPUs (0,1,...)",
            )
        )
    elif visible is not None:
        checks.append(DoctorCheck("CUDA_VISIBLE_DEVICES", True, visible))
    if sys.modules.get("torch_npu") is not None:
        checks.append(
            DoctorCheck(
                "torch_npu",
                False,
                "loaded in this process next to CUDA",
                "set TORCH_DEVICE_BACKEND_AUTOLOAD=0, or uninstall torch_npu on GPU machines",
                blocking=False,
            )
        )
    return checks
