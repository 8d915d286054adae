"""``--shard fsdp``: torch's FSDP2 (``fully_shard``) over the run's processes, on any backend that says its
process group supports it.

The model's own ``_no_split_modules`` (for Qwen2.5-VL every text decoder layer and vision block) are each
sharded, then the transformers model as the root, so a block's parameters are gathered just before it
runs and freed after. Frozen base weights and trainable adapter weights share a block's group: FSDP2
checks the dtype of the *trainable* parameters only (all fp32 here) and all-gathers mixed dtypes as bytes,
so the adapters need no groups of their own. The mixed-precision policy comes from the backend's
precision policy: parameters gathered in its compute dtype, gradients reduced in fp32; the sharded
master copies keep their dtype (base in ``--param-dtype``, adapters fp32).

What FSDP changes beyond the step, and where it is handled:

* saving the adapter: the trainable parameters are gathered whole onto rank 0 (``full_trainable_state``)
  and loaded into the weightless adapted copy the plan was made on (``materialized_adapter``), which the
  method's own ``vlft_save_adapter`` writes in PEFT format, as without sharding;
* checkpoints: the optimizer's sharded state goes through torch.distributed.checkpoint (one file per
  process, ``optimizer/``), which the same world size resumes exactly and another world size re-shards;
* evaluation: every process runs the same number of forward passes (``evaluate.evaluate_generation``
  pads the shares and generates with ``synced_gpus``), since each forward gathers every block.
"""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import ConfigError


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

    @property
    def enabled(self) -> bool:
        return self.strategy == "fsdp"

    def describe(self) -> dict:
        return {"strategy": self.strategy, "world_size": self.world_size, "wrapped": self.wrapped,
                "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
                "sum_reductions": self.sum_reductions, "reason": self.reason}


def resolve_sharding(config, distributed, backend: str, precision) -> ShardingPlan:
    """The plan for ``--shard``; a backend whose ``DistributedOptions`` do not offer FSDP is a clear error."""
    if config.shard != "fsdp":
        why = ("data parallel: every process holds the whole model" if config.world_size > 1
               else "one process holds the whole model")
        return ShardingPlan("none", config.world_size, reason=why)
    require_fsdp(distributed, backend)
    return ShardingPlan(
        "fsdp", config.world_size, param_dtype=precision.autocast_dtype, reduce_dtype="float32",
        sum_reductions=distributed.sum_reductions,
        reason=distributed.fsdp_reason or f"FSDP2 on {distributed.process_group_backend}")


def require_fsdp(distributed, backend: str) -> None:
    """A clear error when ``backend``'s ``DistributedOptions`` do not offer FSDP2."""
    if distributed is None or not distributed.fsdp:
        why = (distributed.fsdp_reason if distributed is not None and distributed.fsdp_reason
               else "its plugin does not say its process group supports FSDP2")
        raise ConfigError(
            f"--shard fsdp: backend {backend} does not support sharded training ({why}). Run without --shard "
            f"(data parallel, every process holds the whole model), or choose a backend that supports it "
            f"(vlft plugins lists them); nothing was started.")


def transformers_model(model):
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def block_classes(model) -> list[str]:
    """The class names the model says must not be split across devices: the units FSDP shards."""
    names = getattr(transformers_model(model), "_no_split_modules", None) or []
    if not names:
        raise ConfigError(f"--shard fsdp: {type(transformers_model(model)).__name__} names no _no_split_modules, "
                          f"so vlft cannot tell which blocks to shard")
    return list(names)


def blocks(model) -> list:
    """(name, module) of every block FSDP shards on its own, in model order."""
    wanted = set(block_classes(model))
    return [(n, m) for n, m in transformers_model(model).named_modules() if type(m).__name__ in wanted]


def count_blocks(model) -> dict[str, int]:
    return dict(Counter(type(m).__name__ for _, m in blocks(model)))


def working_set_bytes(model, itemsize: int | None) -> tuple[int, int]:
    """(root bytes, largest block bytes) at the gathered dtype's ``itemsize`` (None: each
    parameter's own). The root's parameters (embeddings, head, norms, patch embedding, merger) stay gathered
    through forward and backward; blocks are gathered one at a time, with the next one prefetched."""
    def size(params) -> int:
        return sum(p.numel() * (itemsize or p.element_size()) for p in params)

    block_sizes = [size(m.parameters()) for _, m in blocks(model)]
    return size(model.parameters()) - sum(block_sizes), max(block_sizes, default=0)


def shard_model(model, plan: ShardingPlan, device, whole: dict | None = None) -> None:
    """Apply ``fully_shard`` to every block, then to the transformers model as the root (in place); with
    several processes, fill the shares from rank 0's ``whole`` state dict (``receive_from_rank0``).

    The root is the transformers model, not the PEFT wrapper, so ``generate`` (which calls the transformers
    model directly) also passes through the root's hooks.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # the root returns the logits as a view; FSDP warns in case the caller changes them in place, which the
    # loss (and nothing else in vlft) never does
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (plan.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, plan.param_dtype) if plan.param_dtype else None,
                              reduce_dtype=getattr(torch, plan.reduce_dtype))
    for _, block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    root = fully_shard(transformers_model(model), mesh=mesh, mp_policy=mp)
    if plan.world_size > 1:
        receive_from_rank0(model, whole, device)
    # FSDP takes as root the first sharded module whose forward runs; generate runs the vision tower's
    # blocks before the root's forward, so settle the root now (torch has no public call for this)
    fully_shard.state(root)._lazy_init()
    if plan.sum_reductions:
        for module in root.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def receive_from_rank0(model, state: dict | None, device) -> None:
    """Fill a sharded model whose processes other than rank 0 were built on 'meta' (``model.empty_model``):
    rank 0 passes the full state dict it loaded (``state``, on the host), each process keeps its share.

    Only rank 0 reads the checkpoint from disk and holds it whole in host memory; the others allocate only
    their shards. Buffers (rotary frequencies, which the state dict does not hold) are copied from rank 0.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    main = torch.distributed.get_rank() == 0
    if not main:
        model.to_empty(device=device)
    with torch.no_grad():
        for _, buffer in model.named_buffers():
            torch.distributed.broadcast(buffer, src=0)
    set_model_state_dict(model, state if main else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


@contextmanager
def root_gathered(model):
    """Keep the root's own parameters (embeddings, head, patch embedding, merger) gathered inside the block.

    ``generate`` computes image features by calling the vision tower directly, outside the root's forward
    and so outside its hooks; the blocks still gather themselves through theirs."""
    root = transformers_model(model)
    if not hasattr(root, "unshard"):
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        root.reshard()


def local(t):
    """This process's part of a (possibly sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


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


def full_trainable_state(model) -> dict | None:
    """The trainable parameters gathered whole, on the CPU of rank 0 (None elsewhere). Every process must
    call it: each parameter is one all-gather, in the same order everywhere. Only the adapter is gathered,
    never the frozen base model."""
    import torch

    main = torch.distributed.get_rank() == 0
    state = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            if main:
                state[name] = whole.detach().to("cpu", copy=True)
    return state if main else None


def materialized_adapter(skeleton, state: dict):
    """The weightless adapted copy (``preflight``'s) holding ``state``: its adapter real, its base still on
    'meta'. The method's ``vlft_save_adapter`` writes only the adapter, so it writes this as it would the
    trained model."""
    missing = [k for k in state if k not in dict(skeleton.named_parameters())]
    if missing:
        raise RuntimeError(f"the gathered adapter has parameters the plan's copy lacks (e.g. {missing[0]})")
    skeleton.load_state_dict(state, strict=False, assign=True)
    return skeleton


# -- the optimizer's sharded state, through torch.distributed.checkpoint ------------------------------------

OPTIMIZER_DIR = "optimizer"


def save_optimizer(model, optimizer, folder) -> None:
    """Each process writes its shard of the optimizer state under ``folder`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(folder))


def load_optimizer(model, optimizer, folder) -> None:
    """Read the sharded optimizer state under ``folder`` into ``optimizer`` (collective). Another world size
    than the one that wrote it is re-sharded by torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
