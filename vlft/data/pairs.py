"""Preference pairs as samples and batches: a chosen and a rejected conversation over one set of images.

``PairEncoder`` wraps the sample encoder: ``encode(record)`` gives ``{"chosen": sample, "rejected": sample}``,
the images processed once and their tensors shared by both; ``measure_labelled(record)`` the longer side (the
length check and the memory plan hold each record as two rows of that length). Everything else (prompts for
generation, the processor, lengths of plain records) is the sample encoder's.

``PairCollator`` lays a batch of B pairs out as 2B rows, the B chosen rows first and then the B rejected rows
in the same order, padded by the plain row collator; the images go in once, under ``shared`` (the step
repeats them, or their vision features, for the two row groups: ``models.rows``), and ``records`` says how
many pairs the batch holds (the host counts them; DPO averages its loss over them).

``UnpairedEncoder`` and ``UnpairedCollator`` do the same for unpaired records (KTO's: one reply, desirable or
not): a batch of B records is their B rows, the images once, ``records`` B, and under ``OWN`` each record's
``desirable`` flag and the B mismatched rows KTO's reference point is estimated on (``kl``: record i's prompt
with record i-1's reply, the first with the last's, as TRL's KTOTrainer cycles completions in a batch; the
prompt ends where the record's labels start).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vlft.contracts.objective import OWN, SHARED
from vlft.data.records import IGNORE_INDEX, Record


class PairEncoder:
    """The sample encoder of a preference run (see the module docstring)."""

    def __init__(self, encoder):
        self.base = encoder

    def __getattr__(self, name):
        return getattr(self.base, name)

    def _rejected(self, record: Record) -> Record:
        return replace(record, turns=record.rejected, rejected=None)

    def measure_labelled(self, record: Record):
        tokens, grids, labelled = self.base.measure_labelled(record)
        other, _, other_labelled = self.base.measure_labelled(self._rejected(record))
        return max(tokens, other), grids, max(labelled, other_labelled)

    def encode(self, record: Record) -> dict:
        chosen, rejected = self.base.encode_conversations(record, [record.turns, record.rejected])
        return {"chosen": chosen, "rejected": rejected}


class PairCollator:
    """B pairs -> 2B rows (chosen, then rejected) and their images once (see the module docstring)."""

    def __init__(self, rows, row_keys: tuple[str, ...] = ("input_ids", "labels")):
        self.rows = rows  # the plain collator: padding, attention mask, token types
        # per-token inputs besides input_ids and labels (a family's 'sequence' batch inputs) are rows' too
        self.row_keys = set(row_keys) | {k for k, how in getattr(rows, "batch_inputs", {}).items() if how == "sequence"}

    def __call__(self, pairs: list[dict]) -> dict:
        chosen = [p["chosen"] for p in pairs]
        rows = [{k: v for k, v in s.items() if k in self.row_keys} for s in chosen + [p["rejected"] for p in pairs]]
        batch = self.rows(rows)
        once = self.rows(chosen)
        batch[SHARED] = {k: v for k, v in once.items() if k not in batch}
        batch["records"] = len(pairs)
        return batch


class UnpairedEncoder:
    """The sample encoder of unpaired preferences (see the module docstring): a record's row, where its prompt
    ends (``split``) and whether its reply is ``desirable``. Its rows are measured as the record's own (a KL row,
    a prompt with another record's reply, is at most the longest prompt plus the longest reply)."""

    def __init__(self, encoder):
        self.base = encoder

    def __getattr__(self, name):
        return getattr(self.base, name)

    def encode(self, record: Record) -> dict:
        sample = self.base.encode(record)
        labelled = (sample["labels"] != IGNORE_INDEX).nonzero()
        return {
            **sample,
            "split": int(labelled[0]) if len(labelled) else len(sample["labels"]),
            "desirable": bool(record.desirable),
        }


class UnpairedCollator:
    """B unpaired records -> their B rows, the images once, and under ``OWN`` the flags and the B KL rows (see
    the module docstring)."""

    def __init__(self, rows, row_keys: tuple[str, ...] = ("input_ids", "labels")):
        self.rows = rows
        self.row_keys = set(row_keys) | {k for k, how in getattr(rows, "batch_inputs", {}).items() if how == "sequence"}

    def __call__(self, samples: list[dict]) -> dict:
        keys = [k for k in samples[0] if k in self.row_keys]
        matched = [{k: s[k] for k in keys} for s in samples]
        kl = [
            {k: torch.cat([s[k][: s["split"]], other[k][other["split"] :]]) for k in keys}
            for s, other in zip(samples, samples[-1:] + samples[:-1])
        ]
        batch = self.rows(matched)
        once = self.rows([{k: v for k, v in s.items() if k not in ("split", "desirable")} for s in samples])
        batch[SHARED] = {k: v for k, v in once.items() if k not in batch}
        batch["records"] = len(samples)
        batch[OWN] = {"desirable": torch.tensor([s["desirable"] for s in samples]), "kl": self.rows(kl)}
        return batch
