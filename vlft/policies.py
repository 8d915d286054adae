"""The policies a backend resolves once, at set-up, into plain dataclasses: attention, precision, data
loading, processes. The training step reads them; it calls no hooks. What each plugin kind answers besides
(backend, method, family, scorer, sink) is in ``vlft.contracts``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vlft.contracts import changed


@dataclass(frozen=True)
class ObjectiveInfo:
    """What ``vlft_objectives()`` answers: one entry per training objective a plugin offers (``--objective``)."""

    name: str
    description: str


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
            return "segments", (f"{self.text} runs sample by sample, the row cut where its text position row "
                                f"restarts")
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
    init_scale: float = 2.0 ** 16
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


# -- objectives ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Objective:
    """What a run optimises (``--objective``), answered once at plan time by ``vlft_objective``.

    The core reads its fields and calls its callables; the training step calls no hook. A callable left None
    is the supervised default, today's ``sft``: conversation records, one row per record, the next-token loss
    summed over label tokens and averaged over the step's label tokens. ``objective_help()`` lists the fields.
    """

    name: str = field(metadata={"help": "What `--objective` selects, e.g. 'dpo'."})
    description: str = field(default="", metadata={"help": "One line for `vlft objectives` and the plan."})
    options: dict = field(default_factory=dict, compare=False, metadata={
        "help": "The objective's resolved options, shown in the plan and written to plan.json ({'beta': 0.1})."})
    help: dict = field(default_factory=dict, compare=False, metadata={
        "help": "One line per option, for `vlft objectives`."})
    layout: str = field(default="conversations: user turns and the assistant replies to learn", metadata={
        "help": "The record layout it trains on, in words (the plan and `vlft objectives` show it)."})
    parse: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "parse(obj, add_placeholders) -> a parsed record (vlft.data.formats.Parsed), for each JSON object "
                "of a data file: its layout and checks, raising FormatProblem with what to fix (reported as "
                "file:line before step 1). None: the conversation layouts of README 'Data'."})
    encoder: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "encoder(sample_encoder) -> the encoder of this objective's samples: its encode(record) gives one "
                "sample (DPO: chosen and rejected sharing the images, processed once) and its "
                "measure_labelled(record) the longest row's (tokens, grids, labelled), for --max-length and the "
                "memory plan. None: the sample encoder itself."})
    collate: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "collate(row_collator) -> the batch builder, given the collator of plain rows (padding). None: "
                "the row collator."})
    rows_per_record: int = field(default=1, metadata={
        "help": "Sequences the model runs per record (DPO: 2, chosen and rejected); the memory plan counts them."})
    average_over: str = field(default="label tokens", metadata={
        "help": "What the step's loss is averaged over, over every micro-batch and process: 'label tokens' or "
                "'records' (the batch's 'records' count, e.g. DPO's pairs)."})
    loss: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "loss(model, batch, autocast, reference) -> (loss summed over the batch's units, {figure: sum "
                "over the batch's units}) from a batch on the device; `reference()` is a context manager "
                "giving the reference model (no gradients, adapter off or the --init-adapter weights). "
                "None: the next-token loss over label tokens."})
    figures: tuple[str, ...] = field(default=(), metadata={
        "help": "The figures `loss` returns, logged as means over the units (metrics.jsonl, --report-to) and, "
                "as val_<figure>, in validation."})
    reference: str = field(default="", metadata={
        "help": "What the reference pass is, in words, where the loss uses one ('' none): the plan shows it "
                "and the memory plan counts the --init-adapter copy it keeps."})
    demo_data: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "demo_data(folder) -> (train, val) data files of the embedded demo task in this objective's "
                "layout, for a run without --data. None: the product-inspection conversations."})
    demo_epochs: float | None = field(default=None, metadata={
        "help": "Epochs on the demo data when neither --epochs nor --steps is given (None: the SFT default)."})
    packing_refusal: str = field(default="", metadata={
        "help": "Why --packing cannot lay this objective's rows out, or '' where it can (auto then pads)."})
    sharding_refusal: str = field(default="", metadata={
        "help": "Why --shard fsdp cannot run this objective, or '' where it can (the run stops before any "
                "process starts otherwise)."})
    notes: tuple[str, ...] = field(default=(), metadata={"help": "Lines for the plan."})
    check: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "check(records) -> ['file:line: problem', ...]: what the objective checks of the records as read "
                "(GRPO: every reward scores every reference), every run before step 1 and outside the cached "
                "data check (it may run the user's code, which can change while the data does not); any "
                "problem stops the run with the list, nothing written. None: nothing more."})
    rollout: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "rollout(model, host_batches, device, autocast) -> (device batches, units): what the step runs "
                "before the loss, once per step over all its micro-batches (GRPO: sample completions with the "
                "model and score them), and this process's count of the units the loss is averaged over (known "
                "only then: GRPO's completion tokens). None: the batches move to the device as they are."})
    iterations: int = field(default=1, metadata={
        "help": "Steps each rollout is trained on (GRPO's --num-iterations): the data order draws a step's "
                "prompts for that many steps in a row and the step reuses the rollout's batches, sampled once, "
                "so the loss sees the same batch dicts again (GRPO keeps its first pass's log-probabilities on "
                "them as the old policy's). A run resumed inside a rollout samples its prompts afresh."})
    figure_units: dict = field(default_factory=dict, compare=False, metadata={
        "help": "{figure: what its mean is over}: another figure that counts its units (GRPO's 'reward' over "
                "'completions'), or 'steps' (per process and step: a count, a time); figures not named are "
                "means over the loss's units."})
    dropout: bool = field(default=True, metadata={
        "help": "Whether the trained pass keeps the model's dropout (the adapter's lora_dropout). False: every "
                "dropout layer is off for the whole run (TRL's disable_dropout), so the trained pass computes what "
                "the reference pass and generation compute (both in evaluation mode): for DPO and GRPO, whose "
                "losses compare the trained pass with those, step 1's KL to an --init-adapter reference is 0 and "
                "GRPO's gradient is that of the policy that sampled."})
    generation: dict = field(default_factory=dict, compare=False, metadata={
        "help": "What the step generates, for the memory plan: {'sequences_per_record': G, 'new_tokens': T} "
                "({} none): the plan counts the KV cache of the step's G x batch sequences."})

    @property
    def supervised(self) -> bool:
        """The default: the next-token loss over label tokens (what ``sft`` answers)."""
        return self.loss is None

    def describe(self) -> dict:
        """Plain data for the plan and `vlft objectives` (callables left out)."""
        return {"name": self.name, "description": self.description, "options": dict(self.options),
                "layout": self.layout, "rows_per_record": self.rows_per_record, "average_over": self.average_over,
                "figures": list(self.figures), "reference": self.reference, "notes": list(self.notes),
                "dropout": self.dropout,
                **({"generation": dict(self.generation)} if self.generation else {})}


@dataclass(frozen=True)
class Reward:
    """What ``vlft_rewards()`` answers: one reward function a plugin offers to reward objectives (``--reward
    NAME`` or ``--reward NAME=ARGUMENT``).

    ``build(argument)`` is called once at plan time (``argument`` None when not given) and returns the
    function, ``function(completions, references, **context) -> list[float]``: one number per completion, the
    reference being the record's assistant reply; ``context`` holds ``where`` (each completion's record,
    ``file:line``) and may grow, so accept ``**context``. Raise ``ConfigError`` from ``build`` for a bad
    argument. A reward that cannot score a record (a reference it cannot read) should raise: every reward runs
    on every record's reference before step 1, and a record it raises on is reported as ``file:line``."""

    name: str
    description: str
    build: Callable[[str | None], Callable[..., list]] = field(compare=False)
    argument: str = ""  # what NAME=ARGUMENT takes, in words ('' none)


def objective_help() -> dict[str, str]:
    """Each ``Objective`` field's help (docs/plugin-hooks.md lists them; a docs test checks)."""
    return {f.name: f.metadata.get("help", "") for f in fields(Objective)}


# What a plugin imported from here before plugin API 3, when this module held every contract: now in
# vlft.contracts, re-exported by vlft. An old import is told where, not left with "cannot import name".
_MOVED = frozenset({
    "BackendInfo", "ProbeResult", "DeviceSetup", "MemoryStats", "DeviceCapacity", "KernelPatch", "DoctorCheck",
    "MethodInfo", "AdapterDefaults", "MetricSink", "Scorer", "Media", "Written", "ImageInputs", "VideoInputs",
    "Positions", "Packing", "Sharding", "Experts", "ModelFamily", "VisionWarmup", "processor_image_inputs",
})


def __getattr__(name: str):
    if name in _MOVED:
        change = changed("import", "vlft.policies.<contract>")
        assert change is not None  # CHANGES lists the move
        raise ImportError(change.line().replace("<contract>", name), name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
