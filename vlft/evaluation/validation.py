"""Validation loss: the training loss (sum over label tokens / label tokens) without gradients.
"""

from __future__ import annotations

import torch

from vlft.data.batching import label_count, model_inputs, to_device
from vlft.models.loss import autocast_context, token_loss_sum


@torch.no_grad()
def validation_loss(model, loader_batches: list[dict], device, autocast_dtype=None) -> float:
    """Mean token loss over fixed validation batches."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for host_batch in loader_batches:
        tokens += label_count(host_batch)
        batch = to_device(host_batch, device)
        with autocast_context(device, autocast_dtype):
            logits = model(**model_inputs(batch)).logits
        total += float(token_loss_sum(logits, batch["labels"]))
    model.train(was_training)
    return total / max(tokens, 1)
