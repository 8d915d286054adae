"""Validation loss: the training loss (sum over label tokens / label tokens) without gradients; for an objective
with its own loss (``Objective.loss``), that loss and its figures, over the same units as in training.
"""

from __future__ import annotations

import torch

from vlft.data.batching import (
    batch_counts,
    label_count,
    model_inputs,
    to_device,
    with_label_positions,
)
from vlft.models.loss import autocast_context, batch_loss_sum
from vlft.training.loop import figure_means


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


@torch.no_grad()
def objective_validation(model, loader_batches: list[dict], device, autocast_dtype, objective, reference) -> dict:
    """``val_loss`` and ``val_<figure>`` of ``objective``'s loss over fixed validation batches, averaged over its
    units (label tokens or records) as in training, in evaluation mode."""
    was_training = model.training
    model.eval()
    total, units, sums = 0.0, 0, {}
    autocast = autocast_context(device, autocast_dtype)
    for host_batch in loader_batches:
        if objective.rollout is not None:  # GRPO: completions sampled and scored, then its loss on them
            batches, n = objective.rollout(model, [host_batch], device, autocast)
            units += n
        else:
            units += batch_counts(host_batch)[0] if objective.average_over == "records" else label_count(host_batch)
            batches = [to_device(with_label_positions(host_batch), device)]
        for batch in batches:
            loss_sum, figures = objective.loss(model, batch, autocast, reference)
            total += float(loss_sum)
            for name, value in figures.items():
                sums[name] = sums.get(name, 0.0) + float(value)
    model.train(was_training)
    means = figure_means(sums, objective.figure_units, units, len(loader_batches))
    return {"val_loss": total / max(units, 1), **{f"val_{n}": v for n, v in means.items()}}
