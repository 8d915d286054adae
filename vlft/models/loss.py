"""The training loss: next-token cross-entropy summed over label tokens, and the autocast it runs under.
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
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
