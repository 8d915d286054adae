"""``vlft run``: from a config to a trained adapter, an evaluation and a report.

Order matters for the promise "bad input loses nothing": the backend, the
method, the model config and every data record are checked before the run
folder is created or any weight is loaded onto a device.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import data as data_mod
from .config import RunConfig
from .errors import ConfigError, VlftError
from .plan import RunPlan, require_available, resolve_plan
from .plugins import Registry
from .policies import MemoryStats

DEFAULT_DATA_DIR_NAME = "demo-data"


@dataclass
class RunResult:
    output: Path | None
    plan: RunPlan
    before: dict | None = None
    after: dict | None = None
    metrics: list | None = None
    description: dict | None = None  # the resolved plan, for --dry-run


def log(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def resolve_data_paths(config: RunConfig) -> tuple[Path, Path | None]:
    if config.data is None:
        from .demo_data import write_demo_dataset
        from .embedded import cache_root

        ds = write_demo_dataset(cache_root() / DEFAULT_DATA_DIR_NAME)
        return ds.train, (Path(config.val_data) if config.val_data else ds.val)
    return Path(config.data), (Path(config.val_data) if config.val_data else None)


def default_output(config: RunConfig, backend: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{config.method}-{backend}"


def load_and_check_data(config: RunConfig, encoder) -> tuple[list, list, data_mod.LengthReport]:
    """Read and check both splits, lengths included; samples over --max-length stop the run or are skipped."""
    train_path, val_path = resolve_data_paths(config)
    train = data_mod.read_records(train_path)
    if val_path is not None:
        val = data_mod.read_records(val_path)
    else:
        # no validation file: hold out a seeded 10% (at least one record)
        import random

        order = list(range(len(train)))
        random.Random(config.seed).shuffle(order)
        n_val = max(1, len(train) // 10) if len(train) > 1 else 0
        held = set(order[:n_val])
        val = [r for i, r in enumerate(train) if i in held]
        train = [r for i, r in enumerate(train) if i not in held] or train
    # measuring renders every record with the chat template, which checks it splits into prompt and reply
    train, lengths = data_mod.check_lengths(train, encoder, config.max_length, config.skip_too_long,
                                            "training data")
    val, val_lengths = data_mod.check_lengths(val, encoder, config.max_length, config.skip_too_long,
                                              "validation data") if val else (val, None)
    if val_lengths is not None:
        lengths.skipped += [dict(s, split="validation") for s in val_lengths.skipped]
    return train, val, lengths


def plan_targets(registry: Registry, plan: RunPlan, model):
    """Adapt ``model`` (real or on 'meta'); fill the plan's target list and per-module adapter parameter counts."""
    from .targets import select_targets

    tp = select_targets(model, plan.adapter, plan.config.targets, plan.config.vision_last_n)
    plan.targets = tp.modules
    plan.target_summary = {"towers": tp.towers, "vision_blocks": tp.vision_blocks,
                           "vision_depth": tp.vision_depth, "text_layers": tp.text_layers}
    adapted = registry.first("vlft_apply_adapter", method=plan.method.name, model=model, targets=tp.modules,
                             config=plan.config)
    counts: dict[str, int] = {}
    for name, p in adapted.named_parameters():
        if not p.requires_grad:
            continue
        for target in tp.modules:
            if f"{target}." in name:
                counts[target] = counts.get(target, 0) + p.numel()
                break
    plan.target_params = counts
    return adapted


@dataclass
class Planned:
    """A run resolved and checked before any weight is loaded: policies, data, targets, memory."""

    plan: RunPlan
    model_config: object
    processor: object
    encoder: data_mod.SampleEncoder
    train_records: list
    val_records: list
    total_steps: int


def plan_run(registry: Registry, config: RunConfig, choice=None) -> Planned:
    """Everything a run decides before loading weights; ``--dry-run`` stops after this.

    Order: backend, method, model config, data (lengths included), policies, targets on a weightless
    copy of the model, then the memory plan against the device's capacity.
    """
    import torch

    from . import memory
    from .config import parse_bytes
    from .model import load_model_config, load_processor, resolve_model_path
    from .train import total_steps_for

    registry.method(config.method)
    registry.first("vlft_adapter_defaults", method=config.method, config=config)  # checks --adapter-opt
    model_path = resolve_model_path(config.model)
    model_config = load_model_config(model_path)
    processor = load_processor(model_path)
    encoder = data_mod.SampleEncoder(processor, max_pixels=config.max_pixels)
    train, val, lengths = load_and_check_data(config, encoder)
    plan = resolve_plan(registry, config, model_path, model_config, choice)
    plan.lengths = lengths.describe(config.max_length)
    from .model import is_bundled

    if is_bundled(model_path):
        plan.notes.append("bundled config without weights: text lengths counted with the embedded tokenizer "
                          "(a stand-in; image tokens are exact)")
    epochs = config.epochs
    if epochs is None and config.steps is None and config.data is None:
        from .demo_data import RECOMMENDED_EPOCHS

        epochs = RECOMMENDED_EPOCHS
    total_steps = total_steps_for(len(train), config.steps, epochs, config.batch_size, config.grad_accum,
                                  config.world_size)

    # targets and memory on a weightless copy, in the dtype the layers will compute in
    compute = plan.precision.autocast_dtype or plan.precision.param_dtype
    skeleton = plan_targets(registry, plan, memory.skeleton(model_config, plan.attention, getattr(torch, compute)))
    if plan.precision.autocast_dtype:  # under autocast the adapters compute in its dtype too (see model.py)
        from .model import compute_adapters_in_autocast_dtype

        skeleton.to(getattr(torch, compute))
        compute_adapters_in_autocast_dtype(skeleton)
    capacity = registry.hook.vlft_device_capacity(backend=plan.backend.info.name, config=config) or \
        memory.DeviceCapacity(None, 0, f"backend {plan.backend.info.name} does not report its memory")
    total, source = capacity.total_bytes, capacity.source
    if config.device_memory:
        total, source = parse_bytes(config.device_memory, "--device-memory"), f"--device-memory {config.device_memory}"
    shapes = memory.largest_batches(lengths.lengths, lengths.grids, config.batch_size, config.grad_accum,
                                    config.world_size, config.seed, total_steps)
    plan.memory = memory.worst_plan(skeleton, model_config, plan.precision.param_dtype,
                                    plan.precision.autocast_dtype, shapes, capacity.reserved_bytes, total, source)
    memory.decide(plan.memory, config.grad_checkpointing, skeleton, model_config, plan.precision.autocast_dtype,
                  config.batch_size, config.grad_accum, config.max_pixels)
    return Planned(plan, model_config, processor, encoder, train, val, total_steps)


def check_fits(plan: RunPlan) -> None:
    """Stop before loading when the memory plan says the run cannot fit (unless told to go on)."""
    m = plan.memory
    if m is None or m.fits() is not False or plan.config.no_memory_check:
        return
    raise ConfigError(
        "the run will not fit its device: " + "\n".join(m.format())
        + "\nApply one of the fixes above (or pass --no-memory-check to try anyway); nothing was loaded or written."
    )


def format_plan(desc: dict) -> str:
    b, a, p = desc["backend"], desc["attention"], desc["precision"]
    dl, dist, m, t = desc["dataloader"], desc["distributed"], desc["method"], desc["targets"]
    status = "available" if b["available"] else f"UNAVAILABLE here ({b['reason']})"
    lines = [
        f"backend      {b['name']} (device type {b['device_type']}): {status}",
        f"             chosen: {b['chosen_because']}",
        f"attention    vision={a['vision']} text={a['text']}" + (f"  ({a['reason']})" if a["reason"] else ""),
        f"precision    {p['name']}: params {p['param_dtype']}, autocast {p['autocast_dtype'] or 'off'}, "
        + (f"dynamic loss scaling (initial scale {p['init_scale']:g}, growth interval {p['growth_interval']})"
           if p["loss_scaling"] else "no loss scaling")
        + (f"  ({p['reason']})" if p["reason"] else ""),
        f"dataloader   pin_memory={dl['pin_memory']} num_workers={dl['num_workers']}"
        + (f" prefetch_factor={dl['prefetch_factor']}" if dl["prefetch_factor"] else ""),
        f"distributed  {dist['process_group_backend']} (timeout {dist['timeout_s']} s)"
        + "".join(f"\n             {k}={v}" for k, v in dist["env"].items()),
        f"method       {m['name']} lr={m['lr']:g} " + " ".join(f"{k}={v}" for k, v in m["hyperparameters"].items()),
        f"model        {desc['model']}",
        f"targets      {t['towers']}: vision blocks {t['vision_blocks']} of {t['vision_depth']}, "
        f"{t['text_layers']} text layers; {len(t['modules'])} modules, {t['adapter_parameters']:,} adapter parameters",
    ]
    lines += [f"             {name}  ({count:,} params)" for name, count in t["modules"].items()]
    pd, ck, ln = desc["param_dtype"], desc["checkpointing"], desc["lengths"]
    lines.append(f"weights      base {pd['dtype']}" + (f" ({pd['reason']})" if pd["reason"] else "")
                 + ", trainable float32")
    lines.append(f"checkpoint   {'on' if ck['enabled'] else 'off'} ({ck['reason']})")
    if ln:
        lines.append(f"lengths      longest {ln['longest']} tokens, median {ln['median']}, limit "
                     f"{ln['max_length'] or 'none'}" + (f"; {ln['skipped']} sample(s) over it skipped"
                                                        if ln["skipped"] else ""))
        lines += [f"             skipped {s['where']} ({s['length']} tokens)" for s in ln["skipped_samples"][:20]]
    if desc["memory"]:
        from .memory import format_memory

        lines += format_memory(desc["memory"])
    lines += [f"note         {n}" for n in desc["notes"]]
    if desc["model_patches"]:
        lines += ["patches      " + "; ".join(desc["model_patches"])]
    for w in b["warnings"]:
        lines.append(f"warning      {w}")
    return "\n".join(lines)


def _init_distributed(plan: RunPlan, device) -> None:
    import datetime

    import torch

    dist = plan.distributed
    for key, value in dist.env.items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=dist.process_group_backend, timeout=datetime.timedelta(seconds=dist.timeout_s),
            device_id=device if device.type != "cpu" else None,
        )


@dataclass
class Session:
    """A run set up and ready for its first step: every policy resolved, the model adapted and on its device."""

    plan: RunPlan
    config: RunConfig
    processor: object
    encoder: data_mod.SampleEncoder
    train_records: list
    val_records: list
    output: Path
    device: object
    model: object  # the adapted (PEFT) model
    optimizer: object
    scheduler: object
    policy: object  # train.StepPolicy
    settings: object  # train.LoopSettings
    collate: data_mod.Collator
    memory_reader: object
    save_adapter: object
    autocast_dtype: object = None

    @property
    def distributed(self) -> bool:
        return self.config.world_size > 1

    @property
    def dataset(self) -> data_mod.EncodedDataset:
        return data_mod.EncodedDataset(self.train_records, self.encoder)


def prepare(registry: Registry, config: RunConfig) -> Session:
    """Check everything, then set up device, model, adapter, optimizer and schedule (no step taken)."""
    import torch

    from .model import (
        compute_adapters_in_autocast_dtype, enable_checkpointing, load_model, require_weights, upcast_trainable,
    )
    from .plan import choose_backend
    from .train import LoopSettings, StepPolicy, cosine_with_warmup, seed_everything

    choice = choose_backend(registry, config.backend)
    require_available(choice)
    backend = choice.info.name
    output = Path(config.output) if config.output else default_output(config, backend)
    if config.resume:
        if not (output / "checkpoints").exists():
            raise ConfigError(f"--resume: no checkpoints in {output}; give the --output of the run to continue")
    elif output.exists() and any(output.iterdir()):
        raise ConfigError(f"--output {output} already holds a run; choose another folder or pass --resume")

    # -- set-up: every hook answer is taken here, before the first step ------------
    seed_everything(config.seed)
    registry.hook.vlft_seed(backend=backend, seed=config.seed, deterministic=config.deterministic)
    setup = registry.first("vlft_setup_device", backend=backend, config=config)
    for key, value in setup.env.items():
        os.environ.setdefault(key, value)
    device = setup.device
    planned = plan_run(registry, config, choice)
    plan, processor = planned.plan, planned.processor
    require_weights(plan.model_path, config.model)
    check_fits(plan)
    if config.world_size > 1:
        _init_distributed(plan, device)
        # every process writes under rank 0's folder (a default name carries a time stamp)
        shared = [str(output)]
        torch.distributed.broadcast_object_list(shared, src=0)
        output = Path(shared[0])
    memory_reader = registry.first("vlft_memory_reader", backend=backend, device=device)
    model = load_model(plan.model_path, plan.attention, plan.precision)
    plan.patches = [p for ps in registry.hook.vlft_patch_model(backend=backend, model=model, config=config,
                                                                   attention=plan.attention)
                    if ps for p in ps]
    seed_everything(config.seed)  # adapter initialisation is seeded the same on every backend
    model = plan_targets(registry, plan, model)
    cast = upcast_trainable(model)
    if cast:
        plan.notes.append(f"{len(cast)} trainable parameter(s) upcast to fp32 (e.g. {cast[0]})")
    if plan.checkpointing:
        enable_checkpointing(model, vision_adapted=bool(plan.target_summary.get("vision_blocks")))
    if plan.precision.autocast_dtype:
        compute_adapters_in_autocast_dtype(model)
    model.to(device)

    def save_adapter(m, path):
        registry.first("vlft_save_adapter", method=plan.method.name, model=m, path=path)

    autocast_dtype = getattr(torch, plan.precision.autocast_dtype) if plan.precision.autocast_dtype else None
    scaler = plan.precision.make_scaler() if plan.precision.loss_scaling else None
    total_steps = planned.total_steps
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=plan.lr, weight_decay=config.weight_decay)
    scheduler = cosine_with_warmup(optimizer, int(config.warmup_ratio * total_steps), total_steps)
    policy = StepPolicy(device, autocast_dtype, scaler, config.max_grad_norm, config.grad_accum, config.world_size)
    settings = LoopSettings(
        total_steps=total_steps, batch_size=config.batch_size, grad_accum=config.grad_accum, seed=config.seed,
        rank=config.rank, world_size=config.world_size, log_every=config.log_every, eval_every=config.eval_every,
        save_every=config.save_every, keep_checkpoints=config.keep_checkpoints,
        loader_kwargs=plan.dataloader.loader_kwargs(),
    )
    collate = data_mod.Collator(processor.tokenizer.pad_token_id, processor.image_token_id)
    return Session(plan, config, processor, planned.encoder, planned.train_records, planned.val_records, output,
                   device, model, optimizer, scheduler, policy, settings, collate, memory_reader, save_adapter,
                   autocast_dtype)


def execute(registry: Registry, config: RunConfig, progress: bool = True) -> RunResult:
    """Run the whole job; see the module docstring for the order of checks."""
    import torch

    from .evaluate import evaluate_generation, format_table, validation_loss
    from .train import CheckpointStore, MetricsLog, run_training

    if config.dry_run:
        plan = plan_run(registry, config).plan
        return RunResult(None, plan, description=plan.describe())
    s = prepare(registry, config)
    plan = s.plan
    rank, output, model, device = config.rank, s.output, s.model, s.device
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        (output / "plan.json").write_text(json.dumps(plan.describe(), indent=2, default=str))
        (output / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
        log(format_plan(plan.describe()))
        log(f"data         {len(s.train_records)} training and {len(s.val_records)} validation records")
        log(f"output       {output}")

    eval_records = s.val_records[: config.eval_samples] if config.eval_samples else s.val_records

    def generation_eval(m):
        return evaluate_generation(m, s.encoder, eval_records, device, config.max_new_tokens, s.autocast_dtype,
                                   rank=rank, world_size=config.world_size)

    val_batches = [s.collate([s.encoder.encode(r) for r in s.val_records[i:i + config.batch_size]])
                   for i in range(0, min(len(s.val_records), config.eval_batches * config.batch_size),
                                  config.batch_size)]

    def val_loss():
        return validation_loss(model, val_batches, device, s.autocast_dtype)

    store = CheckpointStore(output / "checkpoints", config.keep_checkpoints, s.save_adapter)
    metrics = MetricsLog(output / "metrics.jsonl" if rank == 0 else None)
    start_step = 0
    before = None
    if config.resume:
        start_step = _resume(model, s.optimizer, s.scheduler, s.policy.scaler, store, device)
        metrics.truncate_after(start_step)
        eval_path = output / "eval.json"
        if eval_path.exists():
            before = json.loads(eval_path.read_text()).get("before")
        log(f"resumed      from step {start_step} ({store.newest()})", rank)
    train_model = model
    if s.distributed:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type != "cpu" and device.index is not None else None)
    if before is None:
        log("evaluating the base model ...", rank)
        with model.disable_adapter():
            before = generation_eval(model)
        if rank == 0:
            _write_eval(output, before, None)

    total_steps = s.settings.total_steps
    log(f"training     {total_steps} steps of {config.batch_size * config.grad_accum * config.world_size} samples",
        rank)
    t0 = time.perf_counter()
    records = run_training(train_model, s.optimizer, s.scheduler, s.policy, s.dataset, s.collate, s.settings, store,
                           metrics, s.memory_reader, evaluate_loss=val_loss if config.eval_every else None,
                           start_step=start_step, progress=progress)
    train_time = time.perf_counter() - t0

    log("evaluating the adapted model ...", rank)
    after = generation_eval(model)
    if rank == 0:
        adapter_dir = output / "adapter"
        tmp = output / ".adapter-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        s.save_adapter(model, tmp)
        shutil.rmtree(adapter_dir, ignore_errors=True)
        os.replace(tmp, adapter_dir)
        _write_eval(output, before, after)
        mem: MemoryStats = s.memory_reader()
        summary = {
            "backend": plan.backend.info.name, "method": plan.method.name, "steps": total_steps,
            "resumed_from": start_step, "train_time_s": train_time,
            "final_loss": records[-1]["loss"] if records else None, "peak_memory_bytes": mem.peak_bytes,
            "exact_match_before": before["exact_match"], "exact_match_after": after["exact_match"],
            "adapter": str(adapter_dir),
            "param_dtype": plan.precision.param_dtype, "checkpointing": plan.checkpointing,
            "memory_estimate_bytes": plan.memory.total_bytes() if plan.memory else None,
            "skipped_too_long": plan.lengths.get("skipped_samples", []),
        }
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
        print(format_table(before, after))
        print(f"adapter saved to {adapter_dir} ({total_steps - start_step} steps in {train_time:.0f} s)")
    if s.distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return RunResult(output, plan, before, after, records)


def _write_eval(output: Path, before: dict | None, after: dict | None) -> None:
    tmp = output / ".eval.json.tmp"
    tmp.write_text(json.dumps({"before": before, "after": after}, indent=2))
    os.replace(tmp, output / "eval.json")


def _resume(model, optimizer, scheduler, scaler, store, device) -> int:
    import torch
    from safetensors.torch import load_file

    from .train import set_rng_state

    newest = store.newest()
    if newest is None:
        raise VlftError(f"--resume: no complete checkpoint in {store.root}")
    state = torch.load(newest / "state.pt", map_location="cpu", weights_only=False)
    weights = load_file(str(newest / "adapter" / "adapter_model.safetensors"))
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, weights)
    if getattr(result, "unexpected_keys", None):
        raise VlftError(f"--resume: checkpoint {newest} does not match this adapter: {result.unexpected_keys[:3]}")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"], device)
    return int(state["step"])
