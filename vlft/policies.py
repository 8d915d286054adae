"""The policies a backend resolves once, at set-up, into plain dataclasses: attention, precision, data
loading, processes. The training step reads them; it calls no hooks. What each plugin kind answers besides
(backend, method, family, scorer, sink) is in ``vlft.contracts``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from vlft.contracts import changed


@dataclass(frozen=True)
class AttentionPolicy:
    """Attention implementation per tower ("eager", "sdpa", "flash_attention_2")."""

    vision: str
    text: str
    reason: str = ""
    # how the text attention keeps packed samples apart (``--packing``): "varlen" (flash-attention takes each
    # sample's bounds from the text position row), "segments" (sdpa or eager run per sample, see
    # ``models.segments``) or "" (it cannot: runs pad). None: derived from ``text`` (``packing_path``).
    packing: str | None = None
    packing_reason: str = ""

    def packing_path(self) -> tuple[str, str]:
        """("varlen" | "segments" | "", why): how packed samples are kept apart in the text attention."""
        if self.packing is not None:
            return self.packing, self.packing_reason or f"the backend says {self.packing or 'no packing'}"
        if self.text == "flash_attention_2":
            return "varlen", "flash_attention_2 finds each sample's bounds from the text position row"
        if self.text in ("sdpa", "eager"):
            return "segments", (f"{self.text} runs sample by sample, the row cut where its text position row restarts")
        return "", f"no known way for text attention '{self.text}' to keep packed samples apart"

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
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    reason: str = ""
    param_reason: str = ""  # why the base weights have ``param_dtype``
    # 4-bit NF4 base weights (QLoRA): whether this backend can train on them, and why (not); the backend's answer
    four_bit: bool = False
    four_bit_reason: str = ""
    quantization: str | None = None  # "nf4" once asked for and offered; linear weights then 4-bit
    double_quant: bool = False  # the per-block constants quantized again (8-bit, one fp32 per 256 blocks)
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


# What a plugin imported from here before plugin API 3, when this module held every contract: now in
# vlft.contracts, re-exported by vlft. An old import is told where, not left with "cannot import name".
_MOVED = frozenset(
    {
        "BackendInfo",
        "ProbeResult",
        "DeviceSetup",
        "MemoryStats",
        "DeviceCapacity",
        "KernelPatch",
        "DoctorCheck",
        "MethodInfo",
        "AdapterDefaults",
        "MetricSink",
        "Scorer",
        "Media",
        "Written",
        "ImageInputs",
        "VideoInputs",
        "Positions",
        "Packing",
        "Sharding",
        "Experts",
        "ModelFamily",
        "VisionWarmup",
        "processor_image_inputs",
        "Objective",
        "ObjectiveInfo",
        "Reward",
        "objective_help",
    }
)


def __getattr__(name: str):
    if name in _MOVED:
        change = changed("import", "vlft.policies.<contract>")
        assert change is not None  # CHANGES lists the move
        raise ImportError(change.line().replace("<contract>", name), name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
