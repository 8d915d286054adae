"""Validation loss: the training loss (sum over label tokens / label tokens) without gradients.
"""

from __future__ import annotations

import torch

from vlft.data.batching import (
    label_count,
    model_inputs,
    to_device,
    with_label_positions,
)
from vlft.models.loss import autocast_context, batch_loss_sum


@torch.no_grad()
def validation_loss(model, loader_batches: list[dict], device, autocast_dtype=None, labels_only: bool = True) -> float:
    """Mean token loss over fixed validation batches (logits at labelled positions only, as in training)."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for host_batch in loader_batches:
        tokens += label_count(host_batch)
        batch = to_device(with_label_positions(host_batch) if labels_only else host_batch, device)
        total += float(batch_loss_sum(model, model_inputs(batch), batch, autocast_context(device, autocast_dtype)))
    model.train(was_training)
    return total / max(tokens, 1)
