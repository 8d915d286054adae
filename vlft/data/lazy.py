"""Columnar records held as rows, not objects: what a run keeps of a Parquet / Arrow / ``datasets`` set.

A checked JSON record is a ``Record`` in a list (the file was read whole anyway). A columnar set can hold a
million rows, and a ``Record`` costs about 3 KB of Python objects, so a run keeps of each checked row only its
place: the file (an int32 into the set's file list) and the row (an int64). ``ColumnarRecords`` is a
``Sequence`` over those places: ``records[i]`` reads row i again through pyarrow (its row group kept, see
``columnar.read_rows``) and builds its ``Record`` when the sample is encoded; ``records[idx]`` with a slice or
a list of indices is another such sequence, sharing the file list. It pickles as its arrays, so the checked
-data cache and DataLoader workers carry 12 bytes per record.

``take`` / ``concat`` / ``weighted`` are the list operations the run's planning needs (held-out split,
weighted mixing, skipping samples over --max-length), the same on a list (JSON sets: unchanged behaviour)
and on ``ColumnarRecords``.
"""

from __future__ import annotations

import os
import random
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vlft.data.columnar import close, data_files, file_format
from vlft.data.records import Record, read_records_collecting, record_at, records_at


class ColumnarRecords(Sequence):
    """Checked rows of columnar files as (file, row) places; ``records[i]`` is the row's ``Record``."""

    def __init__(
        self,
        files: list[tuple[str, str]],
        reading: dict,
        file_of: np.ndarray,
        rows: np.ndarray,
        media: dict[str, tuple[int, int]],
        modalities: frozenset,
    ):
        self.files = files  # (absolute path, label as locations name it)
        self.reading = reading  # record_at's image_root, add_placeholders, columns, parse
        self.file_of, self.rows = file_of, rows
        self.media = media  # image / video files the rows name by path, as checked: (size, mtime_ns)
        self.modalities = modalities  # "image" / "video" where some row has them

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        if isinstance(index, (list, range, np.ndarray)):
            return self.take(index)
        index = int(index)
        if not -len(self) <= index < len(self):  # Sequence's __iter__ stops at IndexError
            raise IndexError(index)
        path, label = self.files[self.file_of[index]]
        return record_at(Path(path), int(self.rows[index]), label, **self.reading)

    def __iter__(self):
        """The records in order, read a run of rows of one file at a time (``records_at``: a row group's rows
        converted together, each distinct image's size read once): how a check's workers measure their share."""
        n, run = len(self), 1024
        start = 0
        while start < n:
            f = self.file_of[start]
            end = start + 1
            while end < n and end - start < run and self.file_of[end] == f:
                end += 1
            path, label = self.files[f]
            yield from records_at(Path(path), self.rows[start:end], label, **self.reading)
            start = end

    def take(self, indices) -> ColumnarRecords:
        idx = np.asarray(indices, dtype=np.int64)
        return ColumnarRecords(self.files, self.reading, self.file_of[idx], self.rows[idx], self.media, self.modalities)

    @staticmethod
    def concat(parts: list[ColumnarRecords]) -> ColumnarRecords:
        """The parts one after the other (their file lists merged)."""
        files: list[tuple[str, str]] = []
        where: dict[tuple[str, str], int] = {}
        file_of = []
        for part in parts:
            remap = np.array([where.setdefault(f, len(where)) for f in part.files] or [0], dtype=np.int32)
            file_of.append(remap[part.file_of])
        files = sorted(where, key=lambda f: where[f])
        media = {k: v for part in parts for k, v in part.media.items()}
        return ColumnarRecords(
            files,
            parts[0].reading if parts else {},
            np.concatenate(file_of) if file_of else np.zeros(0, np.int32),
            np.concatenate([p.rows for p in parts]) if parts else np.zeros(0, np.int64),
            media,
            frozenset().union(*(p.modalities for p in parts)),
        )


class _KeptRows:
    """``read_records_collecting``'s ``keep``: notes each valid row's place and media, keeps no Record."""

    def __init__(self, files: list[Path], label_of):
        self.index = {str(f): k for k, f in enumerate(files)}
        self.files = [(str(f.resolve()), label_of(f)) for f in files]
        self.file_of, self.rows = array("i"), array("q")  # grown without a Python object per row
        self.media: dict[str, tuple[int, int]] = {}
        self.modalities: set[str] = set()

    def keep(self, file: Path, row: int, record: Record) -> bool:
        self.file_of.append(self.index[str(file)])
        self.rows.append(row)
        for source in [*record.images, *record.videos]:
            if isinstance(source, str) and source not in self.media:
                st = os.stat(source)
                self.media[source] = (st.st_size, st.st_mtime_ns)
        if record.images:
            self.modalities.add("image")
        if record.videos:
            self.modalities.add("video")
        return False

    def records(self, reading: dict) -> ColumnarRecords:
        return ColumnarRecords(
            self.files,
            reading,
            np.frombuffer(self.file_of, dtype=np.int32).copy(),
            np.frombuffer(self.rows, dtype=np.int64).copy(),
            self.media,
            frozenset(self.modalities),
        )


def read_compact(
    path: str | Path, image_root=None, add_placeholders: bool = False, columns: dict | None = None, parse=None
):
    """``read_records_collecting`` for a run: a set made only of columnar files comes back as
    ``ColumnarRecords`` (every row checked as before, only the valid rows' places kept); others as the list."""
    path = Path(path)
    files = data_files(path)
    if not all(file_format(f) is not None for f in files):
        return read_records_collecting(
            path, image_root=image_root, add_placeholders=add_placeholders, columns=columns, parse=parse
        )
    kept = _KeptRows(files, lambda f: f"{path.name}/{f.name}" if path.is_dir() else f.name)
    _, problems = read_records_collecting(
        path, image_root=image_root, add_placeholders=add_placeholders, columns=columns, keep=kept.keep, parse=parse
    )
    close(files)  # the run keeps places, not the files' pages the check read
    reading = {"image_root": image_root, "add_placeholders": add_placeholders, "columns": columns, "parse": parse}
    return kept.records(reading), problems


def take(records: Sequence, indices) -> Sequence:
    """The records at ``indices``, in that order (a list stays a list)."""
    if isinstance(records, ColumnarRecords):
        return records.take(indices)
    return [records[i] for i in indices]


def concat(parts: list[Sequence]) -> Sequence:
    """The parts one after the other: a list of lists is a list, columnar parts stay places (a run mixing
    JSON and columnar files holds the columnar rows as Records: the rare case pays the objects)."""
    columnar = [p for p in parts if isinstance(p, ColumnarRecords)]
    if parts and len(columnar) == len(parts):
        return ColumnarRecords.concat(columnar)
    return [r for p in parts for r in p]


def weighted(records: Sequence, weight: float, seed: int) -> Sequence:
    """``weight`` copies of each record per epoch: whole copies, then a seeded share for the fraction (the
    indices ``random.sample`` picks from the records themselves)."""
    whole, frac = int(weight), weight - int(weight)
    extra = random.Random(seed).sample(range(len(records)), round(len(records) * frac)) if frac else []
    return concat([records] * whole + [take(records, extra)])


def media_files(records: Sequence) -> dict[str, tuple[int, int]] | None:
    """The media files columnar records were checked against, or None for a list (the caller walks it)."""
    return records.media if isinstance(records, ColumnarRecords) else None


def modalities(records: Sequence) -> set[str]:
    """ "image" / "video" where the records hold them (columnar: as noted while they were checked)."""
    if isinstance(records, ColumnarRecords):
        return set(records.modalities)
    return {
        m for m, has in (("image", any(r.images for r in records)), ("video", any(r.videos for r in records))) if has
    }
