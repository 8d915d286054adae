"""Resolving a run: every plugin answer gathered once into a ``RunPlan``.

``vlft run --dry-run`` prints the plan; a real run trains from it. Nothing
after this module asks a plugin about a policy again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vlft.config import RunConfig
from vlft.contracts.backend import BackendInfo, ProbeResult
from vlft.contracts.family import ModelFamily
from vlft.contracts.method import AdapterDefaults, MethodInfo
from vlft.contracts.objective import Objective, reference_description
from vlft.data.packing import PackingPlan, resolve_packing
from vlft.errors import BackendUnavailable, ConfigError
from vlft.planning.kernels import (
    KernelChoice,
    choose_kernels,
    format_kernels,
    with_kernel_attention,
)
from vlft.planning.memory import format_memory
from vlft.planning.scorers import describe_line
from vlft.planning.sharding import resolve_sharding
from vlft.policies import AttentionPolicy, DataLoaderOptions, DistributedOptions, PrecisionPolicy
from vlft.registry import Registry


@dataclass
class BackendChoice:
    info: BackendInfo
    probe: ProbeResult
    reason: str


@dataclass(frozen=True)
class RunPlan:
    """Everything a run decided before any weight is loaded: the plugins' policies (``resolve_policies``), then
    what the data and the model's shape decided (``preflight.plan_run``, which builds the whole plan once).
    Frozen: nothing after planning changes it."""

    config: RunConfig
    backend: BackendChoice
    precision: PrecisionPolicy
    attention: AttentionPolicy
    dataloader: DataLoaderOptions
    distributed: DistributedOptions
    method: MethodInfo
    adapter: AdapterDefaults
    lr: float
    model_path: str
    family: ModelFamily  # the checkpoint's model family, resolved once here
    objective: Objective  # what is optimised (--objective), resolved once here
    packing: PackingPlan  # --packing as resolved against the attention and the family
    targets: list[str] = field(default_factory=list)
    target_params: dict[str, int] = field(default_factory=dict)  # module -> adapter parameters
    target_summary: dict[str, Any] = field(default_factory=dict)
    target_parameters: list[str] = field(default_factory=list)  # fused expert weights (PEFT target_parameters)
    memory: Any = None  # memory.MemoryPlan, once the data and the model's shape are known
    lengths: dict[str, Any] = field(default_factory=dict)  # sample lengths: longest, skipped, limit
    notes: tuple[str, ...] = ()
    sharding: Any = None  # sharding.ShardingPlan: how the processes hold the model (--shard)
    sequence: Any = None  # sequence.SequencePlan: how many processes split each sample (--sequence-parallel)
    model_counts: dict[str, int] = field(default_factory=dict)  # parameters: total, vision, experts, ...
    kernels: KernelChoice | None = None  # the backends' kernel patches, chosen and declined (--kernels)
    param_groups: dict[str, dict] = field(default_factory=dict)  # AdamW group -> {"lr", "parameters"}
    merger_parameters: int = 0  # --train-merger: merger parameters trained in full (modules_to_save)
    peak_flops: float | None = None  # the device's peak FLOP/s where the backend knows it (DeviceCapacity)
    init_adapter: str | None = None  # --init-adapter: the adapter folder the run starts from
    scorers: Any = None  # scorers.ScorerChoice: what scores the before/after answers (--scorer)
    # what the data and the model's shape decided (``preflight.plan_run``), kept for the run that trains from it
    model_config: Any = None
    processor: Any = None
    encoder: Any = None  # data.encoding.SampleEncoder, or the objective's (DPO: chosen and rejected rows)
    train_records: Sequence = ()  # a list, or columnar rows (data.lazy.ColumnarRecords)
    val_records: Sequence = ()
    train_lengths: list | None = None  # each training sample's tokens (--group-by-length batches by them)
    total_steps: int = 0
    skeleton: Any = None  # the adapted model on 'meta' the plan was made on (--shard fsdp saves through it)

    @property
    def checkpointing(self) -> bool:
        return bool(self.memory and self.memory.checkpointing)

    def experts_adapted(self) -> dict | None:
        """For a mixture-of-experts family: whether its fused expert weights are adapted, which (relative to a
        decoder layer), the adapter parameters on them, and the routers, which never train. None: no experts."""
        experts = self.family.experts
        if experts is None:
            return None
        on_experts = sum(n for m, n in self.target_params.items() if m not in self.targets)
        return {
            "adapted": bool(self.target_parameters),
            "parameters": list(experts.parameters),
            "layers": len({p.rpartition(".")[0] for p in self.target_parameters}),
            "adapter_parameters": on_experts,
            "routers": list(experts.routers),
            "routers_frozen": True,
        }

    def objective_description(self) -> dict | None:
        """The objective as the plan shows it, its reference (if it takes one) in words."""
        if self.objective is None:
            return None
        desc = self.objective.describe()
        desc["reference"] = reference_description(bool(self.init_adapter)) if desc["reference"] else ""
        return desc

    def describe(self) -> dict:
        """Everything resolved, as JSON-ready data."""
        return {
            "backend": {
                "name": self.backend.info.name,
                "device_type": self.backend.info.device_type,
                "available": self.backend.probe.available,
                "reason": self.backend.probe.reason,
                "chosen_because": self.backend.reason,
                "device_count": self.backend.probe.device_count,
                "versions": self.backend.probe.versions,
                "warnings": self.backend.probe.warnings,
            },
            "attention": dataclasses.asdict(self.attention),
            "packing": self.packing.describe(),
            "precision": self.precision.describe(),
            "dataloader": dataclasses.asdict(self.dataloader),
            "distributed": dataclasses.asdict(self.distributed),
            "sharding": self.sharding.describe() if self.sharding else None,
            "sequence_parallel": self.sequence.describe() if self.sequence else None,
            "objective": self.objective_description(),
            "init_adapter": self.init_adapter,
            "method": {
                "name": self.method.name,
                "lr": self.lr,
                "hyperparameters": self.adapter.hyperparameters,
                "notes": self.adapter.notes,
            },
            "model": self.model_path,
            "model_family": {
                "name": self.family.name,
                "description": self.family.description,
                "model_types": list(self.family.model_types),
                "box_coordinates": self.family.chat.box_coordinates,
                "parameters": self.model_counts,
            },
            "targets": {
                **self.target_summary,
                "modules": {m: self.target_params.get(m) for m in self.targets},
                "adapter_parameters": sum(self.target_params.values()),
                "experts": self.experts_adapted(),
            },
            "kernels": self.kernels.describe() if self.kernels else None,
            "optimizer": {
                "groups": self.param_groups,
                "train_merger": self.config.train_merger,
                "merger_parameters": self.merger_parameters,
                "lr_is": "absolute (--lr-vision and --lr-merger are not multipliers of --lr)",
            },
            "param_dtype": {
                "dtype": (
                    f"nf4 linear weights{' (double-quantized)' if self.precision.double_quant else ''}"
                    f" + {self.precision.param_dtype}"
                    if self.precision.quantization
                    else self.precision.param_dtype
                ),
                "reason": self.precision.param_reason,
                "trainable": "float32",
            },
            "checkpointing": {
                "enabled": self.checkpointing,
                "asked": self.config.grad_checkpointing,
                "reason": self.memory.checkpointing_reason if self.memory else "",
            },
            "lengths": self.lengths,
            "memory": self.memory.describe() if self.memory else None,
            "notes": list(self.notes),
            "scorers": self.scorers.describe() if self.scorers else None,
            "training": {
                k: getattr(self.config, k)
                for k in (
                    "steps",
                    "epochs",
                    "batch_size",
                    "grad_accum",
                    "weight_decay",
                    "warmup_ratio",
                    "max_grad_norm",
                    "seed",
                    "deterministic",
                    "save_every",
                    "keep_checkpoints",
                    "world_size",
                )
            },
        }


def choose_backend(registry: Registry, name: str) -> BackendChoice:
    """The named backend with its probe, or for 'auto' the available one with the highest priority."""
    if name != "auto":
        info = registry.backend(name)
        return BackendChoice(info, registry.first("vlft_probe_backend", backend=name), "asked for by name")
    ranked = sorted(registry.backends.values(), key=lambda b: (-b.priority, b.name))
    passed = []
    for info in ranked:
        probe = registry.first("vlft_probe_backend", backend=info.name)
        if probe.available:
            why = f"highest-priority available backend (priority {info.priority})"
            if passed:
                why += "; skipped " + "; ".join(passed)
            return BackendChoice(info, probe, why)
        passed.append(f"{info.name}: {probe.reason}")
    raise BackendUnavailable("no backend is available: " + "; ".join(passed))


def require_available(choice: BackendChoice) -> None:
    if not choice.probe.available:
        raise BackendUnavailable(
            f"backend '{choice.info.name}' is not available here: {choice.probe.reason}\n"
            f"Run `vlft doctor --backend {choice.info.name}` for what to install or set."
        )


HALF_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def resolve_precision(registry: Registry, backend: str, config: RunConfig):
    """The backend's precision policy, with the base-weight dtype the user asked for.

    Half-precision base weights compute in their own dtype, so ``--param-dtype bf16``
    with ``--precision auto`` asks the backend for bf16 compute; an explicit
    mismatch (fp16 weights under fp32 or bf16 compute) is refused.
    """
    asked = config.precision
    if config.param_dtype == "nf4":
        return _four_bit_precision(registry, backend, config)
    if config.double_quant:
        raise ConfigError("--double-quant applies to --param-dtype nf4 only")
    if asked == "auto" and config.param_dtype in HALF_DTYPES:
        asked = config.param_dtype
    policy = registry.first(
        "vlft_precision_policy", backend=backend, config=dataclasses.replace(config, precision=asked)
    )
    if config.param_dtype == "auto":
        return policy
    dtype = HALF_DTYPES.get(config.param_dtype, "float32")
    if dtype != "float32" and policy.autocast_dtype != dtype:
        raise ConfigError(
            f"--param-dtype {config.param_dtype} needs {config.param_dtype} compute, but the precision is "
            f"{policy.name}; use --precision {config.param_dtype} (or auto), or --param-dtype fp32"
        )
    policy.param_dtype = dtype
    policy.param_reason = f"{config.param_dtype} weights, as asked"
    return policy


def _four_bit_precision(registry: Registry, backend: str, config: RunConfig):
    """``--param-dtype nf4``: linear weights in 4-bit NF4, everything else bf16, bf16 compute; the backend says
    whether it can (``four_bit``) and why not."""
    if config.precision not in ("auto", "bf16"):
        raise ConfigError(f"--param-dtype nf4 computes in bf16; use --precision bf16 (or auto), not {config.precision}")
    policy = registry.first(
        "vlft_precision_policy",
        backend=backend,
        config=dataclasses.replace(config, precision="bf16", param_dtype="bf16"),
    )
    if not policy.four_bit:
        raise ConfigError(
            f"--param-dtype nf4: backend {backend} cannot train on 4-bit weights: "
            f"{policy.four_bit_reason or 'it does not offer them'}"
        )
    policy.param_dtype, policy.autocast_dtype = "bfloat16", "bfloat16"
    policy.quantization, policy.double_quant = "nf4", config.double_quant
    policy.param_reason = (
        f"nf4 linear weights (absmax per 64-block{', double-quantized' if config.double_quant else ''}"
        f"), the rest bf16, as asked; {policy.four_bit_reason}"
    )
    return policy


def resolve_policies(
    registry: Registry,
    config: RunConfig,
    model_path: str,
    model_config,
    backend: BackendChoice | None = None,
    *,
    family: ModelFamily,
) -> RunPlan:
    """Ask the plugins once for every policy: a plan of the policies alone (``preflight.plan_run`` adds what the
    data and the model's shape decide). A real run passes the ``backend`` it has already set up the device for,
    so policies that read device properties see the right device."""
    backend = backend or choose_backend(registry, config.backend)
    name = backend.info.name
    method = registry.method(config.method)
    adapter = registry.first("vlft_adapter_defaults", method=method.name, config=config)
    options = DataLoaderOptions()
    registry.hook.vlft_dataloader_options(backend=name, config=config, options=options)
    if config.num_workers is not None:
        options.num_workers = config.num_workers
        options.reasons.append(f"num_workers={config.num_workers}, as asked")
    objective = resolve_objective(registry, config)
    precision = resolve_precision(registry, name, config)
    distributed = registry.first("vlft_distributed_options", backend=name, config=config)
    offered = [
        k
        for ks in registry.hook.vlft_kernel_patches(
            backend=name, config=config, model_config=model_config, family=family
        )
        if ks
        for k in ks
    ]
    kernels = choose_kernels(offered, config)
    attention = with_kernel_attention(
        registry.first("vlft_attention_implementation", backend=name, config=config, model_config=model_config), kernels
    )
    return RunPlan(
        config=config,
        backend=backend,
        precision=precision,
        attention=attention,
        kernels=kernels,
        packing=objective_packing(resolve_packing(config.packing, attention, family), objective, config.packing),
        dataloader=options,
        distributed=distributed,
        method=method,
        adapter=adapter,
        lr=config.lr if config.lr is not None else adapter.lr,
        model_path=model_path,
        sharding=resolve_sharding(config, distributed, name, precision),
        family=family,
        objective=objective,
    )


def resolve_objective(registry: Registry, config: RunConfig) -> Objective:
    """The objective ``--objective`` names, its options checked by its plugin; ``--shard fsdp`` where it cannot
    run sharded is refused with its reason."""
    objective = registry.objective_for(config)
    if config.shard == "fsdp" and objective.sharding_refusal:
        raise ConfigError(
            f"--shard fsdp: the {objective.name} objective cannot run sharded: "
            f"{objective.sharding_refusal}; nothing was started."
        )
    return objective


def objective_packing(packing: PackingPlan, objective: Objective, mode: str) -> PackingPlan:
    """``packing`` as the objective allows it: an objective that cannot pack pads (``auto``) or stops (``on``)."""
    if not packing.enabled or not objective.packing_refusal:
        return packing
    if mode == "on":
        raise ConfigError(
            f"--packing on: the {objective.name} objective cannot pack: {objective.packing_refusal}; "
            f"use --packing auto or off (padded batches)"
        )
    return PackingPlan(
        False, reason=f"auto: padded, since the {objective.name} objective cannot pack: {objective.packing_refusal}"
    )


def _sequence_lines(sp: dict | None) -> list[str]:
    if not sp or sp["size"] == 1:
        return []
    return [
        f"sequence     split over {sp['size']} processes (Ulysses: each holds 1/{sp['size']} of a sample's tokens "
        f"and attends with {sp['heads_per_process']} heads over all of them); they train on the same batches"
    ]


def _sharding_lines(sh: dict | None) -> list[str]:
    if not sh or sh["strategy"] == "none":
        return [f"sharding     none ({sh['reason']})"] if sh else []
    blocks = " + ".join(f"{n} {cls}" for cls, n in sh["wrapped"].items()) or "the model's blocks"
    return [
        f"sharding     fsdp over {sh['world_size']} process(es) ({sh['reason']})",
        f"             fully_shard on {blocks}, then the root; parameters gathered in "
        f"{sh['param_dtype'] or 'their own dtype'}, gradients reduced in {sh['reduce_dtype']}"
        + (" (SUM, divided by FSDP)" if sh["sum_reductions"] else ""),
        (
            "             loading: each process reads only its own shares of the safetensors files"
            if sh["loading"] == "each"
            else f"             loading: rank 0 reads the whole checkpoint and sends the shares out ({sh['loading_reason']})"
        ),
        *(
            [
                "             offload: cpu (FSDP2 CPUOffloadPolicy: shares, gradients and AdamW state on the host, "
                "copied to the device block by block each forward and backward; the optimizer steps on the host)"
            ]
            if sh["offload"] == "cpu"
            else []
        ),
        "             evaluation: each process answers an equal share (padded with repeats whose answers are "
        "dropped), all decoding in step (synced_gpus); every decoding step gathers every block, so it is "
        "slower than unsharded",
        "             checkpoints: AdamW state in one share per process (torch.distributed.checkpoint), the "
        "adapter gathered and saved once by rank 0",
    ]


def _count(n: int) -> str:
    """Parameters at a glance: ``1.8 M``, ``6.6 K``, ``512``."""
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K" if n >= 1e3 else str(n)


def _spans(indices: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``2-4, 7``."""
    spans: list[list[int]] = []
    for i in sorted(indices):
        if spans and i == spans[-1][-1] + 1:
            spans[-1].append(i)
        else:
            spans.append([i])
    return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else f"{s[0]}" for s in spans)


def _split_name(name: str) -> tuple[str, int, str] | None:
    """``(stack, index, rest)`` at the first number segment of a dotted module name
    (``a.b.blocks.3.attn.qkv`` -> ``("a.b.blocks", 3, "attn.qkv")``); None without one."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def _tower_names(stacks: dict[str, set[int]], summary: dict) -> dict[str, str]:
    """Each stack's tower ("vision" or "text"), from the target summary: one tower adapted names every
    stack; both name the stack whose indices are the adapted vision blocks "vision", the other "text"
    (in listing order, vision first, where the indices do not tell). Stacks beyond that keep their path."""
    towers = summary.get("towers")
    if towers in ("vision", "text") and len(stacks) == 1:
        return {stack: towers for stack in stacks}
    names = {}
    if towers == "both" and len(stacks) == 2:
        blocks = set(summary.get("vision_blocks") or [])
        first, second = stacks
        matches = [s for s in (first, second) if stacks[s] == blocks]
        vision = matches[0] if len(matches) == 1 else first
        names = {vision: "vision", (second if vision == first else first): "text"}
    return names


def _rest(name: str) -> str:
    split = _split_name(name)
    assert split is not None  # a name grouped under a layer has its number
    return split[2]


def group_modules(modules: dict[str, int | None], summary: dict) -> list[str]:
    """The adapted modules, one line per tower and layer range: ``vision blocks 26-31: qkv, proj (12 modules,
    1.8 M)``. The layer is the first number segment of each dotted name and the stack the path before it,
    so no model family's names are assumed; consecutive layers adapting the same modules share a line."""
    stacks: dict[str, dict[int, list[str]]] = {}
    others: list[str] = []
    for name in modules:
        split = _split_name(name)
        if split is None:
            others.append(name)
            continue
        stack, index, rest = split
        stacks.setdefault(stack, {}).setdefault(index, []).append(name)
    towers = _tower_names({s: set(layers) for s, layers in stacks.items()}, summary)
    lines = []
    for stack, layers in stacks.items():
        container = stack.rsplit(".", 1)[-1]
        label = f"{towers[stack]} {container}" if stack in towers else stack
        rests = {_rest(n) for names in layers.values() for n in names}
        leaves = {r.rsplit(".", 1)[-1] for r in rests}
        short = len(leaves) == len(rests)  # the leaf names are enough when no two modules share one

        def kinds(names, short=short):
            return tuple((r.rsplit(".", 1)[-1] if short else r) for r in (_rest(n) for n in names))

        runs: list[list[int]] = []
        for index in sorted(layers):
            if runs and index == runs[-1][-1] + 1 and kinds(layers[index]) == kinds(layers[runs[-1][0]]):
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            names = [n for i in run for n in layers[i]]
            span = f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}"
            params = sum(modules[n] or 0 for n in names)
            lines.append(
                f"{label} {span}: {', '.join(kinds(layers[run[0]]))} "
                f"({len(names)} module{'s' if len(names) != 1 else ''}, {_count(params)})"
            )
    lines += [f"{name} (1 module, {_count(modules[name] or 0)})" for name in others]
    return lines


def _objective_lines(obj: dict | None, init_adapter: str | None) -> list[str]:
    if not obj:
        return []
    options = " ".join(f"{k}={v}" for k, v in obj["options"].items())
    lines = [
        f"objective    {obj['name']}" + (f" {options}" if options else "") + f": {obj['description']}",
        f"             data: {obj['layout']}; loss averaged over {obj['average_over']}"
        + (f"; {obj['rows_per_record']} sequences per record" if obj["rows_per_record"] > 1 else ""),
    ]
    if obj["reference"]:
        lines.append(f"             reference: {obj['reference']}, without gradients, before the trained pass")
    if not obj["dropout"]:
        lines.append(
            "             dropout: off in every pass (the trained pass computes what the reference and "
            "generation compute)"
        )
    if obj["figures"]:
        lines.append(f"             logs: {', '.join(obj['figures'])} (and val_ of each)")
    if init_adapter:
        lines.append(f"             starts from the adapter in {init_adapter} (--init-adapter)")
    return lines


def _family_lines(fam: dict | None) -> list[str]:
    if not fam:
        return []
    c = fam.get("parameters") or {}
    counts = (
        (
            f": {c['total']:,} parameters ({c['vision']:,} vision"
            + (f", {c['experts']:,} in experts" if c.get("experts") else "")
            + ")"
        )
        if c
        else ""
    )
    return [
        f"family       {fam['name']} ({', '.join(fam['model_types'])}){counts}; boxes {fam['box_coordinates']}",
        *([f"             {fam['description']}"] if fam.get("description") else []),
    ]


def _optimizer_lines(opt: dict | None) -> list[str]:
    """One line: each AdamW group's absolute peak learning rate and trainable parameters."""
    if not opt or not opt.get("groups"):
        return []
    groups = ", ".join(f"{g} {v['lr']:g} ({v['parameters']:,} trainable)" for g, v in opt["groups"].items())
    line = f"optimizer    AdamW groups, peak lr (absolute): {groups}"
    if opt.get("train_merger"):
        line += f"\n             merger trained in full: {opt['merger_parameters']:,} parameters (PEFT modules_to_save)"
    return [line]


def format_plan(desc: dict, verbose: bool = False) -> str:
    """The plan as text; the adapted modules grouped per tower and layer range, or with ``verbose`` one
    line each."""
    b, a, p = desc["backend"], desc["attention"], desc["precision"]
    dl, dist, m, t = desc["dataloader"], desc["distributed"], desc["method"], desc["targets"]
    status = "available" if b["available"] else f"UNAVAILABLE here ({b['reason']})"
    lines = [
        f"backend      {b['name']} (device type {b['device_type']}): {status}",
        f"             chosen: {b['chosen_because']}",
        f"attention    vision={a['vision']} text={a['text']}" + (f"  ({a['reason']})" if a["reason"] else ""),
        *([f"packing      {'on' if pk['enabled'] else 'off'}: {pk['reason']}"] if (pk := desc.get("packing")) else []),
        f"precision    {p['name']}: params {p['param_dtype']}, autocast {p['autocast_dtype'] or 'off'}, "
        + (
            f"dynamic loss scaling (initial scale {p['init_scale']:g}, growth interval {p['growth_interval']})"
            if p["loss_scaling"]
            else "no loss scaling"
        )
        + (f"  ({p['reason']})" if p["reason"] else ""),
        f"dataloader   pin_memory={dl['pin_memory']} num_workers={dl['num_workers']}"
        + (f" prefetch_factor={dl['prefetch_factor']}" if dl["prefetch_factor"] else ""),
        f"distributed  {dist['process_group_backend']} (timeout {dist['timeout_s']} s)"
        + "".join(f"\n             {k}={v}" for k, v in dist["env"].items()),
        *_sharding_lines(desc.get("sharding")),
        *_sequence_lines(desc.get("sequence_parallel")),
        f"method       {m['name']} lr={m['lr']:g} " + " ".join(f"{k}={v}" for k, v in m["hyperparameters"].items()),
        *_objective_lines(desc.get("objective"), desc.get("init_adapter")),
        f"model        {desc['model']}",
        *_family_lines(desc.get("model_family")),
        f"targets      {t['towers']}: vision blocks {_spans(t['vision_blocks']) or 'none'} of {t['vision_depth']}, "
        f"{t['text_layers']} text layers; {len(t['modules'])} modules, {t['adapter_parameters']:,} adapter parameters",
    ]
    if verbose:
        lines += [f"             {name}  ({count:,} params)" for name, count in t["modules"].items()]
    else:
        lines += [f"             {line}" for line in group_modules(t["modules"], t)]
    ex = t.get("experts")
    if ex:
        lines.append(
            f"experts      {', '.join(ex['parameters'])}: "
            + (
                f"adapted in {ex['layers']} layers ({ex['adapter_parameters']:,} adapter parameters)"
                if ex["adapted"]
                else "not adapted (lora: --adapter-opt target_experts=true adapts them)"
            )
            + f"; router {', '.join(ex['routers'])} frozen"
        )
    pd, ck, ln = desc["param_dtype"], desc["checkpointing"], desc["lengths"]
    lines.append(
        f"weights      base {pd['dtype']}" + (f" ({pd['reason']})" if pd["reason"] else "") + ", trainable float32"
    )
    lines += _optimizer_lines(desc.get("optimizer"))
    lines.append(f"checkpoint   {'on' if ck['enabled'] else 'off'} ({ck['reason']})")
    if ln:
        lines.append(
            f"lengths      longest {ln['longest']} tokens, median {ln['median']}, limit "
            f"{ln['max_length'] or 'none'}" + (f"; {ln['skipped']} sample(s) over it skipped" if ln["skipped"] else "")
        )
        lines += [f"             skipped {s['where']} ({s['length']} tokens)" for s in ln["skipped_samples"][:20]]
    if desc["memory"]:
        lines += format_memory(desc["memory"])
    lines += format_kernels(desc.get("kernels"))
    if desc.get("scorers"):
        lines.append(f"scorers      {describe_line(desc['scorers'])}")
    lines += [f"note         {n}" for n in desc["notes"]]
    if desc.get("model_patches"):
        lines += ["patches      " + "; ".join(desc["model_patches"])]
    for w in b["warnings"]:
        lines.append(f"warning      {w}")
    return "\n".join(lines)
