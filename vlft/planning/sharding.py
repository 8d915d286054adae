"""``--shard fsdp``, the plan side: whether the backend's process group supports FSDP2, which blocks are
sharded, and what each process holds (``ShardingPlan``); the run side is ``vlft.training.fsdp``.

The family's ``no_split_modules`` (the model class's ``_no_split_modules``: every text decoder layer and vision block) are each
sharded, then the transformers model as the root, so a block's parameters are gathered just before it
runs and freed after. Frozen base weights and trainable adapter weights share a block's group: FSDP2
checks the dtype of the *trainable* parameters only (all fp32 here) and all-gathers mixed dtypes as bytes,
so the adapters need no groups of their own. The mixed-precision policy comes from the backend's
precision policy: parameters gathered in its compute dtype, gradients reduced in fp32; the sharded
master copies keep their dtype (base in ``--param-dtype``, adapters fp32).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vlft.errors import ConfigError


@dataclass
class ShardingPlan:
    """How the model is held by the run's processes; resolved once, before any process group starts."""

    strategy: str = "none"  # "none": each process holds the whole model (data parallel); "fsdp"
    world_size: int = 1
    wrapped: dict[str, int] = field(default_factory=dict)  # module class -> how many are sharded on their own
    param_dtype: str | None = None  # the dtype parameters are gathered in (None: their own)
    reduce_dtype: str = "float32"
    sum_reductions: bool = False
    reason: str = ""
    # "each": every process reads its own shares from the safetensors files; "rank0": rank 0 reads them all
    loading: str = "rank0"
    loading_reason: str = ""
    offload: str = "none"  # "cpu": FSDP2's CPUOffloadPolicy (--offload cpu)

    @property
    def enabled(self) -> bool:
        return self.strategy == "fsdp"

    def describe(self) -> dict:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "wrapped": self.wrapped,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "sum_reductions": self.sum_reductions,
            "reason": self.reason,
            "loading": self.loading,
            "loading_reason": self.loading_reason,
            "offload": self.offload,
        }


def resolve_sharding(config, distributed, backend: str, precision) -> ShardingPlan:
    """The plan for ``--shard``; a backend whose ``DistributedOptions`` do not offer FSDP is a clear error."""
    if config.shard != "fsdp":
        why = (
            "data parallel: every process holds the whole model"
            if config.world_size > 1
            else "one process holds the whole model"
        )
        return ShardingPlan("none", config.world_size, reason=why)
    require_fsdp(distributed, backend)
    return ShardingPlan(
        "fsdp",
        config.world_size,
        param_dtype=precision.autocast_dtype,
        reduce_dtype="float32",
        sum_reductions=distributed.sum_reductions,
        reason=distributed.fsdp_reason or f"FSDP2 on {distributed.process_group_backend}",
        offload=config.offload,
    )


def loading_choice(config, model_path: str, skeleton, quantization: str | None) -> tuple[str, str]:
    """(loading, why) for ``ShardingPlan``: "each" process reads its own shares where it can, else "rank0"
    with the reason each process cannot (or --shard-loading rank0). ``skeleton``: the adapted weightless model,
    whose names the checkpoint's are matched to as the run will match them."""
    from vlft.models.loading import SharesUnreadable, checkpoint_names  # torch's stage: this module stays light

    if config.shard_loading == "rank0":
        return "rank0", "--shard-loading rank0"
    if quantization:
        return "rank0", f"--param-dtype {quantization}: transformers quantizes each weight whole while it loads"
    try:
        checkpoint_names(model_path, skeleton)
    except SharesUnreadable as e:
        return "rank0", str(e)
    return "each", "each process reads only its own shares of the safetensors files"


def loading_bytes(whole: int, largest: int, world: int, loading: str) -> int:
    """Host bytes the busiest process holds while the base weights (``whole`` bytes, ``largest`` the largest
    tensor) are read. Each process reading its own: its share of every weight plus one slice in flight (at most
    a share of the largest tensor; counted as the whole tensor). Rank 0 reading for all: the whole model, plus
    its own share once sharded."""
    share = -(-whole // world)
    if loading == "each":
        return share + largest
    return whole + (share if world > 1 else 0)


def require_fsdp(distributed, backend: str) -> None:
    """A clear error when ``backend``'s ``DistributedOptions`` do not offer FSDP2."""
    if distributed is None or not distributed.fsdp:
        why = (
            distributed.fsdp_reason
            if distributed is not None and distributed.fsdp_reason
            else "its plugin does not say its process group supports FSDP2"
        )
        raise ConfigError(
            f"--shard fsdp: backend {backend} does not support sharded training ({why}). Run without --shard "
            f"(data parallel, every process holds the whole model), or choose a backend that supports it "
            f"(vlft plugins lists them); nothing was started."
        )


def transformers_model(model):
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def block_classes(model, family) -> list[str]:
    """The class names that must not be split across devices: the units FSDP shards. The family's
    ``no_split_modules`` where it names them, else what the transformers model class declares."""
    names = (
        (family.sharding.no_split_modules if family.sharding is not None else ())
        or getattr(transformers_model(model), "_no_split_modules", None)
        or []
    )
    if not names:
        raise ConfigError(
            f"--shard fsdp: {type(transformers_model(model)).__name__} names no _no_split_modules, "
            f"so vlft cannot tell which blocks to shard"
        )
    return list(names)


def blocks(model, family) -> list:
    """(name, module) of every block FSDP shards on its own, in model order."""
    wanted = set(block_classes(model, family))
    return [(n, m) for n, m in transformers_model(model).named_modules() if type(m).__name__ in wanted]


def count_blocks(model, family) -> dict[str, int]:
    return dict(Counter(type(m).__name__ for _, m in blocks(model, family)))


def working_set_bytes(model, itemsize: int | None, family) -> tuple[int, int]:
    """(root bytes, largest block bytes) at the gathered dtype's ``itemsize`` (None: each
    parameter's own). The root's parameters (embeddings, head, norms, patch embedding, merger) stay gathered
    through forward and backward; blocks are gathered one at a time, with the next one prefetched."""

    def size(params) -> int:
        return sum(p.numel() * (itemsize or p.element_size()) for p in params)

    block_sizes = [size(m.parameters()) for _, m in blocks(model, family)]
    return size(model.parameters()) - sum(block_sizes), max(block_sizes, default=0)


def base_bytes(model) -> tuple[int, int]:
    """(bytes of the frozen base weights held by this process, bytes of the whole base model), measured on
    the process's tensors."""
    here = whole = 0
    for p in model.parameters():
        if p.requires_grad:
            continue
        here += local(p).numel() * p.element_size()
        whole += p.numel() * p.element_size()
    return here, whole


def local(t):
    """This process's part of a (possibly sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
