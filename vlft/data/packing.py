"""Padding-free packing: a micro-batch's samples laid end to end in rows, each keeping its own positions.

What the model sees, per row: the samples' tokens one after another (never split), then padding up to the
batch's longest row. Nothing else changes:

- **Positions**: each sample's own, from the model family's rope index (``ModelFamily.rope_index``: the 3
  mRoPE rows of ONE sample, exactly as the model would compute them unpacked), plus a text row in front
  (``arange`` per sample) that transformers reads to find where samples start: ``position_ids`` is
  ``[4, rows, L]`` (``[rows, L]`` for a family with plain 1-D positions).
- **Isolation**: no ``attention_mask`` is passed, so transformers 5 finds the samples from the text row:
  for sdpa and eager it builds a block-diagonal causal 4-D mask (``masking_utils.find_packed_sequence_indices``
  then ``packed_sequence_mask_function``), for flash_attention_2 it takes cu_seqlens from the same row
  (varlen; one row only, see ``PackingPlan.one_row``). Padding at a row's end is a sample of its own: it
  sees only itself and nothing sees it.
- **Labels**: each sample's first label is set to ignored. The loss shifts labels by one over the whole row,
  so the last token of one sample would otherwise predict the first token of the next; unpacked, that first
  label is never predicted either (nothing comes before it). The loss and the label count
  (``batching.label_count``) are therefore exactly the padded ones.

The vision tower already runs image by image (grids concatenated along dim 0), so images only need to come
in the order their placeholders appear in the packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from vlft.data.records import IGNORE_INDEX
from vlft.errors import ConfigError

PACKING_MODES = ("auto", "on", "off")


@dataclass
class PackingPlan:
    """Whether a run packs, how the attention keeps samples apart, and why: resolved once at plan time."""

    enabled: bool
    path: str = ""  # "mask" (block-diagonal 4-D mask: sdpa, eager) or "varlen" (flash-attention cu_seqlens)
    max_tokens: int | None = None  # a packed row's budget (None: the micro-batch's samples in one row)
    reason: str = ""

    @property
    def one_row(self) -> bool:
        """varlen finds sample bounds in one row only (transformers checks packing at batch size 1), and its
        cost does not grow with the row, so the micro-batch is a single row there, whatever the budget."""
        return self.path == "varlen" or self.max_tokens is None

    def describe(self) -> dict:
        return {"enabled": self.enabled, "path": self.path, "max_tokens_per_row": self.max_tokens,
                "reason": self.reason}


# measured (bench/test_packing.py, CPU, eager): the mask path's attention covers the whole row, so its cost
# grows with the square of the row's length, and one row per micro-batch gives back more than the padding saves
MASK_ONE_ROW = ("; on the mask path attention runs over the whole row at once (its cost grows with the row's "
                "square): the CPU bench trains at 0.4-0.8x padding's tokens/s with one row per micro-batch, "
                "1.0-1.6x with rows of 2,048 tokens (four runs). Set --max-tokens-per-batch near your longest sample")


# why auto pads on the mask path: no measurement shows a gain there that holds (varlen packs: its cost does not
# grow with the row)
MASK_AUTO = ("the attention keeps packed samples apart only with a block-diagonal mask over the whole row "
             "(sdpa, eager), which the CPU bench measured at 0.4-0.8x padding's tokens/s with one row per "
             "micro-batch and 1.0-1.6x with rows of 2,048 tokens, and which a side-by-side run measured at "
             "1.00-1.04x padding's epoch time under sdpa; --packing on packs anyway (with "
             "--max-tokens-per-batch near your longest sample), --group-by-length pads less at no such cost")


def resolve_packing(mode: str, max_tokens: int | None, attention, family) -> PackingPlan:
    """``--packing auto|on|off`` against what the backend's attention and the model family can do.

    ``auto`` packs where the attention keeps packed samples apart at a cost that does not grow with the row
    (varlen) and the family's text model can; it pads otherwise, saying why (``MASK_AUTO``). ``on`` packs on
    the mask path too; where packing cannot work it is an error with the reason."""
    if mode == "off":
        return PackingPlan(False, reason="off, as asked: batches are padded to their longest sample")
    refusal = getattr(family, "packing_refusal", "") if family is not None else ""
    sequence = sorted(k for k, how in (getattr(family, "batch_inputs", None) or {}).items() if how == "sequence")
    if not refusal and sequence and getattr(family, "processor_expands_placeholders", False):
        # the packed collator lays out input_ids, labels and positions itself; a family's own per-token inputs
        # (Gemma 3's token_type_ids: image tokens attend both ways) would be dropped, changing what it computes
        refusal = (f"its per-token batch inputs ({', '.join(sequence)}) are not carried into packed rows "
                   f"(they would be dropped, changing what the model computes)")
    path, why = attention.packing_path()
    cannot = (f"the {family.name} family cannot pack: {refusal}" if refusal else
              "" if path else f"the text attention cannot keep packed samples apart: {why}")
    if cannot:
        if mode == "on":
            raise ConfigError(f"--packing on: {cannot}; use --packing auto or off (padded batches)")
        return PackingPlan(False, reason=f"auto: padded, since {cannot}")
    if mode == "auto" and path == "mask":
        return PackingPlan(False, reason=f"auto: padded, since {MASK_AUTO}")
    budget = (f"rows of at most {max_tokens} tokens" if max_tokens and path != "varlen"
              else "one row per micro-batch")
    if path == "mask" and not max_tokens:
        budget += MASK_ONE_ROW
    asked = "as asked" if mode == "on" else "auto"
    return PackingPlan(True, path, max_tokens, f"{asked}: {path} ({why}); {budget}")


def pack_rows(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``max_tokens`` tokens (first fit, longest first;
    ties in input order). A sample longer than the budget gets a row of its own: samples are never split.
    ``max_tokens`` None: one row."""
    if max_tokens is None:
        return [list(range(len(lengths)))]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(r) for r in rows]


def packed_shape(lengths: list[int], plan: PackingPlan) -> tuple[int, int]:
    """(rows, tokens per row) of the packed micro-batch whose samples have ``lengths``."""
    rows = [list(range(len(lengths)))] if plan.one_row else pack_rows(lengths, plan.max_tokens)
    return len(rows), max(sum(lengths[i] for i in r) for r in rows)


def sample_positions(sample: dict, rope_index: Callable[..., Any] | None, model_config) -> torch.Tensor:
    """One sample's positions: ``[4, L]`` (text row, then the family's 3 mRoPE rows), or ``[1, L]`` for a
    family with plain 1-D positions."""
    ids = sample["input_ids"]
    text = torch.arange(len(ids), dtype=torch.long).unsqueeze(0)
    if rope_index is None:
        return text
    rope = rope_index(model_config, ids, image_grid_thw=sample.get("image_grid_thw"),
                      video_grid_thw=sample.get("video_grid_thw"),
                      second_per_grid_ts=sample.get("second_per_grid_ts"))
    return torch.cat([text, rope.reshape(3, -1).to(torch.long)])


CONCAT_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


class PackingCollator:
    """Packs a micro-batch's samples into rows (see the module docstring); a drop-in for ``batching.Collator``
    in training and the validation loss (generation keeps the padding collator).

    ``rope_index`` and ``model_config`` are the family's rope-index function and the model config, resolved
    once at plan time; positions are built here, in the data stage (a DataLoader worker, where there is
    one), not in the training step."""

    def __init__(self, pad_token_id: int, image_token_id: int, plan: PackingPlan, rope_index, model_config,
                 video_token_id: int | None = None):
        self.pad_token_id, self.image_token_id, self.video_token_id = pad_token_id, image_token_id, video_token_id
        self.plan, self.rope_index, self.model_config = plan, rope_index, model_config

    def __call__(self, samples: list[dict]) -> dict:
        lengths = [len(s["input_ids"]) for s in samples]
        rows = [list(range(len(samples)))] if self.plan.one_row else pack_rows(lengths, self.plan.max_tokens)
        width = max(sum(lengths[i] for i in r) for r in rows)
        n_rows = 1 if self.rope_index is None else 4
        ids_rows, label_rows, pos_rows = [], [], []
        for row in rows:
            ids, labels, pos = [], [], []
            for i in row:
                s = samples[i]
                ids.append(s["input_ids"].long())
                if "labels" in s:
                    lab = s["labels"].clone().long()
                    lab[0] = IGNORE_INDEX  # the previous sample's last token must not predict it (module doc)
                    labels.append(lab)
                pos.append(sample_positions(s, self.rope_index, self.model_config))
            pad = width - sum(lengths[i] for i in row)
            ids.append(torch.full((pad,), self.pad_token_id, dtype=torch.long))
            labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
            pos.append(torch.arange(pad, dtype=torch.long).expand(n_rows, pad))  # padding: a sample of its own
            ids_rows.append(torch.cat(ids))
            label_rows.append(torch.cat(labels))
            pos_rows.append(torch.cat(pos, dim=1))
        input_ids = torch.stack(ids_rows)
        mm = (input_ids == self.image_token_id).long()
        if self.video_token_id is not None:
            mm = mm + 2 * (input_ids == self.video_token_id).long()
        positions = torch.stack(pos_rows, dim=1)  # [4, rows, L]
        batch = {"input_ids": input_ids, "position_ids": positions[0] if n_rows == 1 else positions,
                 "mm_token_type_ids": mm, "sample_lengths": torch.tensor(lengths)}
        if any("labels" in s for s in samples):
            batch["labels"] = torch.stack(label_rows)
        order = [samples[i] for row in rows for i in row]  # images in the order their tokens appear
        for key in CONCAT_KEYS:
            parts = [s[key] for s in order if key in s]
            if parts:
                batch[key] = torch.cat(parts)
        return batch
