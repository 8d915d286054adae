"""A run set up and ready for its first step: device, model, adapter, optimizer and schedule.

``prepare`` takes the plan from ``preflight`` (so every policy and check is
already settled), then loads the model in the plan's parameter dtype and
attention, applies the backend's patches and the method's adapter (or loads
the adapter of a checkpoint to resume), and builds the optimizer. It owns no
run folder: ``vlft run`` decides where things are written, ``vlft parity``
writes nothing.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlft.config import RunConfig
from vlft.data.batching import collator_for
from vlft.data.encoding import EncodedDataset, SampleEncoder
from vlft.data.lazy import modalities
from vlft.data.packing import PackingCollator
from vlft.errors import VlftError
from vlft.models.adapting import (
    compute_adapters_in_autocast_dtype,
    enable_checkpointing,
    upcast_trainable,
)
from vlft.models.bundled import require_weights
from vlft.models.groups import optimizer_groups
from vlft.models.loading import empty_model, load_model
from vlft.models.reference import Reference
from vlft.models.segments import with_segments
from vlft.models.vision import install_vision_warmup
from vlft.planning.kernels import apply_kernels
from vlft.planning.memory import four_bit_skip
from vlft.planning.plan import RunPlan, choose_backend, require_available
from vlft.planning.preflight import check_fits, fused_optimizer, plan_run
from vlft.registry import Registry
from vlft.training.checkpoints import restore_training_state, saved_reference
from vlft.training.fsdp import full_trainable_state, materialized_adapter, shard_model
from vlft.training.launch import joined_group
from vlft.training.loop import LoopSettings
from vlft.training.rollouts import KeptRollout
from vlft.training.step import StepPolicy, cosine_with_warmup, seed_everything


def _init_distributed(plan: RunPlan, device) -> None:
    """Join the run's process group (torchrun's environment, or an in-memory one for one sharded process)."""
    dist = plan.distributed
    for key, value in dist.env.items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        extra = {}
        if "MASTER_ADDR" not in os.environ and plan.config.world_size == 1:
            # one process sharding on its own (--shard fsdp without torchrun): an in-memory rendezvous
            extra = dict(store=torch.distributed.HashStore(), rank=0, world_size=1)
        torch.distributed.init_process_group(
            backend=dist.process_group_backend, timeout=datetime.timedelta(seconds=dist.timeout_s),
            device_id=device if device.type != "cpu" else None, **extra,
        )
        if plan.config.world_size > 1:
            joined_group()


@dataclass
class Session:
    """A run set up and ready for its first step: every policy resolved, the model adapted and on its device."""

    plan: RunPlan
    config: RunConfig
    processor: object
    encoder: SampleEncoder
    train_records: Sequence  # a list, or columnar rows built into records as they are read (data.lazy)
    val_records: Sequence
    device: object
    model: object  # the adapted (PEFT) model
    optimizer: object
    scheduler: object
    policy: object  # train.StepPolicy
    settings: object  # train.LoopSettings
    collate: object  # data.batching.Collator or data.packing.PackingCollator
    memory_reader: object
    save_adapter: object
    autocast_dtype: object = None
    start_step: int = 0  # where a resumed run continues
    checkpoint: Path | None = None  # the checkpoint it continues from
    skeleton: object = None  # the adapted model on 'meta' the plan was made on (saving under --shard fsdp)
    reference: Reference | None = None  # the objective's reference model, where its loss uses one
    # what setting the model up did (the plan itself stays as planned): the backend's and kernels' patches,
    # and notes on dtypes
    patches: list[str] = field(default_factory=list)
    setup_notes: list[str] = field(default_factory=list)

    def describe(self, notes: list[str] = ()) -> dict:
        """The plan as planned, with what setting the model up did and ``notes`` of the caller's."""
        desc = self.plan.describe()
        return {**desc, "model_patches": self.patches, "notes": [*desc["notes"], *self.setup_notes, *notes]}

    @property
    def distributed(self) -> bool:
        """Processes talk: several of them, or one sharding on its own."""
        return self.config.world_size > 1 or self.sharded

    @property
    def sharded(self) -> bool:
        return bool(self.plan.sharding and self.plan.sharding.enabled)

    def adapter_to_save(self, model):
        """What ``save_adapter`` writes for ``model``: the model itself, or under ``--shard fsdp`` the plan's
        weightless copy holding the adapter gathered whole (on rank 0; None on the others). Every process
        must call it when sharded: gathering is collective."""
        if not self.sharded:
            return model

        state = full_trainable_state(model)
        return materialized_adapter(self.skeleton, state) if state is not None else None

    @property
    def dataset(self) -> EncodedDataset:
        return EncodedDataset(self.train_records, self.encoder)


def prepare(registry: Registry, config: RunConfig, resume_from: Path | None = None, choice=None) -> Session:
    """Check everything (``preflight``), then set up device, model, adapter, optimizer and schedule.

    ``resume_from``: a checkpoint folder whose adapter, optimizer, scheduler,
    scaler and RNG state the session continues from. ``choice``: the backend already chosen
    (and probed) by the caller, so it is not probed twice. No step is taken. Every hook answer is taken
    here, before the first step.
    """
    choice = choice or choose_backend(registry, config.backend)
    require_available(choice)
    backend = choice.info.name
    device = _seeded_device(registry, backend, config)
    planned = plan_run(registry, config, choice)
    plan = planned.plan
    require_weights(plan.model_path, config.model, registry)
    check_fits(plan)
    if config.world_size > 1 or plan.sharding.enabled:
        _init_distributed(plan, device)
    memory_reader = registry.first("vlft_memory_reader", backend=backend, device=device)
    model, patches = _base_model(registry, backend, plan, config, device)
    model, setup_notes = _adapted(registry, plan, config, model, resume_from)
    _place(model, plan, config, device)
    # every step runs the towers the data uses, on every process, one included (models.vision)
    install_vision_warmup(model, modalities(planned.train_records), plan.family, sharded=plan.sharding.enabled)
    autocast_dtype = getattr(torch, plan.precision.autocast_dtype) if plan.precision.autocast_dtype else None
    scaler = plan.precision.make_scaler() if plan.precision.loss_scaling else None
    optimizer, scheduler = _optimizer_and_schedule(model, plan, config, planned.total_steps)
    start_step = 0
    if resume_from is not None:
        start_step = restore_training_state(resume_from, optimizer, scheduler, scaler, device,
                                            model=model if plan.sharding.enabled else None)
    objective = plan.objective
    if not objective.dropout:
        disable_dropout(model)
    reference = _reference(model, plan, resume_from, device) if objective.reference else None
    policy = StepPolicy(device, autocast_dtype, scaler, config.max_grad_norm, config.grad_accum, config.world_size,
                        flags_on_host=device.type == "cpu", fused_optimizer=fused_optimizer(plan),
                        loss=objective.loss, per_record=objective.average_over != "label tokens",
                        reference=reference, rollout=_step_rollout(objective, start_step),
                        figure_units=dict(objective.figure_units))
    settings = _loop_settings(config, plan, planned.total_steps)
    settings.peak_flops, settings.flops_per_token = plan.peak_flops, model_flops_per_token(model)
    if config.group_by_length:
        settings.lengths = planned.train_lengths
    processor = planned.processor
    collate = training_collator(plan, planned.model_config, processor)
    if objective.collate is not None:  # the objective's batches (DPO: chosen and rejected rows, images once)
        collate = objective.collate(collate)

    def save_adapter(m, path):
        registry.first("vlft_save_adapter", method=plan.method.name, model=m, path=path)

    return Session(plan, config, processor, planned.encoder, planned.train_records, planned.val_records, device,
                   model, optimizer, scheduler, policy, settings, collate, memory_reader, save_adapter,
                   autocast_dtype, start_step, resume_from, planned.skeleton, reference, patches, setup_notes)


def training_collator(plan: RunPlan, model_config, processor):
    """The padding collator, or with packing (``plan.packing``) the packing one, holding the family's positions
    and the model config resolved at plan time (positions are built in the data stage)."""
    if plan.packing is not None and plan.packing.enabled:
        images = plan.family.image_inputs
        return PackingCollator(plan.packing, plan.family.positions, model_config,
                               images.batch_inputs if images is not None else {}, owner=plan.family.label())
    return collator_for(processor, plan.family)


def _seeded_device(registry: Registry, backend: str, config: RunConfig):
    """Seeds (host and device), the backend's environment, and its device for this process."""
    seed_everything(config.seed)
    registry.hook.vlft_seed(backend=backend, seed=config.seed, deterministic=config.deterministic)
    setup = registry.first("vlft_setup_device", backend=backend, config=config)
    for key, value in setup.env.items():
        os.environ.setdefault(key, value)
    return setup.device


def _base_model(registry: Registry, backend: str, plan: RunPlan, config: RunConfig, device=None):
    """The base model with the backend's patches. Sharded over several processes, only rank 0 reads the
    weights; the others build it on 'meta' and receive their shares once it is sharded (``_place``)."""
    attention = with_segments(plan.attention, plan.packing)  # packed on sdpa/eager: attended per sample
    if plan.sharding.enabled and config.world_size > 1 and config.rank != 0:
        model = empty_model(plan.model_path, attention, plan.precision, family=plan.family)
    else:
        quantized = plan.precision.quantization is not None  # 4-bit weights are quantized onto the device
        model = load_model(plan.model_path, attention, plan.precision, device=device if quantized else None,
                           trust_pickle=config.trust_pickle, keep_float=four_bit_skip(plan.family),
                           family=plan.family)
    patches = [p for ps in registry.hook.vlft_patch_model(backend=backend, model=model, config=config,
                                                              attention=attention, family=plan.family)
               if ps for p in ps]
    patches += apply_kernels(plan.kernels, model)  # the chosen kernel patches, once, before the adapter
    return model, patches


def _adapted(registry: Registry, plan: RunPlan, config: RunConfig, model, resume_from: Path | None):
    """The method's adapter on the targets chosen in preflight (or a checkpoint's), made trainable; and notes
    on what that did to the model's dtypes."""
    notes = []
    seed_everything(config.seed)  # adapter initialisation is seeded the same on every backend
    if resume_from is not None or plan.init_adapter:  # a checkpoint's adapter, or the one --init-adapter names
        path = str(resume_from / "adapter") if resume_from is not None else plan.init_adapter
        model = registry.first("vlft_load_adapter", method=plan.method.name, model=model, path=path, trainable=True)
    else:  # the targets were chosen on the weightless copy in preflight
        model = registry.first("vlft_apply_adapter", method=plan.method.name, model=model, targets=plan.targets,
                               config=config, target_parameters=plan.target_parameters, family=plan.family)
    if plan.precision.quantization:
        # k-bit preparation as PEFT's prepare_model_for_kbit_training, less its fp32 upcast of every frozen
        # bf16 weight (embeddings and head: +2.2 GB on a 7B): base frozen (PEFT did), trainable fp32 (below),
        # non-reentrant checkpointing (below) needs no input_require_grads
        notes.append("nf4: frozen bf16 weights kept bf16 (no fp32 upcast as prepare_model_for_kbit_training "
                     "does); adapters fp32")
    cast = upcast_trainable(model)
    if cast:
        notes.append(f"{len(cast)} trainable parameter(s) upcast to fp32 (e.g. {cast[0]})")
    if plan.checkpointing:
        enable_checkpointing(model, vision_adapted=bool(plan.target_summary.get("vision_blocks")), family=plan.family)
    if plan.precision.autocast_dtype:
        compute_adapters_in_autocast_dtype(model)
    return model, notes


def disable_dropout(model) -> None:
    """Every dropout layer off (``Objective.dropout`` False; TRL's ``disable_dropout_in_model``): p 0 rather than
    evaluation mode, so training mode keeps what else it means (gradient checkpointing)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _reference(model, plan: RunPlan, resume_from: Path | None, device) -> Reference:
    """The objective's reference model: the adapter switched off, or the adapter --init-adapter loaded, kept as
    it was (a resumed run takes it from its checkpoint, not the trained weights it resumes)."""
    if not plan.init_adapter:
        return Reference(model)
    if resume_from is None:
        return Reference(model, Reference.capture(model))
    kept = saved_reference(resume_from)
    if kept is None:
        raise VlftError(f"--resume: {resume_from} keeps no reference weights of --init-adapter {plan.init_adapter} "
                        f"(it was not written by a {plan.objective.name} run); start the run again")
    return Reference(model, {n: t.to(device) for n, t in kept.items()})


def _place(model, plan: RunPlan, config: RunConfig, device) -> None:
    """Onto the device: whole, or (``--shard fsdp``) each process's shares, never the whole model."""
    if not plan.sharding.enabled:
        if plan.precision.quantization is None:  # a 4-bit model was loaded onto its device
            model.to(device)
        return
    whole = model.state_dict() if config.world_size > 1 and config.rank == 0 else None
    shard_model(model, plan.sharding, device, whole, family=plan.family)


def _optimizer_and_schedule(model, plan: RunPlan, config: RunConfig, total_steps: int):
    # one group per tower (text, vision, merger), each at its absolute peak lr; the schedule scales them all
    groups = optimizer_groups(model, plan.family, plan.lr, config)
    fused = {"fused": True} if fused_optimizer(plan) else {}
    optimizer = torch.optim.AdamW(groups, lr=plan.lr, weight_decay=config.weight_decay, **fused)
    return optimizer, cosine_with_warmup(optimizer, int(config.warmup_ratio * total_steps), total_steps)


def model_flops_per_token(model) -> float:
    """Model FLOPs of one token in a step with a frozen base: 2 per parameter forward, 2 backward for the
    input gradients (the adapters' own weight gradients are negligible); attention and activation
    recomputation are left out, as MFU conventionally does."""
    return 4.0 * sum(p.numel() for p in model.parameters())


def _step_rollout(objective, start_step: int):
    """What the step runs before the loss: the objective's rollout, kept for the steps that train on it again
    (``Objective.iterations`` above 1), or None."""
    if objective.rollout is None or objective.iterations == 1:
        return objective.rollout
    return KeptRollout(objective.rollout, objective.iterations, start_step)


def _loop_settings(config: RunConfig, plan: RunPlan, total_steps: int) -> LoopSettings:
    return LoopSettings(
        total_steps=total_steps, batch_size=config.batch_size, grad_accum=config.grad_accum, seed=config.seed,
        rank=config.rank, world_size=config.world_size, log_every=config.log_every, eval_every=config.eval_every,
        save_every=config.save_every, keep_checkpoints=config.keep_checkpoints,
        early_stopping_patience=config.early_stopping_patience, loader_kwargs=plan.dataloader.loader_kwargs(),
        max_skipped_steps=config.max_skipped_steps, repeat=plan.objective.iterations,
    )
