"""The reference model of a preference objective: the same model, without a second copy of its weights.

With a fresh adapter the reference is the base model: the adapter switched off (PEFT's ``disable_adapter``).
A run that starts from an adapter (``--init-adapter``, say an SFT run's) takes that adapter as it was loaded
as its reference, as DPO after SFT means: its weights are kept (one copy of the adapter, which the memory
plan counts) and swapped into the trainable parameters for the reference pass, then swapped back (no copy:
the parameters' storage is exchanged). The reference pass runs without gradients and in evaluation mode (no
dropout), and leaves the model as it found it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class Reference:
    """``reference()`` is a context manager giving the reference model (see the module docstring)."""

    def __init__(self, model, initial: dict[str, torch.Tensor] | None = None):
        self.model = model  # the adapted (PEFT) model, unwrapped
        self.initial = initial  # trainable parameter name -> its weights when training started; None: adapter off

    @staticmethod
    def capture(model) -> dict[str, torch.Tensor]:
        """The trainable weights of ``model`` as they are now (the adapter the run starts from)."""
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @contextmanager
    def __call__(self):
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if self.initial is None:
                    with model.disable_adapter():
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
            p.data, kept.data = kept.data, p.data
        try:
            yield
        finally:
            for p, kept in params:
                p.data, kept.data = kept.data, p.data

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps so that a resumed run has the same reference (nothing for the base)."""
        return dict(self.initial) if self.initial is not None else {}
