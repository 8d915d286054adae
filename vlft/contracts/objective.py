"""What an objective plugin answers: what a run optimises (``--objective``), its options, and its rewards.

An objective plugin answers two hooks. ``vlft_objectives()`` names what it offers (``ObjectiveInfo``: a name,
one line, and the class of its options). ``vlft_objective(objective, config, options, rewards)`` returns one
``Objective``, built once at plan time from its options as the user set them; the training step calls its
methods and no hook.

An ``Objective`` is a frozen dataclass with three methods a subclass may override:

- ``prepare(model, host_batches, passes) -> Prepared``: the step's batches on the device and this process's
  count of what the loss is averaged over. One path for training and validation: the default counts on the
  host and moves; GRPO samples and scores its completions here (its rollout).
- ``loss(model, batch, passes) -> (loss, {figure: value})``: the batch's loss *summed* over its units and each
  figure summed likewise; the core divides by the step's count over every micro-batch and process. The
  default is the next-token loss over label tokens (``sft``).
- ``check(records) -> ['file:line: problem']``: what the objective checks of the records as read.

``passes`` (a ``Passes``) is what the core runs for it: log-probabilities of a batch's rows under the model or
its reference, the batch moved to the device. A plugin needs nothing else of vlft's internals.
``PairedPreference`` is the base of losses on chosen and rejected replies (DPO, ORPO, SimPO): a subclass
writes ``pair_loss`` alone.

Options are declared as a method declares its hyper-parameters: a dataclass whose fields are ``option(default,
help, check=...)``. The core builds a ``vlft run`` flag and a ``--config`` key of each (``--beta``, ``beta:``),
lists them in ``vlft objectives`` and the plan, checks what the user gave (its type, the option's ``check``, and
the class's ``__post_init__`` for checks across options) and hands the plugin the instance.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlft.contracts import ContractChanged, contract
from vlft.errors import ConfigError

SHARED = "shared"  # the batch key of inputs given once for every group of rows (a pair batch's images)
OWN = "objective"  # the batch key of what only the objective's loss reads (never a model input)
PER_STEP = "steps"  # a figure unit: the figure is a mean per process and step (a count, a time)


# -- options ---------------------------------------------------------------------------------------------------


def option(
    default: Any,
    help: str,
    *,
    check: Callable[[Any], str] | None = None,
    choices: tuple[str, ...] = (),
    metavar: str = "",
) -> Any:
    """A field of an objective's options class: its default, its help (``vlft run --help``, ``vlft
    objectives``), and ``check(value) -> ''`` or what is wrong with a value (``'must be positive'``)."""
    metadata = {"help": help, "check": check, "choices": tuple(choices), "metavar": metavar}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class OptionSpec:
    """One declared option, as the core reads it: ``--name-with-dashes`` on ``vlft run``, ``name`` in a
    ``--config`` file."""

    name: str
    type: type  # int, float, str, bool, or list (a repeatable flag of strings)
    default: Any
    help: str
    check: Callable[[Any], str] | None = None
    choices: tuple[str, ...] = ()
    metavar: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def option_specs(options: type | None) -> tuple[OptionSpec, ...]:
    """The options an options class declares (none for None)."""
    if options is None:
        return ()
    hints = typing.get_type_hints(options)
    specs = []
    for f in dataclasses.fields(options):
        kind = typing.get_origin(hints[f.name]) or hints[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        specs.append(
            OptionSpec(
                f.name,
                kind,
                default,
                f.metadata.get("help", ""),
                f.metadata.get("check"),
                f.metadata.get("choices", ()),
                f.metadata.get("metavar", ""),
            )
        )
    return tuple(specs)


def resolve_options(objective: str, options: type | None, given: Mapping[str, Any], owners: Mapping[str, list[str]]):
    """``options`` (the class) built from the values the user ``given`` (flags and config file, by option name),
    each of the right type and passing its check; a value for an option this objective does not declare is an
    error naming the objectives that do (``owners``). None where the objective declares none and none was
    given."""
    specs = {s.name: s for s in option_specs(options)}
    for name in given:
        if name not in specs:
            flag = "--" + name.replace("_", "-")
            others = [o for o in owners.get(name, []) if o != objective]
            takers = ", ".join(others[:-1]) + (" and " if len(others) > 1 else "") + (others[-1] if others else "")
            raise ConfigError(
                f"{flag} is not an option of the {objective} objective"
                + (f" ({takers} take{'s' if len(others) == 1 else ''} it)" if others else "")
                + "; its options: "
                + (", ".join(s.flag for s in specs.values()) or "none")
                + " (`vlft objectives`)"
            )
    if options is None:
        return None
    values = {name: _checked(specs[name], value, objective) for name, value in given.items()}
    return options(**values)


def _checked(spec: OptionSpec, value: Any, objective: str) -> Any:
    value = _coerced(spec, value, objective)
    if spec.choices and value not in spec.choices:
        raise ConfigError(f"{spec.flag} ({objective}) must be one of {', '.join(spec.choices)}, got {value!r}")
    problem = spec.check(value) if spec.check is not None else ""
    if problem:
        raise ConfigError(f"{spec.flag} ({objective}) {problem}, got {value!r}")
    return value


def _coerced(spec: OptionSpec, value: Any, objective: str) -> Any:
    """A flag's text or a config file's YAML value as the option's type."""
    kind = spec.type
    try:
        if kind is list:
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if all(isinstance(x, str) for x in items):
                return items
        elif kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "false"):
                return str(value).lower() == "true"
        elif kind is int:
            if not isinstance(value, bool) and float(value) == int(float(value)):
                return int(float(value))
        elif kind is float:
            if not isinstance(value, bool):
                return float(value)
        elif not isinstance(value, (list, dict, bool)):
            return kind(value)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{spec.flag} ({objective}) expects {getattr(kind, '__name__', kind)}, got {value!r}")


def positive(value) -> str:
    return "" if value > 0 else "must be positive"


def non_negative(value) -> str:
    return "" if value >= 0 else "must not be negative"


# -- what a plugin names ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectiveInfo:
    """What ``vlft_objectives()`` answers: one entry per training objective a plugin offers (``--objective``),
    with the class of its options (fields made with ``option``; None: it takes none)."""

    name: str
    description: str
    options: type | None = None


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


# -- what an objective is --------------------------------------------------------------------------------------


class Layout(enum.Enum):
    """The record layouts the core reads, checks and batches for an objective (README "Data"); an objective
    with a layout of its own gives a ``RecordFormat`` instead (GRPO's prompts)."""

    CONVERSATIONS = "conversations: user turns and the assistant replies to learn"
    PREFERENCE_PAIRS = (
        "preferences: a prompt and its images with a chosen and a rejected reply (LLaMA-Factory: "
        "conversations/messages + chosen + rejected + images; TRL: prompt + chosen + rejected + "
        "images)"
    )
    UNPAIRED_PREFERENCES = (
        "unpaired preferences: a prompt and its images with one reply marked desirable or "
        "not (LLaMA-Factory: messages + kto_tag or label; TRL: prompt + completion + label)"
    )

    @property
    def description(self) -> str:
        return self.value


class RecordFormat(Protocol):
    """A layout of an objective's own: how a JSON object is read (``parse(obj, add_placeholders)`` -> the
    core's parsed record, raising its FormatProblem with what to fix), what a record encodes to
    (``encoder(sample_encoder)``: its ``encode(record)`` and ``measure_labelled(record)``) and how samples are
    batched (``collate(row_collator)``)."""

    @property
    def description(self) -> str: ...

    def parse(self, obj: dict, add_placeholders: bool = False) -> Any: ...

    def encoder(self, sample_encoder: Any) -> Any: ...

    def collate(self, row_collator: Any) -> Any: ...


class Average(enum.Enum):
    """What the step's loss is averaged over, over every micro-batch and process."""

    LABEL_TOKENS = "label tokens"
    RECORDS = "records"  # a batch's ``records`` (DPO's pairs)
    COMPLETION_TOKENS = "completion tokens"  # counted by the objective's ``prepare`` (GRPO's rollout)
    COMPLETIONS = "completions"


@dataclass(frozen=True)
class Generation:
    """What a step generates, for the memory plan: ``sequences_per_record`` x the batch's records sequences
    of ``new_tokens`` sampled tokens each (their KV cache)."""

    sequences_per_record: int
    new_tokens: int


@dataclass(frozen=True)
class Prepared:
    """A step's batches on the device (``Objective.prepare``): ``units``, this process's count of what the
    loss is averaged over; ``figures``, what preparing measured once for the step ({figure: device scalar},
    GRPO's sampling time), logged beside the loss's figures."""

    batches: list
    units: int
    figures: Mapping[str, Any] = field(default_factory=dict)


class Passes(Protocol):
    """What the core runs for an objective's ``prepare`` and ``loss``, on the run's device and under its
    autocast. Row batches lay their rows out in ``groups`` groups over the same records (a pair batch: the
    chosen rows, then the rejected ones) with the records' images given once under ``SHARED``; the vision
    tower runs once per record where the model allows (its features repeated for each group)."""

    device: Any
    autocast: Any  # the step's autocast context (or a null one)
    encoder: Any  # the run's sample encoder (the objective's): its tokenizer and processor

    @property
    def has_reference(self) -> bool:
        """Whether the run keeps a reference model (``Objective.reference``)."""
        ...

    def count(self, host_batch: dict, average: Average) -> int:
        """The label tokens or the records of a host batch (no device sync)."""
        ...

    def to_device(self, host_batch: dict) -> dict:
        """The batch on the device, with each row batch's labelled positions (the head runs there only)."""
        ...

    def with_positions(self, batch: dict) -> dict:
        """``batch`` (and each row batch nested in it) with its labelled positions, for rows an objective built
        on the device itself (GRPO's completions): what ``to_device`` adds on the way."""
        ...

    def sampler(self, model: Any) -> Any:
        """The model whose ``generate`` samples: the adapted model itself, not a data-parallel wrapper."""
        ...

    def token_loss_sum(self, model: Any, batch: dict) -> Any:
        """The next-token cross-entropy summed over the batch's label tokens."""
        ...

    def generate(self, model: Any, inputs: dict, **options) -> Any:
        """``model.generate(**inputs, **options)`` (the prompts on the device: ``to_device``) as the run allows
        it: under ``--shard fsdp`` each decoding step gathers every block, so every process decodes until all
        are done (``synced_gpus``) with the sharded root's parameters gathered. Call it on every process, the
        same number of times."""
        ...

    def sequence_logps(self, model: Any, batch: dict, groups: int = 1) -> tuple[Any, Any]:
        """(each row's summed log-probability of its label tokens, fp32 at least; each row's label count)."""
        ...

    def reference_sequence_logps(self, batch: dict, groups: int = 1) -> tuple[Any, Any]:
        """``sequence_logps`` under the reference model: no gradients, evaluation mode, the adapter off (or the
        ``--init-adapter`` weights)."""
        ...

    def token_logps(
        self, model: Any, batch: dict, groups: int = 1, temperature: float = 1.0, suppressed: tuple[int, ...] = ()
    ) -> tuple[Any, Any]:
        """(per-token log-probabilities ``[rows, P]`` at the labelled positions, their mask), from the logits
        divided by ``temperature`` with the ``suppressed`` token ids out of the softmax (a sampler's
        distribution)."""
        ...

    def reference_token_logps(
        self, batch: dict, groups: int = 1, temperature: float = 1.0, suppressed: tuple[int, ...] = ()
    ) -> tuple[Any, Any]:
        """``token_logps`` under the reference model (as ``reference_sequence_logps``)."""
        ...


def _field(default: Any, help: str, compare: bool = True) -> Any:
    if isinstance(default, dict):
        return field(default_factory=dict, compare=compare, metadata={"help": help})
    return field(default=default, compare=compare, metadata={"help": help})


@contract
@dataclass(frozen=True)
class Objective:
    """What a run optimises (``--objective``), answered once at plan time by ``vlft_objective``; the module
    docstring says how the core uses it. This base is ``sft``: conversations, one row a record, the next-token
    loss summed over label tokens and averaged over the step's label tokens."""

    name: str = field(metadata={"help": "What `--objective` selects, e.g. 'dpo'."})
    description: str = _field("", "One line for `vlft objectives` and the plan.")
    options: Any = _field(
        None,
        "The resolved options (an instance of `ObjectiveInfo.options`), shown in the plan and plan.json.",
        compare=False,
    )
    layout: Layout | RecordFormat = _field(
        Layout.CONVERSATIONS,
        "A `Layout` the core reads (conversations, "
        "preference pairs, unpaired preferences) or the objective's own "
        "`RecordFormat` (parse, encoder, collate).",
        compare=False,
    )
    rows_per_record: int = _field(1, "Sequences the model runs per record (DPO: 2); the memory plan counts them.")
    average_over: Average = _field(
        Average.LABEL_TOKENS,
        "An `Average`: label tokens, records, or the completion tokens or completions `prepare` counts.",
    )
    figures: tuple[str, ...] = _field(
        (),
        "The figures `loss` returns, logged as means (metrics.jsonl, --report-to) and, as val_<figure>, in validation.",
    )
    figure_units: Mapping[str, str] = _field(
        {},
        "{figure: what its mean is over} where not the loss's units: "
        "another figure counting its units (GRPO's 'reward' over "
        "'completions'), or PER_STEP ('steps': a count, a time).",
        compare=False,
    )
    reference: bool = _field(
        False,
        "Whether the loss compares with a reference model: the adapter off, or the "
        "adapter --init-adapter loaded (kept frozen); the run keeps it and the memory "
        "plan counts the --init-adapter copy.",
    )
    dropout: bool = _field(
        True,
        "False: every dropout layer is off for the whole run (TRL's disable_dropout), so "
        "the trained pass computes what the reference pass and generation compute (both "
        "in evaluation mode).",
    )
    iterations: int = _field(
        1,
        "Steps each prepared batch is trained on (GRPO's --num-iterations): the data order "
        "draws a step's records for that many steps in a row and the core hands `loss` "
        "the same prepared batches again.",
    )
    generation: Generation | None = _field(
        None, "What a step generates (`Generation`), for the memory plan's KV cache; None: nothing."
    )
    demo_epochs: float | None = _field(
        None, "Epochs on the demo data when neither --epochs nor --steps is given (None: SFT's)."
    )
    packing_refusal: str = _field("", "Why --packing cannot lay its rows out ('' it can; auto then pads).")
    sharding_refusal: str = _field(
        "", "Why --shard fsdp cannot run it ('' it can); the run stops before any process starts."
    )
    notes: tuple[str, ...] = _field((), "Lines for the plan.")

    def __post_init__(self):
        """A value of the contract before plugin API 3 (a string where an enum or a bool is read now) is named
        with what replaced it, not left to fail inside a step."""
        wrong = [
            (name, want)
            for name, want in (
                ("average_over", Average),
                ("reference", bool),
                ("layout", None),
                ("generation", Generation),
            )
            if not _fits(getattr(self, name), want)
        ]
        if wrong:
            raise ContractChanged(
                "; ".join(
                    f"Objective({name}={getattr(self, name)!r}): plugin API 3 takes "
                    + {
                        "average_over": "a vlft.Average (Average.RECORDS, Average.LABEL_TOKENS, ...)",
                        "reference": "a bool (True: the loss compares with a reference model)",
                        "layout": "a vlft.Layout or a format with parse, encoder and collate methods",
                        "generation": "a vlft.Generation(sequences_per_record, new_tokens) or None",
                    }[name]
                    for name, _ in wrong
                )
                + " (see docs/plugin-api-changes.md#plugin-api-3)"
            )

    @property
    def supervised(self) -> bool:
        """The next-token loss over label tokens (what ``sft`` optimises)."""
        return type(self).loss is Objective.loss

    def check(self, records: list) -> list[str]:
        """['file:line: problem', ...] of the records as read, every run before step 1 and outside the cached
        data check (it may run the user's code, which can change while the data does not)."""
        return []

    def demo_data(self, folder) -> tuple[Any, Any] | None:
        """(train, val) files of the embedded demo task for a run without --data; None: the layout's."""
        return None

    def prepare(self, model, host_batches: list[dict], passes: Passes) -> Prepared:
        """The step's batches (all its micro-batches), counted on the host and moved to the device."""
        units = sum(passes.count(b, self.average_over) for b in host_batches)
        return Prepared([passes.to_device(b) for b in host_batches], units)

    def loss(self, model, batch: dict, passes: Passes) -> tuple[Any, dict]:
        """(the batch's loss summed over its units, {figure: sum over its units}); here the next-token loss."""
        return passes.token_loss_sum(model, batch), {}

    def describe(self) -> dict:
        """Plain data for the plan and `vlft objectives`."""
        layout = self.layout.description
        options = self.options
        options = (
            dataclasses.asdict(options) if dataclasses.is_dataclass(options) and not isinstance(options, type) else {}
        )
        return {
            "name": self.name,
            "description": self.description,
            "options": options,
            "layout": layout,
            "rows_per_record": self.rows_per_record,
            "average_over": self.average_over.value,
            "figures": list(self.figures),
            "reference": self.reference,
            "notes": list(self.notes),
            "dropout": self.dropout,
            **({"generation": dataclasses.asdict(self.generation)} if self.generation else {}),
        }


# -- preference pairs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One side of a batch of pairs, ``[pairs]`` each: the policy's summed log-probability of the reply's
    tokens, their count, and the reference's (None where the objective takes no reference)."""

    logps: Any
    tokens: Any
    reference: Any = None

    @property
    def mean_logps(self):
        """The per-token mean log-probability (what ORPO's odds and SimPO's reward read)."""
        return self.logps / self.tokens.clamp(min=1)


@dataclass(frozen=True)
class PairedPreference(Objective):
    """A loss on chosen and rejected replies of one prompt: the core reads LLaMA-Factory's and TRL's preference
    layouts, runs both rows of a pair on one vision pass (and the reference's, where ``reference``), and
    averages over pairs; a subclass writes ``pair_loss``."""

    layout: Layout | RecordFormat = Layout.PREFERENCE_PAIRS
    rows_per_record: int = 2
    average_over: Average = Average.RECORDS
    dropout: bool = False  # TRL's default (disable_dropout): the two rows of a pair see one model
    demo_epochs: float | None = 2
    packing_refusal: str = (
        "the chosen and rejected rows of a pair are scored row by row; packed rows are not built for them"
    )
    notes: tuple[str, ...] = (
        "each image is encoded once per pass: one vision pass feeds the chosen and the rejected row (where the "
        "model takes precomputed features; under --shard fsdp once per row, inside the sharded forward)",
    )

    def loss(self, model, batch: dict, passes: Passes) -> tuple[Any, dict]:
        """The reference's pass first (no gradients: its activations are gone before the trained pass's), then
        the policy's; ``pair_loss`` per pair, summed."""
        ref = passes.reference_sequence_logps(batch, 2)[0] if self.reference else None
        logps, tokens = passes.sequence_logps(model, batch, 2)
        n = logps.shape[0] // 2
        chosen = Side(logps[:n], tokens[:n], ref[:n] if ref is not None else None)
        rejected = Side(logps[n:], tokens[n:], ref[n:] if ref is not None else None)
        losses, figures = self.pair_loss(chosen, rejected)
        return losses.sum(), {name: value.sum() for name, value in figures.items()}

    def pair_loss(self, chosen: Side, rejected: Side) -> tuple[Any, dict]:
        """(each pair's loss ``[pairs]``, {figure: each pair's value ``[pairs]``}); figures detached."""
        raise NotImplementedError(f"{type(self).__name__} must define pair_loss")


def _fits(value: Any, want: type | None) -> bool:
    if want is None:  # a layout: one of the core's, or a format of the objective's own
        return isinstance(value, Layout) or all(hasattr(value, m) for m in ("parse", "encoder", "collate"))
    if want is Generation:
        return value is None or isinstance(value, Generation)
    return isinstance(value, want)


def reference_description(init_adapter: bool) -> str:
    """What the reference model is, in words (the plan and `vlft objectives`)."""
    return (
        "the adapter as --init-adapter loaded it (kept frozen)"
        if init_adapter
        else "the base model (the adapter switched off)"
    )


def objective_help() -> dict[str, str]:
    """Each ``Objective`` field's help (docs/plugin-hooks.md lists them)."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(Objective)}
