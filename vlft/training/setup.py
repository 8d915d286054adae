"""How each part of a run is made from its plan: the seeded device, the process group, the model (loaded in the
plan's parameter dtype and attention, patched by the backend, adapted by the method, placed or sharded), the
reference model, the optimizer and its schedule, the collator and the loop's settings.

``training.trainer.Trainer`` calls these in order, once; nothing here holds state of its own.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch

from vlft.config import RunConfig
from vlft.data.batching import collator_for
from vlft.data.layouts import record_format
from vlft.data.packing import PackingCollator
from vlft.errors import ConfigError, VlftError
from vlft.models.adapting import (
    compute_adapters_in_autocast_dtype,
    enable_checkpointing,
    upcast_trainable,
)
from vlft.models.groups import optimizer_groups
from vlft.models.loading import empty_model, load_model, with_stand_in_weights
from vlft.models.reference import Reference
from vlft.models.segments import with_segments
from vlft.planning.kernels import apply_kernels
from vlft.planning.memory import four_bit_skip
from vlft.planning.plan import RunPlan
from vlft.planning.preflight import fused_optimizer
from vlft.registry import Registry
from vlft.training.fsdp import full_trainable_state, materialized_adapter, shard_model
from vlft.training.launch import joined_group
from vlft.training.loop import LoopSettings
from vlft.training.rollouts import KeptRollout
from vlft.training.step import cosine_with_warmup, seed_everything


def seeded_device(registry: Registry, backend: str, config: RunConfig):
    """Seeds (host and device), the backend's environment, and its device for this process."""
    seed_everything(config.seed)
    registry.hook.vlft_seed(backend=backend, seed=config.seed, deterministic=config.deterministic)
    setup = registry.first("vlft_setup_device", backend=backend, config=config)
    for key, value in setup.env.items():
        os.environ.setdefault(key, value)
    return setup.device


def init_distributed(plan: RunPlan, device) -> None:
    """Join the run's process group (torchrun's environment, or an in-memory one for one sharded process)."""
    dist = plan.distributed
    for key, value in dist.env.items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        # one process sharding on its own (--shard fsdp without torchrun): an in-memory rendezvous; else torch's
        # defaults (-1, None: rank, size and rendezvous from torchrun's environment)
        solo = "MASTER_ADDR" not in os.environ and plan.config.world_size == 1
        # HashStore is public (documented in torch.distributed); torch's __init__ just does not re-export it
        store = torch.distributed.HashStore() if solo else None  # pyright: ignore[reportPrivateImportUsage]
        torch.distributed.init_process_group(
            backend=dist.process_group_backend,
            timeout=datetime.timedelta(seconds=dist.timeout_s),
            device_id=device if device.type != "cpu" else None,
            store=store,
            rank=0 if solo else -1,
            world_size=1 if solo else -1,
        )
        if plan.config.world_size > 1:
            joined_group()


def base_model(registry: Registry, plan: RunPlan, device=None):
    """The base model with the backend's patches. Sharded, each process builds it without weights and reads its
    own shares once it is sharded (``place``); or, where it cannot (the plan says why), rank 0 reads the weights
    and the others build it on 'meta' and receive their shares from it."""
    config, backend = plan.config, plan.backend.info.name
    attention = with_segments(plan.attention, plan.packing)  # packed on sdpa/eager: attended per sample
    if plan.sharding.enabled and plan.sharding.loading == "each":  # every process reads its own shares (place)
        model = with_stand_in_weights(empty_model(plan.model_path, attention, plan.precision, family=plan.family))
    elif plan.sharding.enabled and config.world_size > 1 and config.rank != 0:
        model = empty_model(plan.model_path, attention, plan.precision, family=plan.family)
    else:
        quantized = plan.precision.quantization is not None  # 4-bit weights are quantized onto the device
        model = load_model(
            plan.model_path,
            attention,
            plan.precision,
            device=device if quantized else None,
            trust_pickle=config.trust_pickle,
            keep_float=four_bit_skip(plan.family),
            family=plan.family,
        )
    patches = [
        p
        for ps in registry.hook.vlft_patch_model(
            backend=backend, model=model, config=config, attention=attention, family=plan.family
        )
        if ps
        for p in ps
    ]
    patches += apply_kernels(plan.kernels, model)  # the chosen kernel patches, once, before the adapter
    return model, patches


def adapted(registry: Registry, plan: RunPlan, model, resume_from: Path | None):
    """The method's adapter on the targets chosen in preflight (or a checkpoint's), made trainable; and notes
    on what that did to the model's dtypes."""
    config = plan.config
    notes = []
    seed_everything(config.seed)  # adapter initialisation is seeded the same on every backend
    if resume_from is not None or plan.init_adapter:  # a checkpoint's adapter, or the one --init-adapter names
        path = str(resume_from / "adapter") if resume_from is not None else plan.init_adapter
        model = registry.first("vlft_load_adapter", method=plan.method.name, model=model, path=path, trainable=True)
    else:  # the targets were chosen on the weightless copy in preflight
        model = registry.first(
            "vlft_apply_adapter",
            method=plan.method.name,
            model=model,
            targets=plan.targets,
            config=config,
            target_parameters=plan.target_parameters,
            family=plan.family,
        )
    if plan.precision.quantization:
        # k-bit preparation as PEFT's prepare_model_for_kbit_training, less its fp32 upcast of every frozen
        # bf16 weight (embeddings and head: +2.2 GB on a 7B): base frozen (PEFT did), trainable fp32 (below),
        # non-reentrant checkpointing (below) needs no input_require_grads
        notes.append(
            "nf4: frozen bf16 weights kept bf16 (no fp32 upcast as prepare_model_for_kbit_training does); adapters fp32"
        )
    cast = upcast_trainable(model)
    if cast:
        notes.append(f"{len(cast)} trainable parameter(s) upcast to fp32 (e.g. {cast[0]})")
    if plan.checkpointing:
        enable_checkpointing(model, vision_adapted=bool(plan.target_summary.get("vision_blocks")), family=plan.family)
    if plan.precision.autocast_dtype:
        compute_adapters_in_autocast_dtype(model)
    return model, notes


def place(model, plan: RunPlan, device) -> None:
    """Onto the device: whole, or (``--shard fsdp``) each process's shares, never the whole model."""
    config = plan.config
    if not plan.sharding.enabled:
        if plan.precision.quantization is None:  # a 4-bit model was loaded onto its device
            model.to(device)
        return
    rank0 = plan.sharding.loading == "rank0" and config.world_size > 1 and config.rank == 0
    whole = model.state_dict() if rank0 else None
    shard_model(model, plan.sharding, device, whole, family=plan.family, read_from=plan.model_path)


def probe_packing(model, plan: RunPlan) -> None:
    """The family's packing probe (``Packing.probe``) on the placed base model, where the run packs and this
    process holds the whole model (a sharded one's direct forward would gather out of step): a model that does
    not keep packed samples apart after all stops the run before step 1, not after steps trained across them."""
    family = plan.family
    probe = family.packing.probe if family is not None and family.packing is not None else None
    if probe is None or not plan.packing.enabled or plan.sharding.enabled:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    training = base.training
    base.eval()  # dropout off: the two forwards must differ only where the samples meet
    try:
        with torch.no_grad():
            problem = family.call("packing.probe", probe, base)
    finally:
        base.train(training)
    if problem:
        raise ConfigError(
            f"--packing: the {family.name} family's text model does not keep packed samples apart: {problem}; "
            "use --packing off (padded batches)"
        )


def disable_dropout(model) -> None:
    """Every dropout layer off (``Objective.dropout`` False; TRL's ``disable_dropout_in_model``): p 0 rather than
    evaluation mode, so training mode keeps what else it means (gradient checkpointing)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def reference_model(model, plan: RunPlan, device, resume_from: Path | None, kept: dict | None) -> Reference:
    """The objective's reference model: the adapter switched off, or the adapter --init-adapter loaded, kept as
    it was (a resumed run takes it from its checkpoint, ``kept``, not the trained weights it resumes)."""
    if not plan.init_adapter:
        return Reference(model)
    if resume_from is None:
        return Reference(model, Reference.capture(model))
    if not kept:
        raise VlftError(
            f"--resume: {resume_from} keeps no reference weights of --init-adapter {plan.init_adapter} "
            f"(it was not written by a {plan.objective.name} run); start the run again"
        )
    return Reference.resumed(model, kept, device)


def optimizer_and_schedule(model, plan: RunPlan):
    # one group per tower (text, vision, merger), each at its absolute peak lr; the schedule scales them all
    config, total_steps = plan.config, plan.total_steps
    groups = optimizer_groups(model, plan.family, plan.lr, config)
    fused = True if fused_optimizer(plan) else None  # None: torch's default (foreach where it can), not False
    optimizer = torch.optim.AdamW(groups, lr=plan.lr, weight_decay=config.weight_decay, fused=fused)
    return optimizer, cosine_with_warmup(optimizer, int(config.warmup_ratio * total_steps), total_steps)


def model_flops_per_token(model) -> float:
    """Model FLOPs of one token in a step with a frozen base: 2 per parameter forward, 2 backward for the
    input gradients (the adapters' own weight gradients are negligible); attention and activation
    recomputation are left out, as MFU conventionally does."""
    return 4.0 * sum(p.numel() for p in model.parameters())


def step_prepare(objective, start_step: int):
    """What prepares a step's batches: the objective's ``prepare``, kept for the steps that train on it again
    (``Objective.iterations`` above 1)."""
    if objective.iterations == 1:
        return objective.prepare
    return KeptRollout(objective.prepare, objective.iterations, start_step)


def loop_settings(plan: RunPlan, model) -> LoopSettings:
    """The data order and what the loop does around the steps, with the MFU figures of ``model``."""
    config = plan.config
    return LoopSettings(
        total_steps=plan.total_steps,
        batch_size=config.batch_size,
        grad_accum=config.grad_accum,
        seed=config.seed,
        rank=config.data_rank,
        world_size=config.data_world,
        processes=config.world_size,
        process_rank=config.rank,
        sequence_parallel=config.sequence_parallel,
        log_every=config.log_every,
        eval_every=config.eval_every,
        save_every=config.save_every,
        keep_checkpoints=config.keep_checkpoints,
        early_stopping_patience=config.early_stopping_patience,
        loader_kwargs=plan.dataloader.loader_kwargs(),
        max_skipped_steps=config.max_skipped_steps,
        repeat=plan.objective.iterations,
        lengths=plan.train_lengths if config.group_by_length else None,
        peak_flops=plan.peak_flops,
        flops_per_token=model_flops_per_token(model),
    )


def training_collator(plan: RunPlan, model_config, processor):
    """The padding collator, or with packing (``plan.packing``) the packing one, holding the family's positions
    and the model config resolved at plan time (positions are built in the data stage)."""
    if plan.packing.enabled:
        images = plan.family.image_inputs
        return PackingCollator(
            plan.packing,
            plan.family.positions,
            model_config,
            images.batch_inputs if images is not None else {},
            owner=plan.family.label(),
        )
    return collator_for(processor, plan.family)


def run_collator(plan: RunPlan):
    """The run's collator: the training one, wrapped by the objective's layout where it builds its own batches
    (DPO: chosen and rejected rows, images once)."""
    return record_format(plan.objective.layout).collate(training_collator(plan, plan.model_config, plan.processor))


def adapter_to_save(model, skeleton, sharded: bool):
    """What the method's saver writes for ``model``: the model itself, or under ``--shard fsdp`` the plan's
    weightless copy (``skeleton``) holding the adapter gathered whole (on rank 0; None on the others). Every
    process must call it when sharded: gathering is collective."""
    if not sharded:
        return model
    state = full_trainable_state(model)
    return materialized_adapter(skeleton, state) if state is not None else None
