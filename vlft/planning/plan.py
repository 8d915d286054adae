"""Resolving a run: every plugin answer gathered once into a ``RunPlan``.

``vlft run --dry-run`` prints the plan; a real run trains from it. Nothing
after this module asks a plugin about a policy again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vlft.config import RunConfig
from vlft.errors import BackendUnavailable, ConfigError
from vlft.planning.memory import format_memory
from vlft.planning.sharding import resolve_sharding
from vlft.policies import (
    AdapterDefaults,
    AttentionPolicy,
    BackendInfo,
    DataLoaderOptions,
    DistributedOptions,
    MethodInfo,
    PrecisionPolicy,
    ProbeResult,
)
from vlft.registry import Registry


@dataclass
class BackendChoice:
    info: BackendInfo
    probe: ProbeResult
    reason: str


@dataclass
class RunPlan:
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
    targets: list[str] = field(default_factory=list)
    target_params: dict[str, int] = field(default_factory=dict)  # module -> adapter parameters
    target_summary: dict[str, Any] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    memory: Any = None  # memory.MemoryPlan, once the data and the model's shape are known
    lengths: dict[str, Any] = field(default_factory=dict)  # sample lengths: longest, skipped, limit
    notes: list[str] = field(default_factory=list)
    sharding: Any = None  # sharding.ShardingPlan: how the processes hold the model (--shard)
    peak_flops: float | None = None  # the device's peak FLOP/s where the backend knows it (DeviceCapacity)

    @property
    def checkpointing(self) -> bool:
        return bool(self.memory and self.memory.checkpointing)

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
            "precision": self.precision.describe(),
            "dataloader": dataclasses.asdict(self.dataloader),
            "distributed": dataclasses.asdict(self.distributed),
            "sharding": self.sharding.describe() if self.sharding else None,
            "method": {
                "name": self.method.name,
                "lr": self.lr,
                "hyperparameters": self.adapter.hyperparameters,
                "notes": self.adapter.notes,
            },
            "model": self.model_path,
            "targets": {
                **self.target_summary,
                "modules": {m: self.target_params.get(m) for m in self.targets},
                "adapter_parameters": sum(self.target_params.values()),
            },
            "model_patches": self.patches,
            "param_dtype": {"dtype": self.precision.param_dtype, "reason": self.precision.param_reason,
                            "trainable": "float32"},
            "checkpointing": {"enabled": self.checkpointing, "asked": self.config.grad_checkpointing,
                              "reason": self.memory.checkpointing_reason if self.memory else ""},
            "lengths": self.lengths,
            "memory": self.memory.describe() if self.memory else None,
            "notes": self.notes,
            "training": {
                k: getattr(self.config, k)
                for k in ("steps", "epochs", "batch_size", "grad_accum", "weight_decay", "warmup_ratio",
                          "max_grad_norm", "seed", "deterministic", "save_every", "keep_checkpoints", "world_size")
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
    if asked == "auto" and config.param_dtype in HALF_DTYPES:
        asked = config.param_dtype
    policy = registry.first("vlft_precision_policy", backend=backend,
                            config=dataclasses.replace(config, precision=asked))
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


def resolve_plan(registry: Registry, config: RunConfig, model_path: str, model_config,
                 backend: BackendChoice | None = None) -> RunPlan:
    """Ask the plugins once for every policy. A real run passes the ``backend`` it has already
    set up the device for, so policies that read device properties see the right device."""
    backend = backend or choose_backend(registry, config.backend)
    name = backend.info.name
    method = registry.method(config.method)
    adapter = registry.first("vlft_adapter_defaults", method=method.name, config=config)
    options = DataLoaderOptions()
    registry.hook.vlft_dataloader_options(backend=name, config=config, options=options)
    if config.num_workers is not None:
        options.num_workers = config.num_workers
        options.reasons.append(f"num_workers={config.num_workers}, as asked")
    precision = resolve_precision(registry, name, config)
    distributed = registry.first("vlft_distributed_options", backend=name, config=config)
    return RunPlan(
        config=config,
        backend=backend,
        precision=precision,
        attention=registry.first("vlft_attention_implementation", backend=name, config=config,
                                 model_config=model_config),
        dataloader=options,
        distributed=distributed,
        method=method,
        adapter=adapter,
        lr=config.lr if config.lr is not None else adapter.lr,
        model_path=model_path,
        sharding=resolve_sharding(config, distributed, name, precision),
    )


def _sharding_lines(sh: dict | None) -> list[str]:
    if not sh or sh["strategy"] == "none":
        return [f"sharding     none ({sh['reason']})"] if sh else []
    blocks = " + ".join(f"{n} {cls}" for cls, n in sh["wrapped"].items()) or "the model's blocks"
    return [f"sharding     fsdp over {sh['world_size']} process(es) ({sh['reason']})",
            f"             fully_shard on {blocks}, then the root; parameters gathered in "
            f"{sh['param_dtype'] or 'their own dtype'}, gradients reduced in {sh['reduce_dtype']}"
            + (" (SUM, divided by FSDP)" if sh["sum_reductions"] else ""),
            "             evaluation: each process answers an equal share (padded with repeats whose answers are "
            "dropped), all decoding in step (synced_gpus); every decoding step gathers every block, so it is "
            "slower than unsharded",
            "             checkpoints: AdamW state in one share per process (torch.distributed.checkpoint), the "
            "adapter gathered and saved once by rank 0"]


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
        *_sharding_lines(desc.get("sharding")),
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

        lines += format_memory(desc["memory"])
    lines += [f"note         {n}" for n in desc["notes"]]
    if desc["model_patches"]:
        lines += ["patches      " + "; ".join(desc["model_patches"])]
    for w in b["warnings"]:
        lines.append(f"warning      {w}")
    return "\n".join(lines)
