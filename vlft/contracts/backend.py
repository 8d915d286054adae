"""What a backend plugin answers: the backends it offers, whether one runs here, its device, memory figures,
diagnosis lines and kernel patches. The run's policies (attention, precision, data loading, processes) are in
``vlft.policies``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlft.contracts import contract


@contract
@dataclass(frozen=True)
class BackendInfo:
    """What ``vlft_backends()`` answers: one entry per backend a plugin offers."""

    name: str
    description: str
    device_type: str  # the torch device type: "cpu", "cuda", "npu", ...
    priority: int = 0  # ``--backend auto`` takes the available backend with the highest priority


@contract
@dataclass
class ProbeResult:
    """Whether a backend can run here; ``reason`` says why not, with the fix."""

    available: bool
    reason: str = ""
    device_count: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@contract
@dataclass
class DeviceSetup:
    """The device a process trains on, and the environment set for it."""

    device: Any  # torch.device
    local_rank: int = 0
    env: dict[str, str] = field(default_factory=dict)


@contract
@dataclass
class MemoryStats:
    """Device memory figures in bytes, for reports; None where the device cannot tell."""

    peak_bytes: int | None = None
    current_bytes: int | None = None


@contract
@dataclass
class DeviceCapacity:
    """How much memory one process's device offers, for the memory plan.

    ``total_bytes`` None means the backend cannot tell here (a dry run for a
    device this machine lacks); ``--device-memory`` then supplies it.
    ``reserved_bytes`` is what the runtime itself takes outside the tensors
    vlft counts (CUDA context, cuBLAS workspace, HCCL buffers, interpreter).
    """

    total_bytes: int | None
    reserved_bytes: int = 0
    source: str = ""
    # the device's dense peak FLOP/s at the run's compute dtype, where the backend knows it: the model FLOPs
    # utilisation (MFU) in metrics.jsonl is given against it, and left out where it is None
    peak_flops: float | None = None


@contract
@dataclass(frozen=True)
class KernelPatch:
    """One faster kernel a backend offers for a model (``vlft_kernel_patches``): declared at plan time,
    chosen or declined there (``--kernels``), applied once to the loaded base model.

    ``available`` says whether its ``condition`` holds here and ``reason`` says why or why not (the
    versions, the capability, the package found or missing). ``default`` False keeps an available patch off
    under ``--kernels auto`` (the user names it to take it); ``reason`` then says why it is opt-in.
    ``attention`` is a per-tower attention implementation (``{"vision": "flash_attention_2"}``) the model
    must be loaded with for the patch; ``apply(model)`` rewrites the loaded base model in place (before the
    adapter and before it moves to the device) and returns one line saying what it changed. ``check`` names
    the test that shows the patch equal to what it replaces (empty where none can run here).
    """

    name: str  # what ``--kernels NAME`` selects, e.g. "linear-patch-embed"
    replaces: str  # what it replaces, e.g. "Conv3d patch embedding"
    why: str  # the measured reason to take it
    condition: str  # when it applies: package, version, device capability, model
    available: bool  # the condition holds here
    reason: str = ""  # why it is (not) available here
    default: bool = True  # taken by ``--kernels auto`` when available
    attention: dict = field(default_factory=dict, compare=False)  # tower -> implementation it needs
    apply: Callable[[Any], str] | None = field(default=None, repr=False, compare=False)
    check: str = ""  # the equivalence test (file::name), where one exists
    backend: str = ""  # the backend that offers it

    def describe(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "name",
                "replaces",
                "why",
                "condition",
                "available",
                "reason",
                "default",
                "attention",
                "check",
                "backend",
            )
        }


@contract
@dataclass
class DoctorCheck:
    """One line of ``vlft doctor``: what was checked, whether it is fine, and the one-line fix when not.

    ``blocking`` False marks advice (say, a suspicious environment variable)
    that does not by itself stop the backend from running.
    """

    name: str
    ok: bool
    detail: str
    fix: str = ""
    blocking: bool = True
