"""Plain answers that plugins give and the run uses.

Every concern a backend or method decides is resolved once, at set-up, into
one of these dataclasses. The training step reads them; it calls no hooks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class BackendInfo:
    """What ``vlft_backends()`` answers: one entry per backend a plugin offers."""

    name: str
    description: str
    device_type: str  # the torch device type: "cpu", "cuda", "npu", ...
    priority: int = 0  # ``--backend auto`` takes the available backend with the highest priority


@dataclass(frozen=True)
class MethodInfo:
    """What ``vlft_methods()`` answers: one entry per adapter method a plugin offers."""

    name: str
    description: str


@dataclass
class ProbeResult:
    """Whether a backend can run here; ``reason`` says why not, with the fix."""

    available: bool
    reason: str = ""
    device_count: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass
class DeviceSetup:
    """The device a process trains on, and the environment set for it."""

    device: Any  # torch.device
    local_rank: int = 0
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AttentionPolicy:
    """Attention implementation per tower ("eager", "sdpa", "flash_attention_2")."""

    vision: str
    text: str
    reason: str = ""

    def as_attn_implementation(self) -> str | dict[str, str]:
        """The value for ``from_pretrained(attn_implementation=...)``."""
        if self.vision == self.text:
            return self.text
        return {"vision_config": self.vision, "text_config": self.text, "": self.text}


@dataclass
class PrecisionPolicy:
    """Parameter dtype, autocast, and loss scaling.

    ``make_scaler`` builds the gradient scaler when ``loss_scaling`` is on;
    the backend owns it because each device has its own (torch.amp,
    torch.npu.amp, ...).
    """

    name: str  # "fp32", "bf16", "fp16"
    param_dtype: str = "float32"  # the frozen base weights; trainable (adapter) weights are always float32
    autocast_dtype: str | None = None  # None: no autocast
    loss_scaling: bool = False
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    reason: str = ""
    param_reason: str = ""  # why the base weights have ``param_dtype``
    # torch's fused AdamW runs on this device and skips a step on the device when told ``found_inf`` (as
    # GradScaler tells it): the non-finite guard then copies nothing (used on accelerators; the CPU reads the
    # flag on the host). False (the default) keeps the copy-and-restore guard, which the memory plan counts;
    # a backend says True only where it was tried
    fused_optimizer: bool = False
    make_scaler: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

    def describe(self) -> dict:
        d = asdict(self)
        d.pop("make_scaler")
        return d


@dataclass
class DataLoaderOptions:
    """Keyword arguments for ``torch.utils.data.DataLoader``; plugins may each add some."""

    pin_memory: bool = False
    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    reasons: list[str] = field(default_factory=list)

    def loader_kwargs(self) -> dict:
        kw: dict[str, Any] = {"pin_memory": self.pin_memory, "num_workers": self.num_workers}
        if self.num_workers > 0:
            kw["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                kw["prefetch_factor"] = self.prefetch_factor
        return kw


@dataclass
class DistributedOptions:
    """How processes talk: the process-group backend, its timeout and environment, and whether
    ``--shard fsdp`` (torch FSDP2) works on it.

    ``fsdp`` is False unless the backend says so: FSDP2 needs the process group's all-gather and
    reduce-scatter and DTensor support on the device, which a backend author has to have tried.
    ``fsdp_reason`` says why not (or any caveat); it is shown to a user who asks for sharding.
    """

    process_group_backend: str  # "gloo", "nccl", "hccl", ...
    timeout_s: int = 1800
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    fsdp: bool = False
    fsdp_reason: str = ""
    # FSDP2 averages gradients with ReduceOp.AVG where it can; a process group without a trustworthy AVG
    # asks it to reduce with SUM and divide by the world size itself (set_force_sum_reduction_for_comms)
    sum_reductions: bool = False


@dataclass
class MemoryStats:
    """Device memory figures in bytes, for reports; None where the device cannot tell."""

    peak_bytes: int | None = None
    current_bytes: int | None = None


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


@dataclass
class AdapterDefaults:
    """A method's hyper-parameters and where it adapts by default.

    ``text_modules`` and ``vision_modules`` are the leaf names of the linear
    layers to adapt inside text decoder layers and vision blocks; the shared
    target selection turns them into full module names.
    """

    method: str
    lr: float
    hyperparameters: dict[str, Any]
    text_modules: tuple[str, ...] = ()
    vision_modules: tuple[str, ...] = ()
    default_targets: str = "both"  # what ``--targets auto`` means for this method
    help: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


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


class MetricSink:
    """Where logged metrics go besides ``metrics.jsonl`` (``--report-to``): returned by ``vlft_metric_sink``.

    ``write`` receives each record ``metrics.jsonl`` receives (``step`` plus scalars); ``close`` is
    called once at the end of the run. A plain object: the training loop calls it without hooks.
    """

    def write(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
