"""Padding-free packing: a micro-batch's samples laid end to end in rows, each keeping its own positions.

What the model sees, per row: the samples' tokens one after another (never split), then padding up to the
batch's longest row. Nothing else changes:

- **Positions**: each sample's own, from the model family's rope index (``Positions.rope_index``: the 3
  mRoPE rows of ONE sample, exactly as the model would compute them unpacked), plus a text row in front
  (``arange`` per sample) that transformers reads to find where samples start: ``position_ids`` is
  ``[4, rows, L]`` (``[rows, L]`` for a family with plain 1-D positions).
- **Isolation**: no ``attention_mask`` is passed; the attention finds the samples where the text row
  restarts. flash_attention_2 takes cu_seqlens from it (``varlen``); on sdpa and eager the text tower is
  loaded with its per-segment twin (``models.segments``: ``segments``), which attends sample by sample.
  Either way the cost is the samples' squares, not the row's, so a micro-batch is one row: no padding.
- **Labels**: each sample's first label is set to ignored. The loss shifts labels by one over the whole row,
  so the last token of one sample would otherwise predict the first token of the next; unpacked, that first
  label is never predicted either (nothing comes before it). The loss and the label count
  (``batching.label_count``) are therefore exactly the padded ones.

- **The family's inputs**: as it declares them (``ImageInputs.batch_inputs``): 'sequence' ones (one value per
  token) laid end to end like input_ids, the others (pixels, grids) joined as a batch joins them, in sample order.
  The vision tower already runs image by image, so images only need to come in the order their placeholders
  appear in the packed rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlft.data.batching import IMAGE_JOINS, join_images
from vlft.data.records import IGNORE_INDEX
from vlft.errors import ConfigError, call_plugin

PACKING_MODES = ("auto", "on", "off")


@dataclass
class PackingPlan:
    """Whether a run packs, how the attention keeps samples apart, and why: resolved once at plan time."""

    enabled: bool
    path: str = ""  # "varlen" (flash-attention cu_seqlens) or "segments" (sdpa/eager per sample)
    reason: str = ""

    def describe(self) -> dict:
        return {"enabled": self.enabled, "path": self.path, "reason": self.reason}


def resolve_packing(mode: str, attention, family) -> PackingPlan:
    """``--packing auto|on|off`` against what the backend's attention and the model family can do.

    Both paths keep packed samples apart at the samples' own cost (varlen on flash-attention, segments on
    sdpa and eager), so ``auto`` and ``on`` pack wherever the attention and the family can; ``auto`` pads
    otherwise, saying why, and ``on`` stops with the reason."""
    if mode == "off":
        return PackingPlan(False, reason="off, as asked: batches are padded to their longest sample")
    if family is None or family.packing is None:
        refusal = "it declares no packing capability (ModelFamily.packing)" if family is not None else ""
    else:
        refusal = family.packing.refusal
    path, why = attention.packing_path()
    cannot = (
        f"the {family.name} family cannot pack: {refusal}"
        if refusal and family
        else ""
        if path
        else f"the text attention cannot keep packed samples apart: {why}"
    )
    if cannot:
        if mode == "on":
            raise ConfigError(f"--packing on: {cannot}; use --packing auto or off (padded batches)")
        return PackingPlan(False, reason=f"auto: padded, since {cannot}")
    asked = "as asked" if mode == "on" else "auto"
    return PackingPlan(True, path, f"{asked}: {path} ({why}); one row per micro-batch, no padding")


# measured (bench/test_packing.py: real runs, the CPU, eager, one epoch of variable-length data, a quiet
# AMD EPYC, 2 cores: 1.33x padding's real tokens/s against a ceiling of 1.55): packed runs reach this share of
# the padding-free ceiling (padded positions / real positions), the rest being the per-sample attention calls
# and the row's bookkeeping
CEILING_SHARE = 0.86


def padding_ratio(lengths: Sequence[int], micro_batches: list[list[int]]) -> float:
    """Positions padded micro-batches compute per real token: sum(samples x longest) / sum(lengths)."""
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches if mb) / max(real, 1)


def settle_auto(plan: PackingPlan, mode: str, ratio: float) -> PackingPlan:
    """``--packing auto`` once the data's lengths are known: pack only where the run's micro-batches pad
    enough that packing's measured share of the ceiling (``CEILING_SHARE``) still gains, pad otherwise."""
    if mode != "auto" or not plan.enabled:
        return plan
    gain = ratio * CEILING_SHARE
    if gain <= 1:
        return PackingPlan(
            False,
            reason=f"auto: padded, since this run's micro-batches compute {ratio:.2f} "
            f"positions per real token and packing was measured at "
            f"{CEILING_SHARE:.2f} of that ceiling ({gain:.2f}x padding's speed); "
            f"--packing on packs anyway",
        )
    return dataclasses.replace(
        plan,
        reason=f"{plan.reason}; padded micro-batches would compute {ratio:.2f} "
        f"positions per real token (expected {gain:.2f}x padding's speed)",
    )


def sample_positions(sample: dict, positions, model_config, owner: str = "") -> torch.Tensor:
    """One sample's positions: ``[1 + rows, L]`` (text row, then the family's rows, e.g. 3 mRoPE rows), or
    ``[1, L]`` for a family with plain 1-D positions (``positions`` None). An error inside the family's
    ``rope_index`` is raised as a PluginError naming ``owner`` (the family and its plugin, ``ModelFamily.label``)."""
    ids = sample["input_ids"]
    text = torch.arange(len(ids), dtype=torch.long).unsqueeze(0)
    if positions is None:
        return text
    rope = call_plugin(owner or "the model family", "positions.rope_index", positions.rope_index, model_config, sample)
    return torch.cat([text, rope.reshape(positions.rows, -1).to(torch.long)])


class PackingCollator:
    """Packs a micro-batch's samples into rows (see the module docstring); a drop-in for ``batching.Collator``
    in training and the validation loss (generation keeps the padding collator).

    ``positions`` (the family's ``Positions``, or None) and ``model_config`` are resolved once at plan time;
    positions are built here, in the data stage (a DataLoader worker, where there is one), not in the
    training step. ``batch_inputs`` is how the family's inputs join (``ImageInputs.batch_inputs``)."""

    def __init__(self, plan: PackingPlan, positions, model_config, batch_inputs: dict | None = None, owner: str = ""):
        self.plan, self.positions, self.model_config = plan, positions, model_config
        self.batch_inputs = dict(batch_inputs or {})
        self.owner = owner  # how errors name the family (a string: the collator goes to DataLoader workers)

    def __call__(self, samples: list[dict]) -> dict:
        # one row, no padding: both paths attend sample by sample (module docstring)
        ids, labels, pos = [], [], []
        for s in samples:
            ids.append(s["input_ids"].long())
            if "labels" in s:
                lab = s["labels"].clone().long()
                lab[0] = IGNORE_INDEX  # the previous sample's last token must not predict it (module doc)
                labels.append(lab)
            pos.append(sample_positions(s, self.positions, self.model_config, self.owner))
        input_ids = torch.cat(ids)[None]
        positions = torch.cat(pos, dim=1)[:, None]  # [4, 1, L] (or [1, 1, L]: plain positions)
        batch = {"input_ids": input_ids, "position_ids": positions[0] if self.positions is None else positions}
        for key, how in self.batch_inputs.items():
            if how == "sequence":  # one value per token: laid end to end like input_ids (0 where a sample has none)
                batch[key] = torch.cat(
                    [s[key] if key in s else torch.zeros(len(s["input_ids"]), dtype=torch.long) for s in samples]
                )[None]
        batch["sample_lengths"] = torch.tensor([len(i) for i in ids])
        if labels:
            batch["labels"] = torch.cat(labels)[None]
        for key, how in self.batch_inputs.items():  # images in the order their tokens appear
            parts = [s[key] for s in samples if key in s]
            if how in IMAGE_JOINS and parts:
                batch[key] = join_images(parts, how)
        return batch
