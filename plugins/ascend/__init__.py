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
- torch_npu ``X.Y.Z[.postN]`` runs only on torch ``X.Y.Z``.

Importing this module imports neither torch nor torch_npu: torch_npu
without CANN raises at import (sometimes already inside ``import torch``,
through torch's device-backend autoload), so only the hooks import it,
inside ``try``. ``torch_npu.contrib.transfer_to_npu`` is never imported.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from pathlib import Path

from vlft.errors import ConfigError
from vlft.hookspecs import hookimpl
from vlft.policies import (
    AttentionPolicy, BackendInfo, DataLoaderOptions, DeviceCapacity, DeviceSetup, DistributedOptions, DoctorCheck,
    MemoryStats, PrecisionPolicy, ProbeResult,
)

NAME = "ascend"
DEVICE_TYPE = "npu"
PRIORITY = 20  # above cuda: transfer_to_npu makes torch.cuda claim the NPU, so the NPU is asked first

TRANSFER_TO_NPU = "torch_npu.contrib.transfer_to_npu"
# the pair the ``vlft[ascend]`` extra pins, and the CANN it needs (Ascend's compatibility table)
PINNED = {"torch": "2.9.0", "torch_npu": "2.9.0", "cann": "8.5.0"}
SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
INSTALL_HINT = (f"install CANN {PINNED['cann']}, {SET_ENV}, then pip install 'vlft[ascend]' "
                f"(torch {PINNED['torch']} + torch_npu {PINNED['torch_npu']}; see docs/backends.md)")
LOSS_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000
HCCL_CONNECT_DEFAULT = "1200"  # CANN's own default is 120 s: too short for large jobs to link up
HCCL_EXEC_DEFAULT = "1800"  # CANN's default, made explicit so the plan shows it


# -- versions and probing ------------------------------------------------------------

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
    return (f"torch_npu {npu_version} is built for torch {want}, but torch {torch_version} is installed; "
            f"torch and torch_npu must match exactly: pip install 'torch=={want}' (on x86 the CPU build, "
            f"--index-url https://download.pytorch.org/whl/cpu), or the torch_npu release for torch {have}")


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
        out.append("HCCL_OP_TIMEOUT is set, but CANN does not read it; the collective execution timeout "
                   "is HCCL_EXEC_TIMEOUT")
    if sys.modules.get(TRANSFER_TO_NPU) is not None:
        out.append("torch_npu.contrib.transfer_to_npu is loaded: it redirects torch.cuda calls to the NPU, so "
                   "CUDA checks in this process cannot be trusted; vlft does not need it")
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
        return ProbeResult(False, f"torch_npu is not installed: {INSTALL_HINT}", versions=versions,
                           warnings=warnings)
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
            False, f"`import torch` failed ({_first_line(e)}); torch imports torch_npu itself through its "
            f"device-backend autoload entry point, so a missing or unsourced CANN breaks `import torch`: "
            f"{SET_ENV}; to import torch without torch_npu meanwhile, set TORCH_DEVICE_BACKEND_AUTOLOAD=0",
            versions=versions, warnings=warnings)
    versions["torch"] = torch.__version__
    try:
        torch_npu = _import("torch_npu")
    except Exception as e:  # noqa: BLE001 - CANN missing: ImportError, RuntimeError, OSError ...
        return ProbeResult(
            False, f"torch_npu is installed but does not import ({_first_line(e)}): CANN is missing or its "
            f"environment is not set: {SET_ENV} (torch_npu {PINNED['torch_npu']} needs CANN {PINNED['cann']}); "
            "if `import torch` fails too, TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps it working meanwhile",
            versions=versions, warnings=warnings)
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
        return ProbeResult(False, "torch_npu imported but torch.npu is missing (a broken install): "
                           "pip install --force-reinstall torch_npu", versions=versions, warnings=warnings)
    try:
        available = bool(npu.is_available())
        count = int(npu.device_count()) if available else 0
    except Exception as e:  # noqa: BLE001 - driver errors surface here
        return ProbeResult(False, f"torch.npu cannot query devices ({_first_line(e)}): check `npu-smi info` "
                           "and the driver", versions=versions, warnings=warnings)
    if not available or count == 0:
        return ProbeResult(False, f"torch_npu {npu_version or ''} loads but sees no NPU ({_visible()}): check "
                           "`npu-smi info`, the driver, and that the container maps /dev/davinci*",
                           versions=versions, warnings=warnings)
    return ProbeResult(True, device_count=count, versions=versions, warnings=warnings)


def _npu():
    """``torch.npu``, importing torch_npu (set-up and real runs only, after the probe passed)."""
    import torch

    _import("torch_npu")
    return torch.npu


# -- CANN and driver versions, where they can be read ------------------------------------

def _toolkit_homes() -> list[Path]:
    homes = [os.environ.get(k) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")]
    homes += ["/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann",
              str(Path.home() / "Ascend" / "ascend-toolkit" / "latest")]
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
            from torch_npu.utils import get_cann_version  # CANN >= 8.1.RC1

            v = get_cann_version(module="CANN")
            if v:
                return str(v), "torch_npu.utils.get_cann_version"
        except Exception:  # noqa: BLE001 - older torch_npu, or a stand-in
            pass
    arch = platform.machine()
    for home in _toolkit_homes():
        for info in [home / f"{arch}-linux" / "ascend_toolkit_install.info",
                     *sorted(home.glob("*-linux/ascend_toolkit_install.info"))]:
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


# -- hooks ----------------------------------------------------------------------------

@hookimpl
def vlft_backends():
    return [BackendInfo(NAME, "Huawei Ascend NPU via torch_npu/CANN (eager attention, fp16 with loss scaling, hccl)",
                        DEVICE_TYPE, priority=PRIORITY)]


@hookimpl
def vlft_probe_backend(backend):
    if backend != NAME:
        return None
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - a probe must never raise
        return ProbeResult(False, f"probing the NPU failed unexpectedly ({_first_line(e)})")


@hookimpl
def vlft_setup_device(backend, config):
    if backend != NAME:
        return None
    import torch

    _npu().set_device(config.local_rank)
    return DeviceSetup(torch.device(DEVICE_TYPE, config.local_rank), local_rank=config.local_rank)


def attention_policy(config) -> AttentionPolicy:
    from vlft.config import parse_attn

    asked = parse_attn(config.attn) or {}
    vision, text = asked.get("vision", "eager"), asked.get("text", "eager")
    if not asked:
        why = "eager: flash-attention and SDPA paths fail or give NaN on some torch_npu versions"
    else:
        why = "as asked (the NPU default is eager)"
        if "flash_attention_2" in (vision, text):
            why += "; transformers runs flash_attention_2 on torch_npu's fused attention kernel"
    return AttentionPolicy(vision, text, why)


@hookimpl
def vlft_attention_implementation(backend, config, model_config):
    if backend != NAME:
        return None
    return attention_policy(config)


def _make_scaler(init_scale: float, growth_interval: int):
    """The NPU's own gradient scaler; imports torch_npu, so it is built only when training starts."""
    npu = _npu()
    return npu.amp.GradScaler(init_scale=init_scale, growth_interval=growth_interval)


@hookimpl
def vlft_precision_policy(backend, config):
    if backend != NAME:
        return None
    if config.precision in ("auto", "fp16"):
        return PrecisionPolicy(
            "fp16", param_dtype="float16", autocast_dtype="float16", loss_scaling=True, init_scale=LOSS_SCALE,
            growth_interval=GROWTH_INTERVAL, param_reason="fp16 weights, matching fp16 compute",
            reason=("fp16 autocast with dynamic loss scaling (torch.npu.amp.GradScaler); "
                    + ("the NPU default" if config.precision == "auto" else "as asked")),
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
                raise ConfigError(f"--precision bf16: this NPU ({name}) has no bf16 (Ascend 910A and 310P lack it); "
                                  "use --precision fp16 or auto")
            why = "bf16 autocast, as asked (torch.npu.is_bf16_supported())"
        return PrecisionPolicy("bf16", param_dtype="bfloat16", autocast_dtype="bfloat16", reason=why,
                               param_reason="bf16 weights, matching bf16 compute")
    raise ConfigError(f"backend {NAME} does not support precision '{config.precision}'")


def _device_name(npu) -> str:
    try:
        return str(npu.get_device_name(0))
    except Exception:  # noqa: BLE001
        return "unknown NPU"


@hookimpl
def vlft_dataloader_options(backend, config, options: DataLoaderOptions):
    if backend != NAME:
        return
    options.pin_memory = False
    options.num_workers = 2
    options.prefetch_factor = 2
    options.reasons.append("ascend: pin_memory off (pinned host memory is a known source of torch_npu failures); "
                           "2 workers encode images while the NPU trains")


@hookimpl
def vlft_distributed_options(backend, config):
    if backend != NAME:
        return None
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
        "hccl", timeout_s=timeout, env=env,
        reason=("hccl is torch_npu's process group; HCCL_CONNECT_TIMEOUT raised from CANN's 120 s, "
                "HCCL_EXEC_TIMEOUT bounds each collective (HCCL_OP_TIMEOUT is not read by CANN); "
                "choose devices with ASCEND_RT_VISIBLE_DEVICES"),
    )


@hookimpl
def vlft_seed(backend, seed, deterministic):
    if backend != NAME:
        return
    _npu().manual_seed_all(seed)
    if deterministic:
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("HCCL_DETERMINISTIC", "true")


# CANN's runtime, HCCL buffers and the operator workspace live outside torch_npu's allocator statistics.
NPU_RESERVED = 2 * 2 ** 30


@hookimpl
def vlft_device_capacity(backend, config):
    if backend != NAME:
        return None
    try:
        if not probe().available:
            return DeviceCapacity(None, NPU_RESERVED, "no NPU usable here")
        npu = _npu()
        index = config.local_rank if config.local_rank < npu.device_count() else 0
        props = npu.get_device_properties(index)
        return DeviceCapacity(int(props.total_memory), NPU_RESERVED, f"npu:{index} {props.name}")
    except Exception as e:  # noqa: BLE001 - planning must not crash on a driver hiccup
        return DeviceCapacity(None, NPU_RESERVED, f"cannot read the NPU's memory ({_first_line(e)})")


@hookimpl
def vlft_memory_reader(backend, device):
    if backend != NAME:
        return None
    npu = _npu()

    def read() -> MemoryStats:
        return MemoryStats(peak_bytes=int(npu.max_memory_allocated(device)),
                           current_bytes=int(npu.memory_allocated(device)))

    return read


def patch_attention(model, policy: AttentionPolicy) -> list[str]:
    """Switch every config of ``model`` still set to SDPA (or flash) to eager where ``policy`` chose eager.

    Attention layers read ``config._attn_implementation`` at each forward, so
    this reroutes them. Returns one line per patched config.
    """
    top = getattr(model, "config", None)
    vision_cfg = getattr(top, "vision_config", None)
    configs: dict[int, tuple[str, object]] = {}
    if top is not None:
        configs[id(top)] = ("model", top)
    for name, module in model.named_modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in configs:
            configs[id(cfg)] = (name, cfg)
    patched = []
    for name, cfg in configs.values():
        tower = "vision" if cfg is vision_cfg or "visual" in name.split(".") else "text"
        want = policy.vision if tower == "vision" else policy.text
        current = getattr(cfg, "_attn_implementation", None)
        if want != "eager" or current in (None, "eager"):
            continue
        if isinstance(getattr(type(cfg), "_attn_implementation", None), property):
            cfg._attn_implementation = {"": "eager"}  # transformers' setter: this config only, not its sub-configs
        else:
            cfg._attn_implementation = "eager"
        patched.append(f"{name} ({tower}): {current} attention -> eager")
    return patched


@hookimpl
def vlft_patch_model(backend, model, config, attention):
    if backend != NAME:
        return None
    return patch_attention(model, attention) or None


# -- doctor ----------------------------------------------------------------------------

def doctor_checks() -> list[DoctorCheck]:
    checks: list[DoctorCheck] = []
    installed = torch_npu_installed()
    npu_dist = _dist_version("torch_npu")
    torch_dist = _dist_version("torch")
    if not installed:
        checks.append(DoctorCheck("torch_npu", False, "not installed", INSTALL_HINT))
    else:
        checks.append(DoctorCheck("torch_npu", True, f"installed ({npu_dist or 'version unknown'})"))
        mismatch = version_mismatch(torch_dist, npu_dist)
        if mismatch:
            checks.append(DoctorCheck("torch/torch_npu versions", False, f"torch {torch_dist}, torch_npu {npu_dist}",
                                      f"pip install 'torch=={base_version(npu_dist)}' (x86: the +cpu build)"))
        elif torch_dist and npu_dist:
            checks.append(DoctorCheck("torch/torch_npu versions", True,
                                      f"torch {torch_dist} matches torch_npu {npu_dist}"))
        if "+cu" in (torch_dist or ""):
            checks.append(DoctorCheck(
                "torch build", False, f"torch {torch_dist} is a CUDA build; torch_npu expects the CPU build",
                f"pip install 'torch=={base_version(torch_dist)}+cpu' --index-url https://download.pytorch.org/whl/cpu",
                blocking=False))
    cann, where = cann_version()
    if cann:
        checks.append(DoctorCheck("CANN", True, f"{cann} ({where})"))
    else:
        checks.append(DoctorCheck("CANN", False, f"not found ({where})",
                                  f"install the CANN toolkit {PINNED['cann']}, then {SET_ENV}", blocking=False))
    if installed and not (os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")):
        checks.append(DoctorCheck("CANN environment", False, "ASCEND_TOOLKIT_HOME is unset: set_env.sh not sourced",
                                  SET_ENV, blocking=False))
    driver = driver_version()
    checks.append(DoctorCheck("NPU driver", driver is not None,
                              driver or "not found (/usr/local/Ascend/driver/version.info)",
                              "" if driver else "install the Ascend NPU driver and firmware; check `npu-smi info`",
                              blocking=False))
    found = probe()
    if found.available:
        checks.append(DoctorCheck("NPU devices", True, f"{found.device_count} visible ({_visible()})"))
    elif installed:
        checks.append(DoctorCheck("NPU devices", False, "none usable (see the reason above)",
                                  "`npu-smi info` must list the NPU; check CANN, the driver and "
                                  "ASCEND_RT_VISIBLE_DEVICES"))
    env_hccl = [(k, os.environ.get(k)) for k in ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")]
    for key, value in env_hccl:
        default = HCCL_CONNECT_DEFAULT if key == "HCCL_CONNECT_TIMEOUT" else HCCL_EXEC_DEFAULT
        if value is None:
            checks.append(DoctorCheck(key, True, f"unset; vlft sets {default} for multi-process runs"))
        elif not value.strip().isdigit():
            checks.append(DoctorCheck(key, False, f"{value!r} is not a number of seconds",
                                      f"export {key}={default}", blocking=False))
        else:
            checks.append(DoctorCheck(key, True, f"{value} s"))
    if os.environ.get("HCCL_OP_TIMEOUT"):
        checks.append(DoctorCheck("HCCL_OP_TIMEOUT", False,
                                  f"set to {os.environ['HCCL_OP_TIMEOUT']!r}, but CANN does not read it",
                                  "unset HCCL_OP_TIMEOUT; use HCCL_EXEC_TIMEOUT for the collective timeout",
                                  blocking=False))
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and os.environ.get("ASCEND_RT_VISIBLE_DEVICES") is None:
        checks.append(DoctorCheck("device visibility", False, "CUDA_VISIBLE_DEVICES is set; it does not select NPUs",
                                  "use ASCEND_RT_VISIBLE_DEVICES=0,1,... instead", blocking=False))
    if sys.modules.get(TRANSFER_TO_NPU) is not None:
        checks.append(DoctorCheck("transfer_to_npu", False, "torch_npu.contrib.transfer_to_npu is loaded; "
                                  "torch.cuda now answers for the NPU", "remove that import: vlft does not need it",
                                  blocking=False))
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0" and installed:
        checks.append(DoctorCheck("TORCH_DEVICE_BACKEND_AUTOLOAD", True,
                                  "0: `import torch` does not load torch_npu; vlft imports it itself"))
    return checks


@hookimpl
def vlft_doctor_checks(backend):
    if backend != NAME:
        return None
    try:
        return doctor_checks()
    except Exception as e:  # noqa: BLE001 - diagnosis must not crash
        return [DoctorCheck("ascend checks", False, f"failed unexpectedly ({_first_line(e)})")]
