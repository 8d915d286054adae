"""Sequence parallelism (``--sequence-parallel N``): each sample's tokens split over N processes, DeepSpeed-Ulysses
style, so the text model's activations of one long sample are spread over N devices.

The processes of one sequence group train on the same batches (``RunConfig.data_rank``). Every one of them runs
the vision tower and the embeddings on the whole batch, as one process would; then, at the text model:

- **in** (a forward pre-hook on the text model): the input embeddings, the position ids and the padding mask are
  padded to a multiple of N and cut into N chunks of C tokens; this process keeps its chunk. The position ids stay
  the global ones, so rotary embeddings (1-D or mRoPE) are what one process computes. The attention mask is built
  once for the whole row, ``[B, 1, L, L]``: causal, the padding's keys out, and, for a packed row, each sample to
  itself (where its text position row restarts). transformers takes a 4-D mask as given.
- **attention** (an implementation registered with transformers' attention interface, which wraps the run's own,
  sdpa or eager): an all-to-all turns the chunk's queries, keys and values ``[B, H, C, D]`` into all L tokens of
  H/N heads ``[B, H/N, L, D]``; the attention runs on them with the whole row's mask; a second all-to-all turns the
  output back into the chunk's tokens with every head. Heads and key-value heads must divide by N.
- **out** (a forward hook on the text model): the chunks' last hidden states are gathered into the whole row, so
  the head, the labelled positions and the loss are exactly one process's.

Gradients: every process of the group computes the same loss from the gathered row, so the gather's backward sums
the group's gradients for each chunk (N times one process's), and data parallelism's average over all processes
(DDP, FSDP) divides by N again: the step's loss and gradients are one process's, with the loss scaled as always
(``train_step``: processes / global units, the units counted once by every process of a group).

Generation (the before/after answers, GRPO's rollouts) runs on whole sequences: the split is on only inside
``SequenceSplit.on()``, which the training step and validation open around the loss.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vlft.models.families import base_model, resolve_module
from vlft.models.rows import unwrapped
from vlft.models.segments import eager_attention

NAME = "vlft_sequence_parallel"


@dataclass
class SequenceSplit:
    """One process's part of its sequence group: the group, this process's rank in it, the text attention it
    wraps, and, during a split forward, the whole row's length and mask."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    underlying: str  # the text attention the run loaded ("sdpa", "eager", or packing's per-segment twin)
    active: bool = False
    length: int = 0
    mask: torch.Tensor | None = field(default=None, repr=False)  # the whole row's, where the attention needs one
    text_positions: torch.Tensor | None = field(default=None, repr=False)  # a packed row's, whole
    text_modules: frozenset = frozenset()  # ids of the text model's modules: only their attention is split
    marked: dict = field(default_factory=dict)  # the family's marked inputs: mask name -> the row inputs' names

    @contextmanager
    def on(self):
        """Split the text model's forwards inside this block (the training loss, validation's)."""
        self.active = True
        try:
            yield
        finally:
            self.active, self.mask = False, None

    # -- the text model's inputs and outputs ---------------------------------------------------------------

    def split_inputs(self, module, args: tuple, kwargs: dict):
        if not self.active:
            return None
        if args:
            raise RuntimeError("--sequence-parallel: the text model was called with positional arguments")
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = module.get_input_embeddings()(kwargs["input_ids"])
        rows, length = embeds.shape[:2]
        padded = -(-length // self.size) * self.size
        chunk = slice(self.rank * padded // self.size, (self.rank + 1) * padded // self.size)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=embeds.device).expand(rows, length)
        keys = kwargs.get("attention_mask")
        if keys is not None and keys.dim() != 2:
            raise RuntimeError(f"--sequence-parallel: a {keys.dim()}-D attention mask reached the text model")
        self.length, self.text_positions, self.mask = length, None, None
        text = positions[0] if positions.dim() == 3 and positions.shape[0] == 4 else positions
        packed = keys is None and text.dim() == 2 and bool((text[:, 1:] - text[:, :-1] != 1).any())
        if packed:  # packing's per-segment attention finds the samples in the whole row's text positions
            self.text_positions = _pad(text, 1, padded)
        elif (keys is not None and not bool(keys.all())) or self.underlying.endswith("eager"):
            self.mask = causal_mask(keys, rows, length, padded, embeds.dtype, embeds.device)
        kwargs = dict(kwargs, input_ids=None, attention_mask=None)  # the attention masks the whole row itself
        kwargs["inputs_embeds"] = _pad(embeds, 1, padded)[:, chunk]
        kwargs["position_ids"] = _pad(positions, positions.dim() - 1, padded)[..., chunk]
        for mask, rows_of in self.marked.items():
            if kwargs.get(mask) is not None:
                kwargs.update(_marked_part(kwargs, mask, rows_of, padded, chunk))
        return args, kwargs

    def gather_outputs(self, module, args, kwargs, output):
        if not self.active:
            return None
        hidden = _GatherSequence.apply(output.last_hidden_state, self.group, self.size)
        output.last_hidden_state = hidden[:, : self.length]
        return output

    # -- the attention -------------------------------------------------------------------------------------

    def attend(self, module, query, key, value, attention_mask, **kwargs):
        inner = eager_attention(module) if self.underlying == "eager" else ALL_ATTENTION_FUNCTIONS[self.underlying]
        if not self.active or id(module) not in self.text_modules:
            return inner(module, query, key, value, attention_mask, **kwargs)
        q, k, v = (self._heads(t) for t in (query, key, value))
        kwargs["position_ids"] = self.text_positions  # the whole row's (a packed row's samples), or None
        out, _ = inner(module, q, k, v, self.mask, **kwargs)  # [B, L, H/N, D]
        return self._tokens(out), None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, C, D]`` (this chunk, every head) -> ``[B, H/N, L, D]`` (every chunk, this process's heads)."""
        b, h, c, d = x.shape
        send = x.reshape(b, self.size, h // self.size, c, d).transpose(0, 1).contiguous()
        got = _AllToAll.apply(send, self.group)
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * c, d)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, H/N, D]`` -> ``[B, C, H, D]``: the attention's output back on its chunk, with every head."""
        b, length, h, d = x.shape
        c = length // self.size
        send = x.reshape(b, self.size, c, h, d).transpose(0, 1).contiguous()
        got = _AllToAll.apply(send, self.group)
        return got.permute(1, 2, 0, 3, 4).reshape(b, c, self.size * h, d)


def causal_mask(keys, rows: int, length: int, padded: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive mask ``[B, 1, padded, padded]`` of whole rows: causal, with the padding's keys (``keys`` 0,
    and the positions past ``length``) out; a query with no key left (padding) keeps its own."""
    valid = torch.zeros(rows, padded, dtype=torch.bool, device=device)
    valid[:, :length] = keys.bool() if keys is not None else True
    idx = torch.arange(padded, device=device)
    allowed = (idx[None, :] <= idx[:, None])[None] & valid[:, None, :]
    allowed = allowed | torch.eye(padded, dtype=torch.bool, device=device)[None]
    mask = torch.zeros(rows, 1, padded, padded, dtype=dtype, device=device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def _marked_part(kwargs: dict, mask: str, rows_of: tuple[str, ...], padded: int, chunk: slice) -> dict:
    """This chunk's part of a mask input ``[B, L]`` (``Sharding.marked_inputs``) and of the inputs holding a
    row per marked position: the rows of the positions in the chunk, in the mask's row-major order."""
    whole = kwargs[mask].bool()
    whole = torch.cat([whole, whole.new_zeros(whole.shape[0], padded - whole.shape[1])], 1)
    ours = torch.zeros_like(whole)
    ours[:, chunk] = True
    kept = ours[whole]  # one entry per marked position: whether it lies in this chunk
    part: dict = {mask: whole[:, chunk]}
    for name in rows_of:
        rows = kwargs.get(name)
        if isinstance(rows, (list, tuple)):
            part[name] = [r[kept] for r in rows]
        elif rows is not None:
            part[name] = rows[kept]
    return part


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` padded along ``dim`` to ``size``: positions with their last entry (padding joins no sample, see
    ``models.segments.sample_bounds``), anything else with zeros."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = (*x.shape[:dim], extra, *x.shape[dim + 1 :])
    if x.is_floating_point():
        return torch.cat([x, x.new_zeros(shape)], dim)
    return torch.cat([x, x.narrow(dim, x.shape[dim] - 1, 1).expand(shape)], dim)


class _AllToAll(torch.autograd.Function):
    """Part i of dim 0 to process i of the group, part i of the result from it; backward: the same exchange of
    the gradients, back to where each part came from."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous as x is: the exchange writes raw memory
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0].contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherSequence(torch.autograd.Function):
    """The group's chunks joined along the sequence; backward: the group's gradients summed, this chunk's kept
    (every process computed the same loss from the gathered row)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0].contiguous()
        dist.all_reduce(grad, group=ctx.group)
        c = grad.shape[1] // ctx.size
        rank = dist.get_rank(ctx.group)
        return grad[:, rank * c : (rank + 1) * c], None, None


def install_sequence_split(model, family, size: int) -> SequenceSplit:
    """Split ``model``'s text model over groups of ``size`` consecutive processes; the text attention is wrapped
    by ``vlft_sequence_parallel``. Returns the split, whose ``on()`` the loss runs inside."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = None
    # groups of their own, the whole world's included: DDP's gradient all-reduces run on the default group from a
    # background thread during the backward, and the split's exchanges, in the same backward, must not share it
    for start in range(0, world, size):  # every process creates every group, as new_group requires
        ranks = list(range(start, start + size))
        made = dist.new_group(ranks)
        if rank in ranks:
            assert isinstance(made, dist.ProcessGroup), f"rank {rank} is a member of {ranks}"
            group = made
    text = resolve_module(base_model(unwrapped(model)), family.towers.decoder_layers.rpartition(".")[0])
    split = SequenceSplit(
        group,
        size,
        rank % size,
        underlying=text.config._attn_implementation,
        marked=dict(family.sharding.marked_inputs) if family.sharding is not None else {},
    )
    AttentionInterface.register(NAME, split.attend)  # one model a process: the name is this run's
    # outside a split forward (generation) the model builds the masks it builds for the attention it wraps
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[split.underlying])
    split.text_modules = frozenset(id(m) for m in text.modules())
    # this config alone: the setter passes a name on to the sub-configs (a vision tower's, where the text model's
    # config is the whole model's), and a vision tower split over the group would attend over each copy twice
    text.config._attn_implementation_internal = NAME
    text.register_forward_pre_hook(split.split_inputs, with_kwargs=True)
    text.register_forward_hook(split.gather_outputs, with_kwargs=True)
    return split
