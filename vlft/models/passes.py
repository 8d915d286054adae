"""The passes the core runs for an objective (``vlft.Passes``): a batch moved to the device, the next-token
loss, and the log-probabilities of its rows under the model or its reference, on the run's device and under
its autocast. Training and validation hand an objective's ``prepare`` and ``loss`` one of these, so a plugin
computes what it needs through it and imports nothing else of vlft.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from vlft.contracts.objective import Average
from vlft.data.batching import (
    batch_counts,
    label_count,
    model_inputs,
    to_device,
    with_label_positions,
)
from vlft.data.records import IGNORE_INDEX
from vlft.models.loss import autocast_context, batch_loss_sum, labelled_logits, sequence_logps
from vlft.models.rows import row_inputs, unwrapped


class StepPasses:
    """``vlft.Passes`` for one run: its device and autocast, its reference model (``models.reference.Reference``;
    None where the objective takes none), its sample encoder, and how batches move (``labels_only``: each row
    batch carries its labelled positions, so the head runs there only; ``non_blocking`` copies).

    ``gathered``: None for a whole model; under ``--shard fsdp`` the context that keeps the sharded root's own
    parameters gathered (``training.fsdp.root_gathered``). A sharded model's root parameters (embeddings,
    patch embedding, merger) are gathered by its forward alone, so the vision tower is not called apart from it
    (row batches repeat their images for each group of rows, encoded once per row) and ``generate``, which
    calls the vision tower before the root's forward, runs inside ``gathered``; every process decodes until all
    are done (``synced_gpus``), since each decoding step gathers every block."""

    def __init__(
        self,
        device,
        autocast_dtype=None,
        reference=None,
        encoder=None,
        labels_only: bool = True,
        non_blocking: bool = False,
        gathered: Callable[[Any], AbstractContextManager] | None = None,
    ):
        self.device, self.reference, self.encoder = device, reference, encoder
        self.autocast = autocast_context(device, autocast_dtype) if device is not None else nullcontext()
        self.labels_only, self.non_blocking = labels_only, non_blocking
        self.gathered = gathered

    @property
    def sharded(self) -> bool:
        return self.gathered is not None

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def count(self, host_batch: dict, average: Average) -> int:
        if average is Average.RECORDS:
            return batch_counts(host_batch)[0]
        if average is Average.LABEL_TOKENS:
            return label_count(host_batch)
        raise ValueError(f"an objective averaging over {average.value} counts them in its own prepare")

    def to_device(self, host_batch: dict) -> dict:
        batch = self.with_positions(host_batch) if self.labels_only else host_batch
        return to_device(batch, self.device, self.non_blocking)

    def with_positions(self, batch: dict) -> dict:
        """``batch`` and every row batch nested in it (KTO's KL rows) with their labelled positions."""
        nested = {k: self.with_positions(v) for k, v in batch.items() if isinstance(v, dict)}
        return {**(with_label_positions(batch) if "labels" in batch else batch), **nested}

    def sampler(self, model):
        return unwrapped(model)

    def token_loss_sum(self, model, batch: dict):
        return batch_loss_sum(model, model_inputs(batch), batch, self.autocast)

    def generate(self, model, inputs: dict, **options):
        synced = {"synced_gpus": True} if self.sharded else {}
        with self.gathered(model) if self.gathered is not None else nullcontext():
            return model.generate(**inputs, **options, **synced)

    def sequence_logps(self, model, batch: dict, groups: int = 1):
        with self.autocast:
            inputs = row_inputs(model, batch, groups, share_features=not self.sharded)
        return sequence_logps(model, inputs, batch, self.autocast)

    def reference_sequence_logps(self, batch: dict, groups: int = 1):
        with self._reference() as ref:
            return self.sequence_logps(ref, batch, groups)

    def token_logps(self, model, batch: dict, groups: int = 1, temperature: float = 1.0, suppressed=()):
        with self.autocast:
            inputs = row_inputs(model, batch, groups, share_features=not self.sharded)
        return token_logps(model, inputs, batch, self.autocast, temperature, suppressed)

    def reference_token_logps(self, batch: dict, groups: int = 1, temperature: float = 1.0, suppressed=()):
        with self._reference() as ref:
            return self.token_logps(ref, batch, groups, temperature, suppressed)

    def _reference(self):
        if self.reference is None:
            raise ValueError(
                "this run keeps no reference model: the objective must say it takes one (Objective.reference)"
            )
        return self.reference()


def token_logps(model, inputs: dict, batch: dict, autocast: Any, temperature: float = 1.0, suppressed=()):
    """(per-token log-probabilities ``[n, P]`` at the batch's labelled positions, their mask), under a
    sampler's distribution: the logits divided by ``temperature`` (as TRL's GRPOTrainer does) and the
    ``suppressed`` tokens (image and video tokens, which sampling never draws) left out of the normalisation,
    so a ratio or a policy gradient is the sampling policy's, not the temperature-1 model's over the whole
    vocabulary."""
    kept = labelled_logits(model, inputs, batch, autocast)
    if kept is None:
        raise ValueError(
            "token log-probabilities are read at the batch's labelled positions: give the batch them "
            "(Passes.to_device, or data.batching.with_label_positions)"
        )
    logits, targets = kept
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    if len(suppressed):
        logits = logits.index_fill(-1, torch.tensor(list(suppressed), device=logits.device), float("-inf"))
    mask = targets != IGNORE_INDEX
    logps = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps.masked_fill(~mask, 0.0), mask  # not a product: an ignored position may gather a suppressed -inf
