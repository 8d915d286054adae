"""Run configuration: one dataclass, filled from a YAML file and then flags.

Config-file keys are the flag names (``vision-last-n`` or ``vision_last_n``);
an unknown key is an error that lists the valid ones. Flags given on the
command line override the file.

Over 300 lines because it holds one field, with its help text, per ``vlft run`` flag: splitting the
fields across modules would scatter the one list a user reads.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlft.contracts import contract
from vlft.errors import ConfigError


def opt(default, help: str, **extra) -> Any:  # a dataclass field: Any, so each field keeps its own annotation
    """A config field with help text (shown by ``vlft run --help``)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@contract  # a field that moved (an objective's option: beta, ...) is named with where it went
@dataclass
class RunConfig:
    backend: str = opt("auto", "Backend plugin to run on; 'auto' picks the best available (see `vlft plugins`).")
    method: str = opt("lora", "Adapter method plugin (see `vlft methods`).")
    objective: str = opt(
        "sft",
        "What is optimised: sft (the next-token loss on the assistant replies), dpo, "
        "orpo or simpo (preference pairs), kto (replies marked desirable or not) or grpo "
        "(sampled completions and their rewards); plugins add more. Each declares its own "
        "options (see `vlft objectives`).",
    )
    init_adapter: str | None = opt(
        None,
        "Start from this adapter (a run folder or an adapter folder, e.g. an sft "
        "run's) instead of a fresh one; an objective with a reference (dpo, kto, "
        "grpo) then takes it as its reference.",
    )
    model: str | None = opt(
        None,
        "Model directory (any family a plugin offers: `vlft plugins`), a bundled config "
        "name (plans offline), or embedded:FAMILY (a tiny model built here); default: "
        "the embedded Qwen2.5-VL.",
    )
    data: list | None = opt(
        None,
        "Training data (JSON, JSONL, Parquet, Arrow, a saved `datasets` folder, a folder "
        "of .parquet/.arrow shards or a glob), repeatable; FILE:WEIGHT samples that file WEIGHT "
        "times per epoch (2: every record twice, 0.5: a seeded half); default: the "
        "embedded product-inspection set.",
        multiple=True,
        metavar="FILE[:WEIGHT]",
    )
    image_root: str | None = opt(
        None,
        "Folder that relative image and video paths start from (default: each data "
        "file's folder); downloads of http(s) images may lie under it as DIR/host/path.",
    )
    add_placeholders: bool = opt(
        False,
        "Records with images but no <image> placeholder get them at the start of "
        "the first user turn (as ms-swift does) instead of being an error.",
        flag=True,
    )
    columns: str | None = opt(
        None,
        "The data set's own names for the keys vlft reads, as OURS=THEIRS pairs "
        "(messages=conv,images=pics); a mapping in the config file.",
        mapping=True,
    )
    video_fps: float = opt(2.0, "Frames per second sampled from each video.")
    video_max_frames: int = opt(16, "Most frames taken from one video (spread over the clip when it is longer).")
    early_stopping_patience: int = opt(
        0,
        "Stop when the validation loss (every --eval-every steps) has not improved "
        "for N evaluations, keeping the best adapter in adapter-best/ (0: never).",
    )
    val_data: str | None = opt(None, "Validation data; default: the embedded set's validation split.")
    output: str | None = opt(None, "Run folder; default: runs/<time>-<method>-<backend>.")
    steps: int | None = opt(None, "Optimizer steps to train (overrides --epochs).")
    epochs: float | None = opt(
        None,
        "Passes over the training data; default 3 (8 on the embedded data set, "
        "which it needs to converge) when --steps is not given.",
    )
    batch_size: int = opt(4, "Samples per micro-batch (per process).")
    grad_accum: int = opt(1, "Micro-batches accumulated per optimizer step.")
    packing: str = opt(
        "off",
        "Padding-free packing: a micro-batch's --batch-size samples laid end to end in one "
        "row, each sample keeping its own positions and attending only to itself (same loss "
        "and gradients as padding; steps, resume and the data order as without packing). "
        "auto: pack where the backend's attention and the model family can keep samples "
        "apart, else pad; on: pack or stop with the reason; off: pad.",
        choices=("auto", "on", "off"),
    )
    lr: float | None = opt(None, "Peak learning rate; default: the method's.")
    lr_vision: float | None = opt(
        None,
        "Peak learning rate of the vision tower's trainable parameters, absolute "
        "(not a multiplier of --lr); default: --lr. The schedule scales it as --lr.",
    )
    lr_merger: float | None = opt(
        None,
        "Peak learning rate of the merger (vision-to-text projector), absolute "
        "(not a multiplier of --lr): its adapters, or all its weights with "
        "--train-merger; default: --lr.",
    )
    train_merger: bool = opt(
        False,
        "Train the merger's weights in full beside the adapters (saved in the adapter "
        "folder as PEFT modules_to_save, so plain PEFT loads them).",
        flag=True,
    )
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    warmup_ratio: float = opt(0.05, "Fraction of the steps spent warming the learning rate up.")
    max_grad_norm: float = opt(1.0, "Gradient clipping norm (0 disables clipping).")
    eval_every: int = opt(200, "Validation loss every N steps (0: never).")
    eval_batches: int = opt(8, "Validation batches per periodic evaluation.")
    eval_samples: int = opt(200, "Validation samples for the before/after generation test (0: all).")
    max_new_tokens: int = opt(32, "Longest generated answer in evaluation, and (GRPO) of each sampled completion.")
    scorer: str = opt(
        "auto",
        "How the before/after test scores the answers: scorers by name, comma-separated "
        "(built in: exact, fields, anls, relaxed, choice, iou, bleu, rouge, cider, cer, json; see "
        "`vlft scorers`), auto (exact match, plus fields, relaxed, iou or json where every validation "
        "reference takes that form; the plan says which) or your MODULE:FUNCTION.",
        metavar="NAME[,NAME]",
    )
    save_every: int = opt(200, "Checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = opt(2, "Checkpoints kept; older ones are deleted.")
    resume: bool = opt(False, "Continue from the newest checkpoint in --output.", flag=True)
    force_resume: bool = opt(
        False,
        "With --resume: continue even when the training configuration differs from "
        "the checkpoint's (a warning lists the differences).",
        flag=True,
    )
    max_skipped_steps: int = opt(
        5,
        "Stop after this many consecutive steps with a non-finite loss or gradient "
        "norm (such steps are never applied; 0: never stop).",
    )
    trust_pickle: bool = opt(
        False,
        "Allow a model folder whose weights are pickled (.bin/.pt); unpickling can "
        "run code, so only for files you trust. Safetensors need no flag.",
        flag=True,
    )
    seed: int = opt(0, "Seed for Python, NumPy, torch, the device and the data order.")
    deterministic: bool = opt(False, "Ask for deterministic kernels (slower on some devices).", flag=True)
    targets: str = opt("both", "Where to adapt: vision, text or both.", choices=("vision", "text", "both"))
    vision_last_n: int = opt(6, "Adapt only the last N vision blocks (all when the model has fewer).")
    max_pixels: int | None = opt(None, "Cap on each image's pixel count (e.g. 200704 = 448*448).")
    precision: str = opt(
        "auto", "auto, fp32, bf16 or fp16; auto takes the backend's choice.", choices=("auto", "fp32", "bf16", "fp16")
    )
    param_dtype: str = opt(
        "auto",
        "Dtype of the frozen base weights: auto (the backend's choice: fp32 on the CPU "
        "reference, bf16 or fp16 on accelerators), fp32, bf16 or fp16; nf4: 4-bit "
        "NormalFloat linear weights through bitsandbytes (QLoRA; bf16 compute, where "
        "the backend offers it). Adapter weights are always fp32.",
        choices=("auto", "fp32", "bf16", "fp16", "nf4"),
    )
    double_quant: bool = opt(
        False,
        "With --param-dtype nf4: quantize the per-block scales again (8-bit; about 0.37 bits per weight less).",
        flag=True,
    )
    grad_checkpointing: str = opt(
        "auto",
        "Activation checkpointing (non-reentrant, both towers): on, off, or auto "
        "(on when the memory plan says the run does not fit without it).",
        choices=("auto", "on", "off"),
    )
    max_length: int | None = opt(
        None,
        "Longest sample in tokens, image tokens included; longer samples are an "
        "error (or skipped with --skip-too-long). Samples are never truncated.",
    )
    skip_too_long: bool = opt(
        False,
        "Skip samples longer than --max-length (counted and listed in the summary) instead of stopping.",
        flag=True,
    )
    group_by_length: bool = opt(
        False,
        "Batch samples of similar length together (less padding): seeded and "
        "resumable like the plain shuffle; every process takes its share of it.",
        flag=True,
    )
    device_memory: str | None = opt(
        None,
        "Plan for a device of this much memory (e.g. 24GiB, 64GB) instead of "
        "the one found; lets a dry run here plan for a card it does not have.",
    )
    shard: str = opt(
        "none",
        "How several processes hold the model: none (each process a whole copy, data "
        "parallel) or fsdp (torch FSDP2: base weights, adapter, gradients and optimizer "
        "state split over the processes, for models that fit no single device).",
        choices=("none", "fsdp"),
    )
    sequence_parallel: int = opt(
        1,
        "Split each sample's sequence over N processes (Ulysses: an all-to-all over the text model's "
        "attention heads), for samples too long for one device; N divides the processes, which form "
        "groups of N that train on the same batches.",
    )
    shard_loading: str = opt(
        "auto",
        "--shard fsdp: how the base weights are read. auto: each process reads only its own "
        "shares from the safetensors files (rank 0's path where that cannot work, the plan says "
        "why); rank0: rank 0 reads the whole checkpoint and sends the shares out.",
        choices=("auto", "rank0"),
    )
    offload: str = opt(
        "none",
        "--shard fsdp: none, or cpu (FSDP2's CPUOffloadPolicy: base weights, adapter, gradients "
        "and AdamW state kept on the host, copied to the device block by block; the optimizer "
        "steps on the host). Slower; for models whose shares do not fit the device.",
        choices=("none", "cpu"),
    )
    no_memory_check: bool = opt(False, "Train even when the memory plan says the run will not fit.", flag=True)
    attn: str | None = opt(None, "Attention: one implementation, or per tower as 'vision=eager,text=sdpa'.")
    kernels: str = opt(
        "auto",
        "Kernel patches the backend offers (the plan lists them, chosen and declined): auto "
        "(those on by default whose condition holds), none (the model as transformers builds "
        "it), or NAME,... exactly those; auto,NAME adds an opt-in one.",
    )
    num_workers: int | None = opt(None, "DataLoader workers; default: the backend's.")
    log_every: int = opt(10, "Write metrics.jsonl every N steps.")
    report_to: str | None = opt(
        None,
        "Also send the logged metrics to these sinks, comma-separated: tensorboard "
        "(pip install 'vlft[tensorboard]'), or one a plugin adds.",
    )
    adapter: dict = opt(
        {}, "Method hyper-parameters, as KEY=VALUE (repeatable) or a mapping in the config file.", cli="--adapter-opt"
    )
    dry_run: bool = opt(False, "Resolve and print every policy, then stop without training.", flag=True)
    # the objective's own options, by name ({"beta": 0.2}), as their flags and the config file gave them: the
    # objective's plugin declares them (``ObjectiveInfo.options``) and the plan checks and completes them
    objective_options: dict = field(default_factory=dict, metadata={"internal": True})
    # set from the environment by torchrun, not by users
    local_rank: int = field(default=0, metadata={"internal": True})
    rank: int = field(default=0, metadata={"internal": True})
    world_size: int = field(default=1, metadata={"internal": True})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def data_world(self) -> int:
        """How many different batches a step draws: the processes, less those that split one sequence."""
        return max(self.world_size // max(self.sequence_parallel, 1), 1)

    @property
    def data_rank(self) -> int:
        """Which of the ``data_world`` shares of the data this process trains on (its sequence group's)."""
        return self.rank // max(self.sequence_parallel, 1)


def user_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RunConfig) if not f.metadata.get("internal")]


def _canonical(key: str) -> str:
    return key.strip().replace("-", "_")


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    if value is None:
        return None
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("bool"):
            if not isinstance(value, bool):
                raise ValueError
            return value
        if kind.startswith("list"):
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if not all(isinstance(x, (str, dict)) for x in items):
                raise ValueError
            return [x if isinstance(x, str) else _data_entry(x, source) for x in items]
        if kind.startswith("dict"):
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
        if f.metadata.get("mapping") and isinstance(value, dict):  # a config file's {ours: theirs}
            return ",".join(f"{k}={v}" for k, v in value.items())
        if kind.startswith("str"):
            if isinstance(value, (list, dict, bool)):  # str() would hide a YAML list or mapping
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: '{f.name.replace('_', '-')}' expects {kind}, got {value!r}") from None
    return value


def _key_lines(text: str) -> dict[str, int]:
    """Top-level key -> its line in the YAML text, for messages that point at the line."""
    import yaml

    node = yaml.compose(text)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): k.start_mark.line + 1 for k, _ in node.value}


def load_config_file(path: str | os.PathLike, objective_options: tuple[str, ...] = ()) -> dict:
    """Read a YAML config file into canonical keys; unknown keys are an error. A key naming one of the
    installed objectives' ``objective_options`` goes, as written, under ``objective_options`` (the objective
    checks its value when the run is planned)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.safe_load(text) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte offset {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values")
    known = {f.name: f for f in user_fields() if f.name not in ("dry_run",)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = _canonical(str(key))
        if name in objective_options and name not in known:
            out.setdefault("objective_options", {})[name] = value
            continue
        if name not in known:
            valid = ", ".join(sorted(n.replace("_", "-") for n in [*known, *objective_options]))
            raise ConfigError(f"{path}: unknown key '{key}'. Valid keys: {valid}")
        out[name] = _coerce(known[name], value, f"{path}:{_key_lines(text).get(str(key), '?')}")
    # relative paths in a config file are relative to the file
    for name in ("model", "val_data", "output", "image_root", "init_adapter"):
        if out.get(name) and not Path(out[name]).is_absolute() and (path.parent / out[name]).exists():
            out[name] = str(path.parent / out[name])
    if out.get("data"):
        out["data"] = [
            str(path.parent / d)
            if not Path(d).is_absolute() and _names_something(path.parent / split_data_spec(d)[0])
            else d
            for d in out["data"]
        ]
    return out


def _names_something(path: Path) -> bool:
    """A file or folder, or a glob (``shards/*.parquet``) that matches one."""
    import glob

    return path.exists() or bool(set("*?[") & set(str(path)) and glob.glob(str(path)))


def _data_entry(entry: dict, source: str) -> str:
    """A config file's ``{path: FILE, weight: W}`` as the flag's FILE:WEIGHT."""
    if "path" not in entry or set(entry) - {"path", "weight"}:
        raise ConfigError(f"{source}: a 'data' entry is a path or {{path: FILE, weight: W}}, got {entry!r}")
    return f"{entry['path']}:{entry['weight']}" if "weight" in entry else str(entry["path"])


def split_data_spec(spec: str) -> tuple[str, float]:
    """'train.jsonl:2' -> ('train.jsonl', 2.0); a path that itself holds ':' is taken whole when it exists."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and not Path(spec).exists():
        try:
            weight = float(tail)
        except ValueError:
            return spec, 1.0
        if weight <= 0:
            raise ConfigError(f"--data {spec}: the weight must be positive")
        return head, weight
    return spec, 1.0


def parse_columns(spec: str | None) -> dict[str, str]:
    """``--columns 'messages=conv,images=pics'`` -> ``{"messages": "conv", "images": "pics"}``."""
    out: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in (spec or "").split(","))):
        ours, sep, theirs = (x.strip() for x in pair.partition("="))
        if not sep or not ours or not theirs:
            raise ConfigError(f"--columns expects OURS=THEIRS pairs separated by commas (messages=conv), got '{pair}'")
        if ours in out:
            raise ConfigError(f"--columns maps '{ours}' twice")
        out[ours] = theirs
    return out


def parse_adapter_options(pairs: tuple[str, ...] | list[str]) -> dict:
    """``("r=16", "lora_dropout=0.1")`` -> ``{"r": 16, "lora_dropout": 0.1}`` (YAML scalars)."""
    import yaml

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--adapter-opt expects KEY=VALUE, got '{pair}'")
        key, value = pair.split("=", 1)
        out[_canonical(key)] = yaml.safe_load(value)
    return out


def build_config(file_values: dict, flag_values: dict) -> RunConfig:
    """Merge defaults < file < flags (flags that were actually given) and check the result."""
    values = {**file_values}
    for key, value in flag_values.items():
        if key in ("adapter", "objective_options"):
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    cfg = RunConfig(**values)
    cfg.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cfg.rank = int(os.environ.get("RANK", 0))
    cfg.world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    for f in user_fields():
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if choices and value not in choices:
            raise ConfigError(f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}, got '{value}'")
    positive = ("batch_size", "grad_accum", "keep_checkpoints", "log_every", "sequence_parallel")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    for name in (
        "eval_every",
        "save_every",
        "eval_samples",
        "eval_batches",
        "vision_last_n",
        "max_grad_norm",
        "weight_decay",
        "max_skipped_steps",
    ):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must not be negative, got {getattr(cfg, name)}")
    if cfg.steps is not None and cfg.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.epochs is not None and cfg.epochs <= 0:
        raise ConfigError(f"--epochs must be positive, got {cfg.epochs}")
    for name in ("lr", "lr_vision", "lr_merger"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ConfigError(f"--warmup-ratio must be in [0, 1), got {cfg.warmup_ratio}")
    if cfg.max_length is not None and cfg.max_length < 1:
        raise ConfigError(f"--max-length must be at least 1, got {cfg.max_length}")
    if cfg.skip_too_long and cfg.max_length is None:
        raise ConfigError("--skip-too-long needs --max-length N (the length above which samples are skipped)")
    if cfg.device_memory is not None:
        parse_bytes(cfg.device_memory, "--device-memory")
    if cfg.offload != "none" and cfg.shard != "fsdp":
        raise ConfigError(
            f"--offload {cfg.offload} needs --shard fsdp: it is FSDP2's offload policy, which keeps each process's "
            "shares on the host; an unsharded model has no shares to keep there. Add --shard fsdp (one or more "
            "processes), or leave out --offload"
        )
    if cfg.shard_loading != "auto" and cfg.shard != "fsdp":
        raise ConfigError(
            f"--shard-loading {cfg.shard_loading} needs --shard fsdp (without sharding every process loads the "
            "whole model); add --shard fsdp or leave out --shard-loading"
        )
    if cfg.max_pixels is not None and cfg.max_pixels < 28 * 28:
        raise ConfigError(f"--max-pixels must be at least {28 * 28} (one merged patch), got {cfg.max_pixels}")
    parse_attn(cfg.attn)
    parse_kernels(cfg.kernels)
    if isinstance(cfg.data, str):  # a Python caller's single path
        cfg.data = [cfg.data]
    for spec in cfg.data or []:
        split_data_spec(spec)
    parse_columns(cfg.columns)
    if cfg.video_fps <= 0 or cfg.video_max_frames < 2:
        raise ConfigError(
            "--video-fps must be positive and --video-max-frames at least 2 (a temporal patch is "
            f"2 frames), got {cfg.video_fps} and {cfg.video_max_frames}"
        )
    if cfg.early_stopping_patience < 0:
        raise ConfigError(f"--early-stopping-patience must not be negative, got {cfg.early_stopping_patience}")
    if cfg.early_stopping_patience and not cfg.eval_every:
        raise ConfigError("--early-stopping-patience needs --eval-every N > 0 (the validation loss it watches)")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: str | int, flag: str = "size") -> int:
    """'24GiB' -> 25769803776, '64GB' -> 64e9, '1.5 TiB', or a plain number of bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"{flag}: cannot read '{value}' as a size; write e.g. 24GiB, 80GB or 65536MiB")
    return int(float(m.group(1)) * _UNITS[unit])


ATTN_CHOICES = ("eager", "sdpa", "flash_attention_2")


def parse_attn(value: str | None) -> dict[str, str] | None:
    """'sdpa' -> {'vision': 'sdpa', 'text': 'sdpa'}; 'vision=eager,text=sdpa' -> per tower."""
    if value is None:
        return None
    out: dict[str, str] = {}
    for part in value.split(","):
        part = part.strip()
        tower, _, impl = part.rpartition("=")
        towers = ("vision", "text") if not tower else (tower.strip(),)
        impl = impl.strip()
        if impl not in ATTN_CHOICES or any(t not in ("vision", "text") for t in towers):
            raise ConfigError(
                f"--attn: cannot read '{part}'; use one of {', '.join(ATTN_CHOICES)}, "
                "or per tower as 'vision=eager,text=sdpa'"
            )
        for t in towers:
            out[t] = impl
    return out


def parse_kernels(value: str | None) -> tuple[str, set[str]]:
    """'auto' -> ('auto', set()); 'none' -> ('none', set()); 'a,b' -> ('named', {'a', 'b'}); 'auto,a' ->
    ('auto', {'a'}). Whether a name exists is the plan's to check (the backend offers the names)."""
    parts = [p.strip() for p in (value or "auto").split(",") if p.strip()]
    if not parts:
        raise ConfigError("--kernels: empty; use auto, none, or kernel names separated by commas")
    if parts == ["none"]:
        return "none", set()
    if "none" in parts:
        raise ConfigError(f"--kernels {value}: 'none' cannot be combined with other names")
    mode = "auto" if "auto" in parts else "named"
    return mode, {p for p in parts if p != "auto"}
