"""Preference pairs as samples and batches: a chosen and a rejected conversation over one set of images.

``PairEncoder`` wraps the sample encoder: ``encode(record)`` gives ``{"chosen": sample, "rejected": sample}``,
the images processed once and their tensors shared by both; ``measure_labelled(record)`` the longer side (the
length check and the memory plan hold each record as two rows of that length). Everything else (prompts for
generation, the processor, lengths of plain records) is the sample encoder's.

``PairCollator`` lays a batch of B pairs out as 2B rows, the B chosen rows first and then the B rejected rows
in the same order, padded by the plain row collator; the images go in once, under ``shared`` (the step
repeats them, or their vision features, for the two row groups: ``models.rows``), and ``records`` says how
many pairs the batch holds (the host counts them; DPO averages its loss over them).
"""

from __future__ import annotations

from dataclasses import replace

from vlft.data.records import Record

SHARED = "shared"  # the batch's inputs given once for every group of rows (a pair batch's images)


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
        self.row_keys = set(row_keys) | {k for k, how in getattr(rows, "batch_inputs", {}).items()
                                         if how == "sequence"}

    def __call__(self, pairs: list[dict]) -> dict:
        chosen = [p["chosen"] for p in pairs]
        rows = [{k: v for k, v in s.items() if k in self.row_keys}
                for s in chosen + [p["rejected"] for p in pairs]]
        batch = self.rows(rows)
        once = self.rows(chosen)
        batch[SHARED] = {k: v for k, v in once.items() if k not in batch}
        batch["records"] = len(pairs)
        return batch
