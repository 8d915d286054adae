"""Sample lengths (image tokens included) for the whole data set: ``--max-length``, ``--skip-too-long`` and
the longest records the memory plan must hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlft.data.encoding import SampleEncoder
from vlft.data.records import MAX_REPORTED_PROBLEMS, Record
from vlft.errors import DataError


@dataclass
class LengthReport:
    """Sample lengths in tokens (image tokens included), found when the data is checked."""

    lengths: list[int]
    grids: list[list[tuple[int, int, int]]]
    skipped: list[dict] = field(default_factory=list)  # {"where", "length"} of samples over --max-length
    labelled: list[int] = field(default_factory=list)  # label tokens per sample: the positions the head runs at

    def describe(self, limit: int | None) -> dict:
        ordered = sorted(self.lengths)
        return {
            "max_length": limit, "samples": len(ordered), "longest": ordered[-1] if ordered else 0,
            "median": ordered[len(ordered) // 2] if ordered else 0, "skipped": len(self.skipped),
            "skipped_samples": self.skipped,
        }


def check_lengths(records: list[Record], encoder: SampleEncoder, max_length: int | None, skip: bool,
                  what: str = "data") -> tuple[list[Record], LengthReport]:
    """Measure every record; over ``max_length`` is an error naming each one, or with ``skip`` is dropped.

    Samples are never truncated: a cut could fall inside an image's tokens, which the model cannot read.
    """
    kept: list[Record] = []
    report = LengthReport([], [])
    too_long: list[tuple[str, int]] = []
    for rec in records:
        n, grids, labelled = encoder.measure_labelled(rec)
        if max_length is not None and n > max_length:
            too_long.append((rec.where, n))
            continue
        kept.append(rec)
        report.lengths.append(n)
        report.grids.append(grids)
        report.labelled.append(labelled)
    if too_long and not skip:
        shown = "\n  ".join(f"{where}: {n} tokens" for where, n in too_long[:MAX_REPORTED_PROBLEMS])
        more = len(too_long) - MAX_REPORTED_PROBLEMS
        raise DataError(
            f"{len(too_long)} sample(s) in the {what} are longer than --max-length {max_length} (image tokens "
            f"included):\n  {shown}" + (f"\n  ... and {more} more" if more > 0 else "")
            + "\nRaise --max-length, lower --max-pixels (fewer image tokens), or pass --skip-too-long to leave "
              "them out (they are counted and listed in the summary); nothing was written."
        )
    report.skipped = [{"where": where, "length": n} for where, n in too_long]
    if not kept:
        raise DataError(f"every sample in the {what} is longer than --max-length {max_length}; nothing to train on")
    return kept, report
