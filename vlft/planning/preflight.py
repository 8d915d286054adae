"""Everything a run decides before any weight is loaded or anything is written.

The order keeps the promise "bad input loses nothing": the model config and
every policy, then every data record (lengths included), then the adapter's
targets and the memory plan on a weightless copy of the model. ``--dry-run``
stops here and prints the plan; a real run stops here too when the memory
plan says the run cannot fit.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vlft.config import RunConfig, parse_bytes, parse_columns, split_data_spec
from vlft.contracts.backend import DeviceCapacity
from vlft.data.columnar import data_files, unread_columns
from vlft.data.demo import RECOMMENDED_EPOCHS, write_demo_dataset
from vlft.data.encoding import SampleEncoder
from vlft.data.layouts import demo_files, record_format
from vlft.data.lazy import concat, read_compact, take, weighted
from vlft.data.lazy import media_files as lazy_media
from vlft.data.lazy import modalities as lazy_modalities
from vlft.data.lengths import LengthReport, check_lengths
from vlft.data.order import DataOrder, run_micro_batches, total_steps_for
from vlft.data.packing import padding_ratio, settle_auto
from vlft.data.records import MAX_REPORTED_PROBLEMS
from vlft.errors import ConfigError, DataError
from vlft.floors import require_torch
from vlft.models.adapting import compute_adapters_in_autocast_dtype
from vlft.models.bundled import is_bundled
from vlft.models.embedded import cache_root
from vlft.models.families import (
    base_model,
    count_parameters,
    family_load_kwargs,
    frozen_router_parameters,
)
from vlft.models.groups import check_merger_trained, describe_groups
from vlft.models.loading import (
    load_processor,
    model_config_and_family,
    resolve_model_path,
)
from vlft.models.targets import select_targets
from vlft.planning import checked, fixes, memory, trace
from vlft.planning.init_adapter import check_init_adapter, init_adapter_source
from vlft.planning.plan import RunPlan, resolve_policies
from vlft.planning.scorers import scorers_for_run
from vlft.planning.sequence import plan_sequence_split
from vlft.planning.sharding import count_blocks, loading_bytes, loading_choice
from vlft.registry import Registry

DEFAULT_DATA_DIR_NAME = "demo-data"


def resolve_data_paths(config: RunConfig, objective=None) -> tuple[list[tuple[Path, float]], Path | None]:
    """[(training file, sampling weight)], and the validation file or None. Without --data: the embedded demo
    set, in the objective's layout (``data.layouts.demo_files``)."""

    if not config.data:
        folder = cache_root() / DEFAULT_DATA_DIR_NAME
        if objective is not None:
            train, val = demo_files(objective, folder)
        else:
            ds = write_demo_dataset(folder)
            train, val = ds.train, ds.val
        return [(train, 1.0)], (Path(config.val_data) if config.val_data else val)
    specs = [config.data] if isinstance(config.data, str) else config.data
    return [(Path(p), w) for p, w in map(split_data_spec, specs)], (Path(config.val_data) if config.val_data else None)


def read_training_files(config: RunConfig, objective=None) -> tuple[Sequence, Path | None]:
    """Every training file read and weighted (all files' problems reported together), and the validation path."""
    files, val_path = read_training_files_unweighted(config, objective)
    return concat([weighted(records, weight, config.seed) for records, weight in files]), val_path


def read_training_files_unweighted(config: RunConfig, objective=None) -> tuple[list[tuple[list, float]], Path | None]:
    """[(a training file's records, its weight)] (all files' problems reported together), and the
    validation path. Records are read in the objective's layout (``Objective.layout``)."""

    files, val_path = resolve_data_paths(config, objective)
    train, messages = [], []
    for path, weight in files:
        records, problems = read_compact(
            path,
            image_root=config.image_root,  # columnar: rows, not objects
            add_placeholders=config.add_placeholders,
            columns=parse_columns(config.columns),
            parse=_parse(objective),
        )
        try:
            problems.raise_if_any()
        except DataError as e:
            messages.append(str(e))
            continue
        if not records:
            messages.append(f"{path} holds no records")
        train.append((records, weight))
    if messages:
        raise DataError("\n".join(messages))
    return train, val_path


def load_and_check_data(config: RunConfig, encoder, objective=None) -> tuple[Sequence, Sequence, LengthReport]:
    """Read and check both splits, lengths included; samples over --max-length stop the run or are skipped.
    The result is kept in the user's cache while the files are unchanged (``planning.checked``), and under
    torchrun one process per machine checks. ``objective``: whose layout the records are read in."""
    files, val_path = resolve_data_paths(config, objective)
    try:  # each shard of a folder or glob is a file of the cache key
        paths = [f for p in [p for p, _ in files] + ([val_path] if val_path is not None else []) for f in data_files(p)]
    except DataError:  # the reader names what is missing, with the other files' problems
        return _load_and_check_data(config, encoder, objective)

    def media(result):  # columnar records noted their media while they were checked; lists are walked
        found = {}
        for part in result[:2]:
            noted = lazy_media(part)
            found.update(checked.media_files(part) if noted is None else noted)
        return found

    train, val, lengths = checked.checked(
        config, encoder, paths, lambda: _load_and_check_data(config, encoder, objective), media
    )
    check_enough_records(len(train), config)
    return train, val, lengths


def _load_and_check_data(config: RunConfig, encoder, objective=None) -> tuple[Sequence, Sequence, LengthReport]:
    files, val_path = read_training_files_unweighted(config, objective)
    if val_path is not None:
        val = _read_validation(val_path, config, objective)
    else:
        # no validation file: hold out a seeded 10% (at least one record) of the records as read, then weight
        # the rest (weighting first would put copies of one record in both)
        # (the records of all files in a row: file f's record i is starts[f] + i; flags, not a set of pairs)
        starts = np.cumsum([0] + [len(records) for records, _ in files])
        order = list(range(int(starts[-1])))
        random.Random(config.seed).shuffle(order)
        n_val = max(1, len(order) // 10) if len(order) > 1 else 0
        held = np.zeros(len(order), dtype=bool)
        held[order[:n_val]] = True
        del order
        val = concat(
            [take(records, np.flatnonzero(held[starts[f] : starts[f + 1]])) for f, (records, _) in enumerate(files)]
        )
        kept = [
            (take(records, np.flatnonzero(~held[starts[f] : starts[f + 1]])), w) for f, (records, w) in enumerate(files)
        ]
        if sum(len(r) for r, _ in kept):
            files = kept
    train = concat([weighted(records, weight, config.seed) for records, weight in files])
    # measuring renders every record with the chat template, which checks it splits into prompt and reply
    train, lengths = check_lengths(train, encoder, config.max_length, config.skip_too_long, "training data")
    val, val_lengths = (
        check_lengths(val, encoder, config.max_length, config.skip_too_long, "validation data") if val else (val, None)
    )
    if val_lengths is not None:
        lengths.skipped += [dict(s, split="validation") for s in val_lengths.skipped]
    check_enough_records(len(train), config)
    return train, val, lengths


def _read_validation(path: Path, config: RunConfig, objective=None):
    """The validation file's records (columnar: their rows), every one checked; its problems raised."""
    records, problems = read_compact(
        path,
        image_root=config.image_root,
        add_placeholders=config.add_placeholders,
        columns=parse_columns(config.columns),
        parse=_parse(objective),
    )
    problems.raise_if_any()
    if not records:
        raise DataError(f"{path} holds no records")
    return records


def _any_grid(grids) -> bool:
    """Whether any sample has an image grid (a columnar set's grids are flat arrays: no walk of every sample)."""
    flat = getattr(grids, "flat", None)
    return len(flat) > 0 if flat is not None else any(grids)


def _parse(objective):
    """The reader of the objective's record layout; None: the supervised layouts."""
    return record_format(objective.layout).parse if objective is not None else None


def unread_column_notes(config: RunConfig) -> list[str]:
    """One note per columnar data file with columns no layout reads (listed, not silently dropped)."""
    files, val_path = resolve_data_paths(config)
    notes = []
    for spec in [p for p, _ in files] + ([val_path] if val_path is not None else []):
        for file, names in unread_columns(spec, parse_columns(config.columns)).items():
            notes.append(
                f"{file}: columns not read: {', '.join(names)} (--columns OURS=THEIRS reads one as a key vlft knows)"
            )
    return notes


def check_enough_records(n_train: int, config: RunConfig) -> None:
    """Every process needs at least one training record; fewer than one batch trains on a smaller batch."""

    if n_train < config.data_world:  # processes that split one sequence (--sequence-parallel) share records
        raise DataError(
            f"{n_train} training record(s) for {config.data_world} processes: every process needs at least one "
            f"record. Add records or run on at most {max(n_train, 1)} process(es); nothing was written."
        )


@dataclass(frozen=True)
class TargetChoice:
    """The modules (and fused expert weights) the adapter goes on, and what adapting them made trainable."""

    modules: list[str]
    parameters: list[str]  # fused expert weights (PEFT target_parameters)
    summary: dict  # towers, vision blocks and depth, text layers
    params: dict[str, int]  # module -> adapter parameters
    merger_parameters: int  # --train-merger: merger parameters trained in full
    param_groups: dict[str, dict]  # AdamW group -> {"lr", "parameters"}


def plan_targets(registry: Registry, plan: RunPlan, model) -> tuple[torch.nn.Module, TargetChoice]:
    """Adapt ``model`` (real or on 'meta') as ``plan``'s policies say; the adapted model, and the targets with
    their adapter parameter counts."""

    experts = plan.adapter.target_experts
    if experts and plan.family.experts is None:
        raise ConfigError(
            f"{plan.method.name}: target_experts=true, but the {plan.family.name} family has no fused "
            f"expert weights (not a mixture-of-experts model)"
        )
    tp = select_targets(
        model, plan.adapter, plan.config.targets, plan.config.vision_last_n, plan.family, experts=experts
    )
    adapted = registry.first(
        "vlft_apply_adapter",
        method=plan.method.name,
        model=model,
        targets=tp.modules,
        config=plan.config,
        target_parameters=tp.parameters,
        family=plan.family,
    )
    # the fused experts' adapters sit on the experts module (PEFT names them experts[.base_layer].lora_*)
    owners = tp.modules + sorted({p.rpartition(".")[0] for p in tp.parameters})
    counts: dict[str, int] = {}
    for name, p in adapted.named_parameters():
        if not p.requires_grad:
            continue
        for target in owners:
            if f"{target}." in name:
                counts[target] = counts.get(target, 0) + p.numel()
                break
    merger = check_merger_trained(adapted, plan.family, plan.method.name) if plan.config.train_merger else 0
    groups = describe_groups(adapted, plan.family, plan.lr, plan.config)
    routers = set(frozen_router_parameters(adapted, plan.family))
    training = [n for n, p in base_model(adapted).named_parameters() if p.requires_grad and n in routers]
    if training:
        raise ConfigError(
            f"method {plan.method.name} made router parameters trainable ({training[0]}, ...); routers must stay frozen"
        )
    summary = {
        "towers": tp.towers,
        "vision_blocks": tp.vision_blocks,
        "vision_depth": tp.vision_depth,
        "text_layers": tp.text_layers,
    }
    return adapted, TargetChoice(tp.modules, tp.parameters, summary, counts, merger, groups)


@dataclass(frozen=True)
class _Data:
    """The run's records, checked, and what reading them decided."""

    train: Sequence
    val: Sequence
    lengths: LengthReport
    total_steps: int
    packing: object  # data.packing.PackingPlan, auto settled against the data's padding
    notes: list[str]


def plan_run(registry: Registry, config: RunConfig, choice=None) -> RunPlan:
    """Everything a run decides before loading weights; ``--dry-run`` stops after this. The plan is built once,
    here, and not changed after.

    Order: backend, method, model config, data (lengths included), policies, targets on a weightless
    copy of the model, then the memory plan against the device's capacity.
    """
    require_torch()  # the training stage's torch, before anything of the run is loaded
    model_path = resolve_model_path(config.model, registry)
    model_config, family = model_config_and_family(model_path, registry)  # the family: asked once, here
    # checks the method and --adapter-opt
    policies = resolve_policies(registry, config, model_path, model_config, choice, family=family)
    processor, encoder = _encoder(registry, policies, model_path)
    init_source = init_adapter_source(registry, config)
    data = _read_data(registry, policies, model_path, encoder)
    scorers = scorers_for_run(registry, config, data.val, family)  # --scorer, on the references it will score
    skeleton, targets = _adapted_skeleton(registry, policies, model_config)
    sequence = plan_sequence_split(config, model_config, family, policies.attention, policies.objective, skeleton)
    sharding = policies.sharding
    if sharding.enabled:
        loading, why = loading_choice(config, model_path, skeleton, policies.precision.quantization)
        sharding = dataclasses.replace(
            sharding, wrapped=count_blocks(skeleton, family), loading=loading, loading_reason=why
        )
    capacity = registry.hook.vlft_device_capacity(backend=policies.backend.info.name, config=config) or DeviceCapacity(
        None, 0, f"backend {policies.backend.info.name} does not report its memory"
    )
    memory_plan = _memory_plan(policies, skeleton, model_config, data, capacity, init_source is not None)
    notes = [*data.notes, *_memory_notes(policies, memory_plan)]
    init_adapter = None
    if init_source is not None:
        init_adapter = check_init_adapter(
            config, targets.modules, init_source, [n for n, _ in base_model(skeleton).named_modules()]
        )
    if sharding.enabled:
        notes.append(_loading_note(sharding, memory_plan, skeleton, policies.precision.param_dtype))
    return dataclasses.replace(
        policies,
        targets=targets.modules,
        target_parameters=targets.parameters,
        target_summary=targets.summary,
        target_params=targets.params,
        merger_parameters=targets.merger_parameters,
        param_groups=targets.param_groups,
        packing=data.packing,
        sharding=sharding,
        sequence=sequence,
        memory=memory_plan,
        lengths=data.lengths.describe(config.max_length),
        notes=tuple(notes),
        model_counts=count_parameters(skeleton, family),
        peak_flops=capacity.peak_flops,
        init_adapter=init_adapter,
        scorers=scorers,
        model_config=model_config,
        processor=processor,
        encoder=encoder,
        train_records=data.train,
        val_records=data.val,
        train_lengths=data.lengths.lengths,
        total_steps=data.total_steps,
        skeleton=skeleton,
    )


def _loading_note(sharding, memory_plan: memory.MemoryPlan, skeleton, param_dtype: str) -> str:
    """What loading the base weights under --shard fsdp holds in each process's host memory, and why."""
    whole, world = sum(memory_plan.base_weights.values()), sharding.world_size
    itemsize = torch.empty((), dtype=getattr(torch, param_dtype)).element_size()
    largest = max((p.numel() * itemsize for p in skeleton.parameters() if not p.requires_grad), default=0)
    host = memory.gib(loading_bytes(whole, largest, world, sharding.loading))
    if sharding.loading == "each":
        return (
            f"--shard fsdp: each process reads only its own 1/{world} shares of the base weights from the "
            f"safetensors files (torch.distributed.checkpoint's HuggingFaceStorageReader): host memory for "
            f"loading {host} per process beside what it holds before (its share of {memory.gib(whole)}, plus the "
            f"largest tensor, {memory.gib(largest)}, in flight); the file pages it maps while reading, up to its "
            "share again, are page cache the kernel reclaims"
        )
    return (
        f"--shard fsdp: rank 0 alone reads the base weights, into its host memory ({memory.gib(whole)}; "
        f"{host} for loading, with its own share); the other processes build the model without weights and "
        f"receive their 1/{world} shares from it. Each process cannot read its own: {sharding.loading_reason}"
    )


def _encoder(registry: Registry, policies: RunPlan, model_path: str):
    """The processor, and the encoder of the objective's samples."""
    config, family, objective = policies.config, policies.family, policies.objective
    processor = load_processor(model_path, family, registry)
    encoder = SampleEncoder(
        processor,
        max_pixels=config.max_pixels,
        video_fps=config.video_fps,
        video_max_frames=config.video_max_frames,
        family=family,
    )
    encoder = record_format(objective.layout).encoder(encoder)  # DPO's: chosen and rejected sharing the images
    return processor, encoder


def _read_data(registry: Registry, policies: RunPlan, model_path: str, encoder) -> _Data:
    """Every record read and checked (lengths included); the steps they make, and packing settled where it was
    left to the data (``--packing auto``)."""
    config, objective = policies.config, policies.objective
    train, val, lengths = load_and_check_data(config, encoder, objective)
    check_for_objective(objective, train, val)
    notes = [*objective.notes, *unread_column_notes(config)]
    if is_bundled(model_path, registry):
        notes.append(
            "bundled config without weights: text lengths counted with the embedded tokenizer "
            "(a stand-in; image tokens are exact)"
        )
    epochs = config.epochs
    if epochs is None and config.steps is None and not config.data:
        epochs = objective.demo_epochs or RECOMMENDED_EPOCHS
    total_steps = total_steps_for(
        len(train), config.steps, epochs, config.batch_size, config.grad_accum, config.data_world, objective.iterations
    )
    order = DataOrder(
        config.batch_size,
        config.grad_accum,
        config.seed,
        world_size=config.data_world,
        lengths=lengths.lengths if config.group_by_length else None,
        repeat=objective.iterations,
    )
    packing = settle_auto(
        policies.packing,
        config.packing,
        padding_ratio(  # auto: packs where the data pads
            lengths.lengths, list(run_micro_batches(len(train), order, total_steps))
        ),
    )
    return _Data(train, val, lengths, total_steps, packing, notes)


def _adapted_skeleton(registry: Registry, policies: RunPlan, model_config) -> tuple[torch.nn.Module, TargetChoice]:
    """The targets chosen and adapted on a weightless copy, in the dtype the layers will compute in."""
    precision = policies.precision
    compute = precision.autocast_dtype or precision.param_dtype
    skeleton, targets = plan_targets(
        registry,
        policies,
        trace.skeleton(
            model_config,
            policies.attention,
            getattr(torch, compute),
            family_load_kwargs(policies.family, precision.param_dtype),
        ),
    )
    if precision.autocast_dtype:  # under autocast the adapters compute in its dtype too (see model.py)
        skeleton.to(getattr(torch, compute))
        compute_adapters_in_autocast_dtype(skeleton)
    return skeleton, targets


def _memory_plan(
    policies: RunPlan, skeleton, model_config, data: _Data, capacity: DeviceCapacity, init_adapter: bool
) -> memory.MemoryPlan:
    """The memory plan of the largest batches against the device's capacity, with checkpointing settled and,
    when it does not fit, the fixes that would make it fit."""
    config, family, objective, precision = policies.config, policies.family, policies.objective, policies.precision
    compute = precision.autocast_dtype or precision.param_dtype
    total, source = capacity.total_bytes, capacity.source
    if config.device_memory:
        total, source = parse_bytes(config.device_memory, "--device-memory"), f"--device-memory {config.device_memory}"
    lengths = data.lengths
    order = DataOrder(
        config.batch_size,
        config.grad_accum,
        config.seed,
        world_size=config.data_world,
        lengths=lengths.lengths if config.group_by_length else None,
    )
    shapes = memory.largest_batches(
        lengths.lengths,
        lengths.grids,
        order,
        math.ceil(data.total_steps / objective.iterations),  # the steps drawing batches
        labelled=lengths.labelled,
    )
    if objective.rows_per_record > 1:  # every record runs as that many rows (its images once: models.rows)
        shapes = [dataclasses.replace(shape, samples=shape.samples * objective.rows_per_record) for shape in shapes]
    shard_world, gathered = 1, 0
    if policies.sharding.enabled:
        shard_world, gathered = config.world_size, memory.fsdp_gathered_bytes(skeleton, compute, family)
    basis = memory.MemoryBasis(
        skeleton,
        model_config,
        precision.param_dtype,
        precision.autocast_dtype,
        family,
        reserved_bytes=capacity.reserved_bytes,
        capacity_bytes=total,
        capacity_source=source,
        shard_world=shard_world,
        gathered_bytes=gathered,
        quantization=precision.quantization,
        double_quant=precision.double_quant,
        guard_copy=guard_copies(policies),
        sequence_split=config.sequence_parallel,
        offload=policies.sharding.offload == "cpu",
    )
    planned = memory.worst_plan(basis, shapes)
    if objective.generation:  # the step samples (GRPO): its KV cache, in the compute dtype
        worst = max(shapes, key=lambda shape: shape.samples * shape.tokens)
        planned.generation_bytes = memory.generation_bytes(model_config, compute, worst.samples, worst.tokens)
        planned.generation_shape = (
            f"{worst.samples} sequences ({config.batch_size} prompts x "
            f"{objective.generation.sequences_per_record}) x "
            f"{worst.tokens} tokens (prompt + "
            f"{objective.generation.new_tokens} new)"
        )
    if objective.reference and init_adapter:  # the reference keeps the adapter the run started from
        planned.reference_bytes = 4 * planned.adapter_parameters
    fixes.decide(planned, basis, config, can_shard=bool(policies.distributed and policies.distributed.fsdp))
    if not policies.objective.supervised:  # the split trains the supervised loss only (planning.sequence)
        planned.fixes = [f for f in planned.fixes if not f.startswith("--sequence-parallel")]
    if family.image_inputs is not None and not _any_grid(lengths.grids) and "image" in lazy_modalities(data.train):
        # a processor-writes-the-tokens family without ImageInputs.grid: no grid, so no tower to trace
        planned.activations.untraced.append(
            f"vision activations of the {family.name} family (its image inputs give no patch grids: "
            "ImageInputs.grid; the plan counts 0 image patches)"
        )
    return planned


def _memory_notes(policies: RunPlan, planned: memory.MemoryPlan) -> list[str]:
    notes = []
    objective = policies.objective
    if objective.reference:
        notes.append(
            f"{objective.name}: the reference pass runs without gradients before the trained pass, "
            "so its activations are freed before the trained pass's; it keeps only the "
            "log-probabilities the loss compares"
        )
    return notes + [f"not traced, counted as 0: {what}" for what in planned.activations.untraced]


def check_for_objective(objective, train, val) -> None:
    """The objective's own check of the records (``Objective.check``), every run: its problems, as file:line."""
    problems = objective.check([*train, *val])
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise DataError(
            f"{len(problems)} problem(s) for the {objective.name} objective:\n  "
            + "\n  ".join(shown)
            + more
            + "\nFix these records (or the objective's options) and run again; nothing was "
            "written."
        )


def check_fits(plan: RunPlan) -> None:
    """Stop before loading when the memory plan says the run cannot fit (unless told to go on)."""
    m = plan.memory
    if m is None or m.fits() is not False or plan.config.no_memory_check:
        return
    raise ConfigError(
        "the run will not fit its device: "
        + "\n".join(m.format())
        + "\nApply one of the fixes above (or pass --no-memory-check to try anyway); nothing was loaded or written."
    )


def fused_optimizer(plan: RunPlan) -> bool:
    """The run's AdamW is torch's fused one: where the guard would otherwise copy (not on the CPU, whose
    non-finite flag is read on the host and whose default AdamW stays the reference), the backend says its
    device runs it (``PrecisionPolicy``), and the parameters are not sharded (FSDP's DTensors keep the default
    implementation)."""
    return (
        bool(plan.precision.fused_optimizer)
        and plan.backend.info.device_type != "cpu"
        and not (plan.sharding and plan.sharding.enabled)
    )


def guard_copies(plan: RunPlan) -> bool:
    """The non-finite guard copies the adapter and its AdamW state each step (``training.step.guarded_step``):
    on a device whose flags are not read on the host, without a loss scaler (which skips steps itself) and
    without the fused AdamW (which skips them on the device)."""
    return plan.backend.info.device_type != "cpu" and not plan.precision.loss_scaling and not fused_optimizer(plan)
