"""``vlft doctor --backend ascend``: torch and torch_npu versions, CANN, the driver, devices, environment."""

from __future__ import annotations

import os
import sys

from vlft import DoctorCheck

from . import probing
from .probing import (
    HCCL_CONNECT_DEFAULT,
    HCCL_EXEC_DEFAULT,
    INSTALL_HINT,
    PINNED,
    SET_ENV,
    TRANSFER_TO_NPU,
    _visible,
    base_version,
    cann_version,
    driver_version,
    probe,
    torch_npu_installed,
    version_mismatch,
)


def doctor_checks() -> list[DoctorCheck]:
    checks: list[DoctorCheck] = []
    installed = torch_npu_installed()
    npu_dist = probing._dist_version("torch_npu")
    torch_dist = probing._dist_version("torch")
    if not installed:
        checks.append(DoctorCheck("torch_npu", False, "not installed", INSTALL_HINT))
    else:
        checks.append(DoctorCheck("torch_npu", True, f"installed ({npu_dist or 'version unknown'})"))
        mismatch = version_mismatch(torch_dist, npu_dist)
        if mismatch:
            checks.append(
                DoctorCheck(
                    "torch/torch_npu versions",
                    False,
                    f"torch {torch_dist}, torch_npu {npu_dist}",
                    f"pip install 'torch=={base_version(npu_dist)}' (x86: the +cpu build)",
                )
            )
        elif torch_dist and npu_dist:
            checks.append(
                DoctorCheck("torch/torch_npu versions", True, f"torch {torch_dist} matches torch_npu {npu_dist}")
            )
        if "+cu" in (torch_dist or ""):
            checks.append(
                DoctorCheck(
                    "torch build",
                    False,
                    f"torch {torch_dist} is a CUDA build; torch_npu expects the CPU build",
                    f"pip install 'torch=={base_version(torch_dist)}+cpu' --index-url https://download.pytorch.org/whl/cpu",
                    blocking=False,
                )
            )
    cann, where = cann_version()
    if cann:
        checks.append(DoctorCheck("CANN", True, f"{cann} ({where})"))
    else:
        checks.append(
            DoctorCheck(
                "CANN",
                False,
                f"not found ({where})",
                f"install the CANN toolkit {PINNED['cann']}, then {SET_ENV}",
                blocking=False,
            )
        )
    if installed and not (os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")):
        checks.append(
            DoctorCheck(
                "CANN environment",
                False,
                "ASCEND_TOOLKIT_HOME is unset: set_env.sh not sourced",
                SET_ENV,
                blocking=False,
            )
        )
    driver = driver_version()
    checks.append(
        DoctorCheck(
            "NPU driver",
            driver is not None,
            driver or "not found (/usr/local/Ascend/driver/version.info)",
            "" if driver else "install the Ascend NPU driver and firmware; check `npu-smi info`",
            blocking=False,
        )
    )
    found = probe()
    if found.available:
        checks.append(DoctorCheck("NPU devices", True, f"{found.device_count} visible ({_visible()})"))
    elif installed:
        checks.append(
            DoctorCheck(
                "NPU devices",
                False,
                "none usable (see the reason above)",
                "`npu-smi info` must list the NPU; check CANN, the driver and ASCEND_RT_VISIBLE_DEVICES",
            )
        )
    env_hccl = [(k, os.environ.get(k)) for k in ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")]
    for key, value in env_hccl:
        default = HCCL_CONNECT_DEFAULT if key == "HCCL_CONNECT_TIMEOUT" else HCCL_EXEC_DEFAULT
        if value is None:
            checks.append(DoctorCheck(key, True, f"unset; vlft sets {default} for multi-process runs"))
        elif not value.strip().isdigit():
            checks.append(
                DoctorCheck(
                    key, False, f"{value!r} is not a number of seconds", f"export {key}={default}", blocking=False
                )
            )
        else:
            checks.append(DoctorCheck(key, True, f"{value} s"))
    if os.environ.get("HCCL_OP_TIMEOUT"):
        checks.append(
            DoctorCheck(
                "HCCL_OP_TIMEOUT",
                False,
                f"set to {os.environ['HCCL_OP_TIMEOUT']!r}, but CANN does not read it",
                "unset HCCL_OP_TIMEOUT; use HCCL_EXEC_TIMEOUT for the collective timeout",
                blocking=False,
            )
        )
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and os.environ.get("ASCEND_RT_VISIBLE_DEVICES") is None:
        checks.append(
            DoctorCheck(
                "device visibility",
                False,
                "CUDA_VISIBLE_DEVICES is set; it does not select NPUs",
                "use ASCEND_RT_VISIBLE_DEVICES=0,1,... instead",
                blocking=False,
            )
        )
    if sys.modules.get(TRANSFER_TO_NPU) is not None:
        checks.append(
            DoctorCheck(
                "transfer_to_npu",
                False,
                "torch_npu.contrib.transfer_to_npu is loaded; torch.cuda now answers for the NPU",
                "remove that import: vlft does not need it",
                blocking=False,
            )
        )
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0" and installed:
        checks.append(
            DoctorCheck(
                "TORCH_DEVICE_BACKEND_AUTOLOAD",
                True,
                "0: `import torch` does not load torch_npu; vlft imports it itself",
            )
        )
    return checks
