"""Validation loss: the training loss (sum over label tokens / label tokens) without gradients; for an objective
with its own loss (``Objective.loss``), that loss and its figures, over the same units as in training.
"""

from __future__ import annotations

import torch

from vlft.data.batching import label_count, model_inputs, to_device, with_label_positions
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
def objective_validation(model, loader_batches: list[dict], passes, objective) -> dict:
    """``val_loss`` and ``val_<figure>`` of ``objective``'s loss over fixed validation batches, each prepared as
    in training (``Objective.prepare``: GRPO samples and scores its completions) and averaged over the same
    units, in evaluation mode; ``passes``: the run's (``StepPolicy.passes``)."""
    was_training = model.training
    model.eval()
    total, units, sums = 0.0, 0, {}
    for host_batch in loader_batches:
        prepared = objective.prepare(model, [host_batch], passes)
        units += prepared.units
        figures = [dict(prepared.figures)]
        for batch in prepared.batches:
            loss_sum, parts = objective.loss(model, batch, passes)
            total += float(loss_sum)
            figures.append(parts)
        for part in figures:
            for name, value in part.items():
                sums[name] = sums.get(name, 0.0) + float(value)
    model.train(was_training)
    means = figure_means(sums, objective.figure_units, units, len(loader_batches))
    return {"val_loss": total / max(units, 1), **{f"val_{n}": v for n, v in means.items()}}
