"""The training loss: next-token cross-entropy summed over label tokens, and the autocast it runs under.

Most positions of a VLM sample (image and prompt tokens) carry no label. ``data.batching.label_positions`` finds,
on the host, the positions whose logit predicts a label (the logit at position t predicts label t+1); the model is
asked for the logits there only (transformers' ``logits_to_keep`` with a tensor of positions), so the lm_head
and the float32 logits cover labelled positions only. ``kept_loss_sum`` is then the same sum as
``token_loss_sum`` over the full logits.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from vlft.data.records import IGNORE_INDEX


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``, or nothing when the policy has no autocast."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over label positions, in fp32 at least (fp64 logits stay fp64)."""
    shift_logits = logits[:, :-1, :].to(torch.promote_types(logits.dtype, torch.float32))
    shift_labels = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def kept_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``token_loss_sum`` for logits taken at ``label_positions`` only (``logits [B, P, V]``, ``targets [B, P]``)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def labelled_logits(model, inputs: dict, batch: dict, autocast=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(logits [B, P, V], targets [B, P])``: the logits whose next token is a label, and those labels, from one
    forward of ``model`` under ``autocast``, at the batch's labelled positions (``with_label_positions``); None
    where the batch carries no positions. A model that ignores ``logits_to_keep`` gives every position, shifted
    to the same pairing."""
    if "kept_labels" not in batch:
        return None
    with autocast if autocast is not None else nullcontext():
        logits = model(**inputs, logits_to_keep=batch["logit_positions"]).logits
    kept = batch["kept_labels"]
    if logits.dim() == 4 and logits.shape[:3] == (kept.shape[0], *kept.shape):
        # transformers before 5.2x index ``hidden[:, positions]`` with the [B, P] positions as a whole
        # (every row's positions on every row: [B, B, P, V]); row b's own are on the diagonal. Correct,
        # but the head ran B times as wide: the memory plan's logits figure holds for 5.2x only
        logits = logits[torch.arange(kept.shape[0]), torch.arange(kept.shape[0])]
    if logits.dim() == 3 and logits.shape[:2] == kept.shape:
        return logits, kept
    if logits.shape[1] != batch["labels"].shape[1]:
        raise RuntimeError(
            f"the model returned logits of shape {tuple(logits.shape)} for logits_to_keep of "
            f"shape {tuple(batch['logit_positions'].shape)}"
        )
    return logits[:, :-1], batch["labels"][:, 1:]


def batch_loss_sum(model, inputs: dict, batch: dict, autocast=None) -> torch.Tensor:
    """The batch's summed token loss from ``model``: at the labelled positions only where the batch carries
    them (``with_label_positions``) and the model honours ``logits_to_keep``, else over the full head. The
    forward runs under ``autocast``, the loss after it in fp32."""
    kept = labelled_logits(model, inputs, batch, autocast)
    if kept is not None:
        return kept_loss_sum(*kept)
    with autocast if autocast is not None else nullcontext():
        logits = model(**inputs).logits
    return token_loss_sum(logits, batch["labels"])


def sequence_logps(model, inputs: dict, batch: dict, autocast=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its label tokens (fp32 at least) and its label-token count, both
    ``[rows]``: what preference objectives compare. At the labelled positions only where the batch carries
    them (``with_label_positions``), else over the full head."""
    kept = labelled_logits(model, inputs, batch, autocast)
    if kept is None:
        with autocast if autocast is not None else nullcontext():
            logits = model(**inputs).logits
        kept = logits[:, :-1], batch["labels"][:, 1:]
    logits, targets = kept
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_token = -torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return per_token.view(targets.shape).sum(1), (targets != IGNORE_INDEX).sum(1)
