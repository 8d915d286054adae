"""The reference model of a preference objective: the same model, without a second copy of its weights.

With a fresh adapter the reference is the base model: the adapter switched off (PEFT's ``disable_adapter``).
A run that starts from an adapter (``--init-adapter``, say an SFT run's) takes that adapter as it was loaded
as its reference, as DPO after SFT means: its weights are kept (one copy of the adapter, which the memory
plan counts) and swapped into the trainable parameters for the reference pass, then swapped back. The
reference pass runs without gradients and in evaluation mode (no dropout), and leaves the model as it found it.

Under ``--shard fsdp`` (FSDP2) the trainable parameters are each process's shares (``DTensor``), and both ways
work on them inside the sharded forward:

* switching the adapter off is a flag on each adapted layer, read inside each block's forward after FSDP has
  gathered it; but PEFT's ``disable_adapter`` also switches the adapter's gradients off, and FSDP2 fixes a
  parameter's ``requires_grad`` into its gathered copy at the first gather, so a first gather inside the
  reference pass would leave the adapter untrainable for the whole run: the gradients are switched back on
  inside the pass (which runs without gradients anyway);
* the kept adapter is the shares as they were, and the exchange copies them in place: FSDP gathers from the
  storage it holds, not from whatever ``.data`` points to (without sharding the storages are exchanged, no
  copy). A checkpoint keeps the kept adapter whole (gathered on every process, written by rank 0) and a
  resumed run takes each process's shares of it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


class Reference:
    """``reference()`` is a context manager giving the reference model (see the module docstring)."""

    def __init__(self, model, initial: dict[str, torch.Tensor] | None = None):
        self.model = model  # the adapted (PEFT) model, unwrapped
        self.initial = initial  # trainable parameter name -> its weights when training started; None: adapter off

    @staticmethod
    def capture(model) -> dict[str, torch.Tensor]:
        """The trainable weights of ``model`` as they are now (the adapter the run starts from; under FSDP each
        process's shares)."""
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @classmethod
    def resumed(cls, model, kept: dict[str, torch.Tensor], device) -> Reference:
        """The reference of a resumed run from what its checkpoint kept (``state``: whole weights), laid out as
        the model's trainable parameters are: on ``device``, and under FSDP as this process's shares."""
        params = dict(model.named_parameters())
        initial = {}
        for name, whole in kept.items():
            p, whole = params[name], whole.to(device)
            if isinstance(p, DTensor):  # each process keeps its own shares (rank 0's sent: all hold the same)
                whole = distribute_tensor(whole, p.device_mesh, p.placements)
            initial[name] = whole
        return cls(model, initial)

    @contextmanager
    def __call__(self):
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if self.initial is None:
                    trainable = [p for p in model.parameters() if p.requires_grad]
                    with model.disable_adapter():
                        for p in trainable:  # see the module docstring: FSDP2 would keep them off
                            p.requires_grad_(True)
                        yield model
                else:
                    with self._swapped(model):
                        yield model
        finally:
            model.train(was_training)

    @contextmanager
    def _swapped(self, model):
        assert self.initial is not None  # swapped only where the adapter's start was kept
        params = [(p, self.initial[n]) for n, p in model.named_parameters() if n in self.initial]
        for p, kept in params:
            _exchange(p, kept)
        try:
            yield
        finally:
            for p, kept in params:
                _exchange(p, kept)

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps so that a resumed run has the same reference (nothing for the base): the
        kept adapter whole. Every process calls it under FSDP (each sharded tensor is one all-gather)."""
        if self.initial is None:
            return {}
        return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in self.initial.items()}


def _exchange(param: torch.Tensor, kept: torch.Tensor) -> None:
    """Exchange a parameter's values with the kept ones: their storages, or for FSDP's shares a copy in place
    (see the module docstring)."""
    if isinstance(param, DTensor):
        assert isinstance(kept, DTensor), "a sharded parameter's kept weights are its shares (capture, resumed)"
        mine, theirs = param.to_local(), kept.to_local()
        held = mine.clone()
        mine.copy_(theirs)
        theirs.copy_(held)
    else:
        param.data, kept.data = kept.data, param.data
