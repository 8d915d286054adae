"""Can this process use an Ascend NPU: torch_npu found, versions matched, CANN loaded, devices seen.

Imports inside functions: it never raises, and imports torch_npu only inside ``probe`` (and ``_npu``, after
a probe passed): torch_npu without CANN raises at import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from pathlib import Path

from vlft import ProbeResult

TRANSFER_TO_NPU = "torch_npu.contrib.transfer_to_npu"
# the pair the ``vlft[ascend]`` extra pins, and the CANN it needs (Ascend's compatibility table)
PINNED = {"torch": "2.9.0", "torch_npu": "2.9.0", "cann": "8.5.0"}
SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
HCCL_CONNECT_DEFAULT = "1200"  # CANN's own default is 120 s: too short for large jobs to link up
HCCL_EXEC_DEFAULT = "1800"  # CANN's default, made explicit so the plan shows it
INSTALL_HINT = (
    f"install CANN {PINNED['cann']}, {SET_ENV}, then pip install 'vlft[ascend]' "
    f"(torch {PINNED['torch']} + torch_npu {PINNED['torch_npu']}; see docs/backends.md)"
)


def _import(name: str):
    """``importlib.import_module``, kept apart so tests can make an import fail."""
    return importlib.import_module(name)


def base_version(version: str | None) -> str | None:
    """'2.6.0.post3' -> '2.6.0'; '2.6.0+cpu' -> '2.6.0'; None when there is no X.Y.Z."""
    m = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", version or "")
    return ".".join(m.groups()) if m else None


def version_mismatch(torch_version: str | None, npu_version: str | None) -> str | None:
    """The reason, with the fix, when torch_npu ``X.Y.Z[.postN]`` is paired with a torch other than ``X.Y.Z``."""
    want, have = base_version(npu_version), base_version(torch_version)
    if not want or not have or want == have:
        return None
    return (
        f"torch_npu {npu_version} is built for torch {want}, but torch {torch_version} is installed; "
        f"torch and torch_npu must match exactly: pip install 'torch=={want}' (on x86 the CPU build, "
        f"--index-url https://download.pytorch.org/whl/cpu), or the torch_npu release for torch {have}"
    )


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or a broken metadata folder
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def torch_npu_installed() -> bool:
    """Whether torch_npu can be found, without importing it."""
    if "torch_npu" in sys.modules:  # imported already (torch's autoload does that), or blocked (None)
        return sys.modules["torch_npu"] is not None
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def environment_warnings() -> list[str]:
    """Settings that look right and are not, for the probe and ``vlft doctor``."""
    out = []
    if os.environ.get("HCCL_OP_TIMEOUT"):
        out.append(
            "HCCL_OP_TIMEOUT is set, but CANN does not read it; the collective execution timeout is HCCL_EXEC_TIMEOUT"
        )
    if sys.modules.get(TRANSFER_TO_NPU) is not None:
        out.append(
            "torch_npu.contrib.transfer_to_npu is loaded: it redirects torch.cuda calls to the NPU, so "
            "CUDA checks in this process cannot be trusted; vlft does not need it"
        )
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and os.environ.get("ASCEND_RT_VISIBLE_DEVICES") is None:
        out.append("CUDA_VISIBLE_DEVICES is set but does not select NPUs; use ASCEND_RT_VISIBLE_DEVICES")
    return out


def _visible() -> str:
    value = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    return f"ASCEND_RT_VISIBLE_DEVICES={value!r}" if value is not None else "ASCEND_RT_VISIBLE_DEVICES unset"


def probe() -> ProbeResult:
    """Can this process train on an Ascend NPU? Never raises; imports torch_npu only when it is installed."""
    warnings = environment_warnings()
    versions: dict[str, str] = {}
    if not torch_npu_installed():
        return ProbeResult(False, f"torch_npu is not installed: {INSTALL_HINT}", versions=versions, warnings=warnings)
    # versions first, from package metadata: a mismatched torch_npu may crash when imported
    npu_version, torch_version = _dist_version("torch_npu"), _dist_version("torch")
    for key, value in (("torch", torch_version), ("torch_npu", npu_version)):
        if value:
            versions[key] = value
    mismatch = version_mismatch(torch_version, npu_version)
    if mismatch:
        return ProbeResult(False, mismatch, versions=versions, warnings=warnings)
    try:
        torch = _import("torch")
    except Exception as e:  # noqa: BLE001 - with torch_npu installed, `import torch` loads it through autoload
        return ProbeResult(
            False,
            f"`import torch` failed ({_first_line(e)}); torch imports torch_npu itself through its "
            f"device-backend autoload entry point, so a missing or unsourced CANN breaks `import torch`: "
            f"{SET_ENV}; to import torch without torch_npu meanwhile, set TORCH_DEVICE_BACKEND_AUTOLOAD=0",
            versions=versions,
            warnings=warnings,
        )
    versions["torch"] = torch.__version__
    try:
        torch_npu = _import("torch_npu")
    except Exception as e:  # noqa: BLE001 - CANN missing: ImportError, RuntimeError, OSError ...
        return ProbeResult(
            False,
            f"torch_npu is installed but does not import ({_first_line(e)}): CANN is missing or its "
            f"environment is not set: {SET_ENV} (torch_npu {PINNED['torch_npu']} needs CANN {PINNED['cann']}); "
            "if `import torch` fails too, TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps it working meanwhile",
            versions=versions,
            warnings=warnings,
        )
    npu_version = npu_version or getattr(torch_npu, "__version__", None)
    if npu_version:
        versions["torch_npu"] = npu_version
    mismatch = version_mismatch(torch.__version__, npu_version)
    if mismatch:
        return ProbeResult(False, mismatch, versions=versions, warnings=warnings)
    cann, _ = cann_version(torch_npu)
    if cann:
        versions["cann"] = cann
    npu = getattr(torch, "npu", None)
    if npu is None:
        return ProbeResult(
            False,
            "torch_npu imported but torch.npu is missing (a broken install): pip install --force-reinstall torch_npu",
            versions=versions,
            warnings=warnings,
        )
    try:
        available = bool(npu.is_available())
        count = int(npu.device_count()) if available else 0
    except Exception as e:  # noqa: BLE001 - driver errors surface here
        return ProbeResult(
            False,
            f"torch.npu cannot query devices ({_first_line(e)}): check `npu-smi info` and the driver",
            versions=versions,
            warnings=warnings,
        )
    if not available or count == 0:
        return ProbeResult(
            False,
            f"torch_npu {npu_version or ''} loads but sees no NPU ({_visible()}): check "
            "`npu-smi info`, the driver, and that the container maps /dev/davinci*",
            versions=versions,
            warnings=warnings,
        )
    return ProbeResult(True, device_count=count, versions=versions, warnings=warnings)


def _npu():
    """``torch.npu``, importing torch_npu (set-up and real runs only, after the probe passed)."""
    import torch

    _import("torch_npu")
    return torch.npu  # pyright: ignore[reportAttributeAccessIssue]  # torch_npu adds torch.npu on import


# -- CANN and driver versions, where they can be read ------------------------------------


def _toolkit_homes() -> list[Path]:
    homes = [os.environ.get(k) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")]
    homes += [
        "/usr/local/Ascend/ascend-toolkit/latest",
        "/usr/local/Ascend/cann",
        str(Path.home() / "Ascend" / "ascend-toolkit" / "latest"),
    ]
    seen, out = set(), []
    for h in homes:
        if h and h not in seen:
            seen.add(h)
            out.append(Path(h))
    return out


def _read_key(path: Path, key: str) -> str | None:
    try:
        for line in path.read_text(errors="replace").splitlines():
            k, sep, v = line.partition("=")
            if sep and k.strip().lower() == key.lower():
                return v.strip().strip("[]") or None
    except OSError:
        return None
    return None


def cann_version(torch_npu=None) -> tuple[str | None, str]:
    """(CANN version, where it was read), or (None, what was looked at)."""
    if torch_npu is not None:
        try:
            from torch_npu.utils import get_cann_version  # pyright: ignore[reportMissingImports]  # CANN >= 8.1.RC1, on an NPU host only

            v = get_cann_version(module="CANN")
            if v:
                return str(v), "torch_npu.utils.get_cann_version"
        except Exception:  # noqa: BLE001 - older torch_npu, or a stand-in
            pass
    arch = platform.machine()
    for home in _toolkit_homes():
        for info in [
            home / f"{arch}-linux" / "ascend_toolkit_install.info",
            *sorted(home.glob("*-linux/ascend_toolkit_install.info")),
        ]:
            v = _read_key(info, "version")
            if v:
                return v, str(info)
    return None, "no ascend_toolkit_install.info under " + ", ".join(str(h) for h in _toolkit_homes())


def driver_version() -> str | None:
    for path in (Path("/usr/local/Ascend/driver/version.info"),):
        v = _read_key(path, "Version")
        if v:
            return v
    return None
