"""From encoded samples to batches: padding to the batch's own longest sample, and batch helpers
(label counts on the host, moving to the device, the model's inputs).
"""

from __future__ import annotations

import torch

from vlft.contracts.objective import OWN
from vlft.data.records import IGNORE_INDEX

# the joins of a family's per-image inputs (``ImageInputs.batch_inputs``), beside 'sequence' (one value per token)
IMAGE_JOINS = ("concat", "concat_padded", "concat_last")


class Collator:
    """Pads a batch to its own longest sample and joins the samples' other model inputs as the family
    declares them (``ImageInputs.batch_inputs``): 'sequence' inputs padded like input_ids (with 0), 'concat'
    inputs joined along dim 0 over the samples that have them ('concat_padded' ones padded with 0 to the
    largest in their other dims first; 'concat_last' ones along their last dim).

    ``padding_side`` is "right" for training and "left" for generation.
    """

    def __init__(
        self,
        pad_token_id: int,
        batch_inputs: dict | None = None,
        padding_side: str = "right",
        pad_to: int | None = None,
    ):
        self.pad_token_id = pad_token_id
        self.batch_inputs = dict(batch_inputs or {})
        self.padding_side = padding_side
        self.pad_to = pad_to  # fixed length, only for comparisons in bench/

    def __call__(self, samples: list[dict]) -> dict:
        longest = max(len(s["input_ids"]) for s in samples)
        length = max(longest, self.pad_to or 0)
        batch_ids, batch_mask, batch_labels = [], [], []
        for s in samples:
            ids = s["input_ids"]
            pad = length - len(ids)
            fill_ids = torch.full((pad,), self.pad_token_id, dtype=ids.dtype)
            ones, zeros = torch.ones(len(ids), dtype=torch.long), torch.zeros(pad, dtype=torch.long)
            left = self.padding_side == "left"
            batch_ids.append(torch.cat([fill_ids, ids] if left else [ids, fill_ids]))
            batch_mask.append(torch.cat([zeros, ones] if left else [ones, zeros]))
            if "labels" in s:
                fill_labels = torch.full((pad,), IGNORE_INDEX, dtype=torch.long)
                lab = s["labels"]
                batch_labels.append(torch.cat([fill_labels, lab] if left else [lab, fill_labels]))
        batch = {"input_ids": torch.stack(batch_ids), "attention_mask": torch.stack(batch_mask)}
        if batch_labels:
            batch["labels"] = torch.stack(batch_labels)
        return self._declared_inputs(samples, length, batch)

    def _declared_inputs(self, samples: list[dict], length: int, batch: dict) -> dict:
        """The family's ``batch_inputs``: 'sequence' keys padded like input_ids (with 0), 'concat' keys joined
        along dim 0 over the samples that have them."""
        left = self.padding_side == "left"
        for key, how in self.batch_inputs.items():
            have = [s for s in samples if key in s]
            if not have:
                continue
            if how == "sequence":
                rows = []
                for s in samples:
                    row = s.get(key, torch.zeros(len(s["input_ids"]), dtype=torch.long))
                    fill = torch.zeros(length - len(row), dtype=row.dtype)
                    rows.append(torch.cat([fill, row] if left else [row, fill]))
                batch[key] = torch.stack(rows)
            elif how in IMAGE_JOINS:
                batch[key] = join_images([s[key] for s in have], how)
            else:
                raise ValueError(f"batch_inputs[{key!r}] is {how!r}: 'sequence' or one of {IMAGE_JOINS}")
        return batch


def join_images(parts: list[torch.Tensor], how: str) -> torch.Tensor:
    """The samples' tensors of one 'concat', 'concat_padded' or 'concat_last' input (``ImageInputs.batch_inputs``)
    joined along dim 0; 'concat_padded' first pads each with 0 at the end of its other dims to the largest among
    them (a per-image count of tiles that differs by image, the model reading only each image's own);
    'concat_last' joins along the last dim instead (NaViT-packed patches ``[1, C, p, patches]``: one row of every
    image's patches, which the model cuts by the image sizes joined beside it)."""
    if how == "concat_last":
        return torch.cat(parts, dim=-1)
    if how == "concat_padded" and len(parts) > 1:
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for p in parts:
            grow = [0] * (2 * (p.dim() - 1))  # F.pad's order: the last dim first, (before, after) each
            for d, size in enumerate(shape, start=1):
                grow[2 * (p.dim() - 1 - d) + 1] = size - p.shape[d]
            padded.append(torch.nn.functional.pad(p, grow) if any(grow) else p)
        parts = padded
    return torch.cat(parts)


def collator_for(processor, family, padding_side: str = "right", pad_to: int | None = None) -> Collator:
    """The batch builder for ``processor``'s samples, joining the inputs ``family``'s image inputs declare."""
    joins = family.image_inputs.batch_inputs if family.image_inputs is not None else {}
    return Collator(processor.tokenizer.pad_token_id, joins, padding_side=padding_side, pad_to=pad_to)


def label_count(batch: dict) -> int:
    """Label tokens that count in the loss (host-side: no device sync)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def label_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, targets), both ``[B, P]`` long, from host labels ``[B, L]``: the positions t whose logit
    predicts a label (``labels[:, t + 1]`` is not ignored), ``P`` the most any row has (at least 1); rows with
    fewer are filled with positions whose target is ``IGNORE_INDEX``. Host-side: no device sync."""
    following = labels[:, 1:]
    keep = following != IGNORE_INDEX
    width = max(int(keep.sum(1).max()) if keep.numel() else 0, 1)
    # a stable sort puts each row's labelled positions first, in order; the rest point at ignored targets
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    if order.size(1) < width:  # a batch of length 1: no position predicts anything
        order = torch.zeros(labels.size(0), width, dtype=torch.long)
        return order, torch.full_like(order, IGNORE_INDEX)
    return order, torch.gather(following, 1, order)


def with_label_positions(batch: dict) -> dict:
    """``batch`` (on the host) with the positions whose logits the loss needs (``logit_positions``) and their
    targets (``kept_labels``): the step asks the model for those logits only (``models.loss``)."""
    positions, targets = label_positions(batch["labels"])
    return {**batch, "logit_positions": positions, "kept_labels": targets}


def batch_counts(batch: dict) -> tuple[int, int]:
    """(samples, real token positions) of a host batch, without a device sync: a padded batch's rows and its
    attention mask's ones; a packed batch's (``data.packing``) rows hold several samples, so it carries their
    lengths (``sample_lengths``) and the padding at its rows' ends counts as no sample."""
    if "sample_lengths" in batch:
        lengths = batch["sample_lengths"]
        return len(lengths), int(lengths.sum())
    if "records" in batch:  # rows of several sequences per record (``data.pairs``): the records count
        return int(batch["records"]), int(batch["attention_mask"].sum())
    return len(batch["input_ids"]), int(batch["attention_mask"].sum())


def to_device(batch: dict, device: torch.device, non_blocking: bool = False) -> dict:
    """The batch's tensors on ``device`` (those of a nested dict too: ``data.pairs``' shared inputs), less what
    only the host reads (``HOST_KEYS``)."""
    return {
        k: to_device(v, device, non_blocking) if isinstance(v, dict) else v.to(device, non_blocking=non_blocking)
        for k, v in batch.items()
        if k not in HOST_KEYS
    }


def model_inputs(batch: dict) -> dict:
    """The model's keyword arguments for a training or loss forward (not what only the loss reads).
    ``use_cache=False``: nothing reads a KV cache there, and with one transformers 5 ignores the packed text
    position row (``data.packing``: its packed-sample detection only runs when there is no cache)."""
    return {**{k: v for k, v in batch.items() if k not in LOSS_KEYS + HOST_KEYS}, "use_cache": False}


# what the loss reads, not the model (``OWN``: what only an objective's loss reads, KTO's flags and KL rows)
LOSS_KEYS = ("labels", "logit_positions", "kept_labels", OWN)
# what the loop counts on the host (``batch_counts``), never moved to a device
# (a prompt batch's reference answers and their records' places: GRPO's rewards read them on the host)
HOST_KEYS = ("sample_lengths", "records", "references", "where")
