"""``--shard fsdp``, the run side: FSDP2 on each block and the root, rank 0's weights sent to the others,
the adapter gathered whole to save it, and the sharded optimizer state.

The plan side (which blocks, what each process holds) is ``vlft.planning.sharding``.
What FSDP changes beyond the step, and where it is handled:

* saving the adapter: the trainable parameters are gathered whole onto rank 0 (``full_trainable_state``)
  and loaded into the weightless adapted copy the plan was made on (``materialized_adapter``), which the
  method's own ``vlft_save_adapter`` writes in PEFT format, as without sharding;
* checkpoints: the optimizer's sharded state goes through torch.distributed.checkpoint (one file per
  process, ``optimizer/``), which the same world size resumes exactly and another world size re-shards;
* evaluation: every process runs the same number of forward passes (``evaluation.generation`` pads the
  shares and generates with ``synced_gpus``), since each forward gathers every block.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from transformers import PreTrainedModel

from vlft.errors import VlftError
from vlft.models.loading import checkpoint_names, swap_parameters
from vlft.planning.sharding import ShardingPlan, blocks, transformers_model


def shard_model(
    model, plan: ShardingPlan, device, whole: dict | None = None, *, family, read_from: str | None = None
) -> None:
    """Apply ``fully_shard`` to every block, then to the transformers model as the root (in place), and fill the
    shares: with ``plan.loading`` "each", every process reads its own from the checkpoint at ``read_from``
    (``read_own_shares``; the model was built with ``with_stand_in_weights``); else, with several processes,
    from rank 0's ``whole`` state dict (``receive_from_rank0``).

    The root is the transformers model, not the PEFT wrapper, so ``generate`` (which calls the transformers
    model directly) also passes through the root's hooks.
    """
    # public from torch 2.6 (vlft.floors): imported here, so importing the training stage on an older torch
    # leaves the refusal to the run's plan (floors.require_torch), which names the version
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (plan.world_size,))
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, plan.param_dtype) if plan.param_dtype else None,
        reduce_dtype=getattr(torch, plan.reduce_dtype),
    )
    # --offload cpu: the shares live on the host (pinned where the device copies from pinned memory faster)
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if plan.offload == "cpu" else OffloadPolicy()
    home = torch.device("cpu") if plan.offload == "cpu" else device
    each = read_from if plan.loading == "each" else None  # the folder each process reads its own shares from
    names = checkpoint_names(each, model) if each is not None else {}
    kept = emptied_keeping(model, names) if each is not None else {}
    for _, block in blocks(model, family):  # the plan family's no_split_modules, as the plan counted them
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    root = fully_shard(transformers_model(model), mesh=mesh, mp_policy=mp, offload_policy=offload)
    if each is not None:
        read_own_shares(model, each, home, names, kept)
    elif plan.world_size > 1:
        receive_from_rank0(model, whole, home)
    # FSDP takes as root the first sharded module whose forward runs; generate runs the vision tower's
    # blocks before the root's forward, so settle the root now (torch has no public call for this)
    fully_shard.state(root)._lazy_init()
    quiet_during_forward(root, r"FSDP2-wrapped module .* returned a view tensor")
    if plan.sum_reductions:
        for module in root.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def emptied_keeping(model, names: dict[str, str]) -> dict:
    """Before sharding a model of stand-in weights (``with_stand_in_weights``) that a method adapted: what the
    checkpoint does not hold and the host does (the adapter, initialised on the host; buffers a method added)
    copied out, by name in the transformers model, then every parameter put on 'meta', where ``fully_shard``
    splits it without memory. ``names``: the checkpoint's tensors (``checkpoint_names``).

    A kept value that is not finite was computed from the stand-ins' NaN: the method's initialisation read the
    base weights, which no process has yet; that is refused, naming the rank-0 path that has them."""
    tf = transformers_model(model)
    kept = {n: p.detach().clone() for n, p in tf.named_parameters() if n not in names}
    kept.update({n: b.clone() for n, b in tf.named_buffers() if n not in names and b.device.type != "meta"})
    bad = next((n for n, t in kept.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise VlftError(
            f"--shard fsdp: {bad} is initialised from the base weights (DoRA's magnitudes, an SVD initialisation), "
            "which each process reading only its own shares does not hold before sharding; pass "
            "--shard-loading rank0 (rank 0 reads the whole checkpoint and sends the shares out)"
        )
    swap_parameters(model, lambda p: torch.empty_like(p, device="meta"))
    return kept


def read_own_shares(model, path: str, device, names: dict[str, str], kept: dict) -> None:
    """Fill a sharded model whose parameters are on 'meta' (``emptied_keeping``): each process reads from the
    safetensors files at ``path`` only the ranges of its own shares (torch.distributed.checkpoint's
    ``HuggingFaceStorageReader``: one slice at a time, never a whole tensor it does not own), then puts back
    what was ``kept`` and computes the buffers the checkpoint does not hold (rotary frequencies) as
    transformers does when it loads (``computed_buffers``)."""
    model.to_empty(device=device)
    tf = transformers_model(model)
    own = tf.state_dict()
    dcp.load({stored: own[name] for name, stored in names.items()}, storage_reader=HuggingFaceStorageReader(path))  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it without __all__
    params = {n for n, _ in tf.named_parameters()}
    set_model_state_dict(
        tf,
        {n: t for n, t in kept.items() if n in params},
        options=StateDictOptions(full_state_dict=True, strict=False),
    )
    with torch.no_grad():
        for n, b in tf.named_buffers():
            if n in kept:
                b.copy_(kept[n])
    computed_buffers(tf, skip=set(names) | set(kept))


def computed_buffers(tf, skip: set[str]) -> None:
    """Every buffer of the transformers model ``tf`` not named in ``skip``, computed by the ``_init_weights`` of
    the transformers model that owns it, as ``from_pretrained`` computes the buffers a checkpoint does not hold.
    A buffer that rule leaves unset is an error naming it (its value would be whatever memory held)."""
    owners = {n: m for n, m in tf.named_modules() if isinstance(m, PreTrainedModel)}
    with torch.no_grad():
        for name, module in tf.named_modules():
            own = [
                (f"{name}.{n}" if name else n, b)
                for n, b in module.named_buffers(recurse=False)
                if (f"{name}.{n}" if name else n) not in skip and b is not None
            ]
            if not own:
                continue
            for _, b in own:
                b.fill_(float("nan") if b.is_floating_point() else -1)
            for p in module.parameters(recurse=False):  # loaded: the rule must set only the buffers
                p._is_hf_initialized = True
            owner = max((k for k in owners if not k or name == k or name.startswith(k + ".")), key=len)
            owners[owner]._init_weights(module)
            unset = [n for n, b in own if (b.isnan() if b.is_floating_point() else b == -1).any()]
            if unset:
                raise VlftError(
                    f"--shard fsdp: the buffer {unset[0]} is not in the checkpoint and transformers' _init_weights "
                    "does not compute it, so a process reading only its own shares cannot set it; pass "
                    "--shard-loading rank0"
                )


def quiet_during_forward(module, message: str) -> None:
    """Ignore warnings matching ``message`` while ``module``'s forward runs, its hooks included, and only then:
    the process's warning filters are as they were after each forward (an error inside it too).

    FSDP2 warns at every forward of the root that it returned a view (the logits), in case the caller changes
    it in place, which the loss (and nothing else in vlft) never does; its post-forward hook raises it, so the
    scope opens before FSDP's pre-forward hook and closes after its post-forward hook.
    """
    scopes = []

    def enter(_module, _args):
        scope = warnings.catch_warnings()
        scope.__enter__()
        warnings.filterwarnings("ignore", message=message)
        scopes.append(scope)

    def leave(_module, _args, _output):
        scopes.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)


def receive_from_rank0(model, state: dict | None, device) -> None:
    """Fill a sharded model whose processes other than rank 0 were built on 'meta' (``model.empty_model``):
    rank 0 passes the full state dict it loaded (``state``, on the host), each process keeps its share.

    Only rank 0 reads the checkpoint from disk and holds it whole in host memory; the others allocate only
    their shards. Buffers (rotary frequencies, which the state dict does not hold) are copied from rank 0.
    """

    main = torch.distributed.get_rank() == 0
    if not main:
        model.to_empty(device=device)
    with torch.no_grad():
        for _, buffer in model.named_buffers():
            torch.distributed.broadcast(buffer, src=0)
    full = state if main else {}
    assert full is not None, "rank 0 passes the full state dict it loaded"
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


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


def full_trainable_state(model) -> dict | None:
    """The trainable parameters gathered whole, on the CPU of rank 0 (None elsewhere). Every process must
    call it: each parameter is one all-gather, in the same order everywhere. Only the adapter is gathered,
    never the frozen base model."""

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


OPTIMIZER_DIR = "optimizer"


def save_optimizer(model, optimizer, folder) -> None:
    """Each process writes its shard of the optimizer state under ``folder`` (collective)."""

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(folder))  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it without __all__


def load_optimizer(model, optimizer, folder) -> None:
    """Read the sharded optimizer state under ``folder`` into ``optimizer`` (collective). Another world size
    than the one that wrote it is re-sharded by torch.distributed.checkpoint."""

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(folder))  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it without __all__
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
