"""Sample lengths (image tokens included) for the whole data set: ``--max-length``, ``--skip-too-long`` and
the longest records the memory plan must hold.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field

from vlft.data.encoding import SampleEncoder
from vlft.data.lazy import take
from vlft.data.records import MAX_REPORTED_PROBLEMS, Record
from vlft.errors import DataError


@dataclass
class LengthReport:
    """Sample lengths in tokens (image tokens included), found when the data is checked."""

    lengths: MutableSequence[int]  # a list, or compact_report's int array
    grids: list[list[tuple[int, int, int]]] | PackedGrids
    skipped: list[dict] = field(default_factory=list)  # {"where", "length"} of samples over --max-length
    labelled: MutableSequence[int] = field(
        default_factory=list
    )  # label tokens per sample: the positions the head runs at

    def describe(self, limit: int | None) -> dict:
        ordered = sorted(self.lengths)
        return {
            "max_length": limit,
            "samples": len(ordered),
            "longest": ordered[-1] if ordered else 0,
            "median": ordered[len(ordered) // 2] if ordered else 0,
            "skipped": len(self.skipped),
            "skipped_samples": self.skipped,
        }


class PackedGrids(Sequence):
    """Each sample's grids as ``LengthReport.grids`` lists them, held as two int arrays (where each sample's
    grids start; the grids' t, h, w in a row) instead of a list of tuples per sample."""

    def __init__(self):
        self.starts, self.flat = array("q", [0]), array("i")

    def append(self, grids: list[tuple[int, int, int]]) -> None:
        for grid in grids:
            self.flat.extend(grid)
        self.starts.append(len(self.flat) // 3)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> list[tuple[int, int, int]]:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        a, b = self.starts[index], self.starts[index + 1]
        return [(self.flat[3 * k], self.flat[3 * k + 1], self.flat[3 * k + 2]) for k in range(a, b)]


def compact_report() -> LengthReport:
    """A report whose per-sample figures are int arrays (a few tens of bytes a sample, not Python objects)."""
    return LengthReport(array("q"), PackedGrids(), labelled=array("q"))


PARALLEL_FROM = 2_000  # records: below this, starting workers costs more than it saves
_WORKER_ENCODER: list = []  # the encoder a forked worker inherited


def check_workers() -> int:
    """Processes that measure records in parallel: the usable cores, at most 8 (``VLFT_CHECK_WORKERS``)."""
    wanted = os.environ.get("VLFT_CHECK_WORKERS")
    if wanted:
        return max(1, int(wanted))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _start_worker() -> None:
    """A forked worker computes on one thread. The parent's OpenMP threads do not survive the fork, yet the
    child's libgomp still counts them as its team: the first torch op large enough to fan out (resizing a
    448x448 image is) then waits for them forever. A parent that ran a training step, or any op as large,
    before the data check had that team (the bench's preflight hung so; tests/test_speed.py)."""
    import torch  # loaded by the parent already: the fork shares it

    torch.set_num_threads(1)


def _measured(encoder: SampleEncoder, record: Record):
    """``encoder.measure_labelled(record)``, or the ``DataError`` it raised (reported with the others)."""
    try:
        return encoder.measure_labelled(record)
    except DataError as e:
        return e


def _measure_chunk(chunk: Sequence[Record]) -> list:
    return [_measured(_WORKER_ENCODER[0], rec) for rec in chunk]


def measure_all(records: Sequence[Record], encoder: SampleEncoder, progress=None, workers: int | None = None) -> list:
    """``encoder.measure_labelled`` of every record, in order: ``(tokens, grids, labelled)`` or the
    ``DataError`` it raised. Long sets are measured by forked worker processes (each renders its share of the
    chat templates); ``progress(n)`` is called as records are done."""
    return list(iter_measured(records, encoder, progress, workers))


def iter_measured(records: Sequence[Record], encoder: SampleEncoder, progress=None, workers: int | None = None):
    """``measure_all``'s results as they come: a run's check keeps only their figures, never the list of
    them (a million tuples would outlive the check in the allocator's arenas)."""
    import multiprocessing  # only for long sets

    workers = check_workers() if workers is None else workers
    tick = progress or (lambda n: None)
    if workers <= 1 or len(records) < PARALLEL_FROM or "fork" not in multiprocessing.get_all_start_methods():
        for rec in records:
            yield _measured(encoder, rec)
            tick(1)
        return
    size = max(64, len(records) // (workers * 8))
    chunks = [records[i : i + size] for i in range(0, len(records), size)]
    _WORKER_ENCODER[:] = [encoder]
    # forked workers inherit the encoder (processor, tokenizer) instead of loading it again
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker) as pool:
            for part in pool.imap(_measure_chunk, chunks):
                tick(len(part))
                yield from part
    finally:
        _WORKER_ENCODER.clear()


def check_lengths(
    records: Sequence[Record],
    encoder: SampleEncoder,
    max_length: int | None,
    skip: bool,
    what: str = "data",
    progress=None,
) -> tuple[Sequence[Record], LengthReport]:
    """Measure every record; over ``max_length`` is an error naming each one, or with ``skip`` is dropped.

    Samples are never truncated: a cut could fall inside an image's tokens, which the model cannot read.
    """
    kept = array("q")  # indices of the samples kept (no Python int per sample)
    report = LengthReport([], []) if isinstance(records, list) else compact_report()  # lazy rows: arrays
    too_long: list[tuple[str, int]] = []
    for i, measured in enumerate(iter_measured(records, encoder, progress)):
        if isinstance(measured, Exception):
            raise measured
        n, grids, labelled = measured
        if max_length is not None and n > max_length:
            too_long.append((records[i].where, n))
            continue
        kept.append(i)
        report.lengths.append(n)
        report.grids.append(grids)
        report.labelled.append(labelled)
    if too_long and not skip:
        shown = "\n  ".join(f"{where}: {n} tokens" for where, n in too_long[:MAX_REPORTED_PROBLEMS])
        more = len(too_long) - MAX_REPORTED_PROBLEMS
        raise DataError(
            f"{len(too_long)} sample(s) in the {what} are longer than --max-length {max_length} (image tokens "
            f"included):\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + "\nRaise --max-length, lower --max-pixels (fewer image tokens), or pass --skip-too-long to leave "
            "them out (they are counted and listed in the summary); nothing was written."
        )
    report.skipped = [{"where": where, "length": n} for where, n in too_long]
    if not kept:
        raise DataError(f"every sample in the {what} is longer than --max-length {max_length}; nothing to train on")
    return take(records, kept), report
