"""Columnar data files: Parquet, Arrow (the IPC file or stream format; `datasets` writes the stream) and the
folders `datasets`' ``save_to_disk`` writes, read through pyarrow a batch at a time.

A file is never decoded whole: the check walks it in batches of ``BATCH_ROWS`` rows (within one Parquet row
group), turning each row into the dict a JSON record would be, and an image stored as bytes (a
``{"bytes", "path"}`` struct, a list of them, a ``datasets.Image`` column) becomes a ``StoredImage``: where
to read its bytes again (file, row, column, item) when a sample is built. The bytes seen during the check
travel beside it as an ``EmbeddedImage`` and are dropped with the batch. A struct with a ``path`` and no
bytes is a path, resolved as JSON paths are.

Arrow files are memory-mapped (their buffers are read in place); Parquet files are read a row group at a
time, and a sample's image reads the row group's image column (the last few kept per process). A run
keeps only each checked row's place (``data.lazy``) and builds the sample's record again from its row
(``read_rows``; the row group's columns kept the same way).

Imports inside functions: pyarrow loads only when a columnar file is read (``vlft --help`` and JSON runs
never pay for it).
"""

from __future__ import annotations

import glob
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlft.data.formats import RECORD_KEYS
from vlft.errors import DataError

BATCH_ROWS = 1024  # rows turned into records at a time while a file is checked
KEEP_GROUPS = 4  # Parquet row groups' image columns kept per process for reading samples' images
KEEP_FILES = 64  # columnar files kept open per process

PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_START = b"\xff\xff\xff\xff"  # the continuation marker every IPC stream message starts with
SHARD_SUFFIXES = (".parquet", ".arrow")
_GLOB = set("*?[")


@dataclass(frozen=True)
class StoredImage:
    """An image held as bytes in a columnar file: where to read it again. ``item``: its place in a list
    column (None for a column of single images). Small and picklable: records keep this, not the bytes."""

    file: str  # absolute path of the data file
    row: int  # row in the file, from 0
    column: str  # the file's own column name
    item: int | None = None

    def read(self) -> bytes:
        return read_image_bytes(self)


@dataclass(frozen=True)
class EmbeddedImage:
    """A stored image as the check meets it: its place and its bytes (only while its batch is checked)."""

    ref: StoredImage
    data: bytes


def file_format(path: Path) -> str | None:
    """ "parquet", "arrow" or None (a JSON file), from the first bytes and the suffix: a Parquet file named
    ``.jsonl`` is still read as Parquet, and an empty or broken ``.parquet`` gets the Parquet reader's message."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if head.startswith(PARQUET_MAGIC) or path.suffix == ".parquet":
        return "parquet"
    if head.startswith(ARROW_FILE_MAGIC) or path.suffix == ".arrow":
        return "arrow"
    return None


def data_files(spec: str | os.PathLike) -> list[Path]:
    """The files a ``--data`` entry names: a file; a folder ``save_to_disk`` wrote (its shards, in order) or
    a folder of ``.parquet`` / ``.arrow`` shards (sorted by name); or a glob (sorted matches)."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        return _folder_files(path)
    if _GLOB & set(str(spec)):
        matches = sorted(Path(p) for p in glob.glob(str(spec)) if Path(p).is_file())
        if not matches:
            raise DataError(f"no data file matches {spec}")
        return matches
    raise DataError(f"data file not found: {path}")


def _folder_files(folder: Path) -> list[Path]:
    state = folder / "state.json"
    if state.is_file():  # datasets' save_to_disk: state.json lists the shards in order
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state}: not the state.json `datasets` save_to_disk writes ({e!r})") from None
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DataError(f"{folder}: state.json lists {', '.join(missing)}, which the folder does not hold")
        return files
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"{folder} holds several splits ({', '.join(splits) or 'none saved'}), a saved "
            f"DatasetDict: give one split's folder, e.g. --data {folder / (splits[0] if splits else 'train')}"
        )
    shards = sorted(p for p in folder.iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
    if shards:
        return shards
    raise DataError(
        f"{folder} is a folder, but neither a saved `datasets` folder (state.json beside "
        f"data-*.arrow) nor a folder of .parquet / .arrow shards; give a data file, such a folder, or "
        f"a glob such as '{folder}/*.jsonl'"
    )


def check_column_map(columns: dict[str, str] | None) -> dict[str, str]:
    """``--columns`` (ours -> the set's own name): each of ours must be a key some layout reads."""
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(RECORD_KEYS))
    if unknown:
        raise DataError(
            f"--columns maps {', '.join(map(repr, unknown))}, which no layout reads; the names vlft "
            f"reads are {', '.join(RECORD_KEYS)} (write OURS=THEIRS, e.g. messages=conv)"
        )
    return columns


def _reading_plan(names: list[str], columns: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """({the file's column: the key it is read as}, [the columns not read]). A mapping applies to the files
    that hold its column (one ``--columns`` serves a run's several sets); where it applies, the file's own
    column of that name, if any, is not read."""
    renamed = {theirs: ours for ours, theirs in columns.items() if theirs in names}
    replaced = set(renamed.values())
    read = {}
    for name in names:
        key = renamed.get(name, None if name in replaced else name)
        if key in RECORD_KEYS:
            read[name] = key
    return read, [n for n in names if n not in read]


def unread_columns(spec: str | os.PathLike, columns: dict[str, str] | None = None) -> dict[str, list[str]]:
    """{columnar file: its columns no layout reads}, from the schemas alone (JSON files have no columns)."""
    out = {}
    for path in data_files(spec):
        if file_format(path) is None:
            continue
        names = _opened(path).schema.names
        _, unread = _reading_plan(names, check_column_map(columns))
        if unread:
            out[str(path)] = unread
    return out


def _image_shape(type_) -> str | None:
    """ "one" for a ``{"bytes", ...}`` struct column, "list" for a list of them, else None."""
    import pyarrow as pa  # a columnar file is being read

    def is_image(t) -> bool:
        return (
            pa.types.is_struct(t)
            and t.get_field_index("bytes") >= 0
            and (pa.types.is_binary(t.field("bytes").type) or pa.types.is_large_binary(t.field("bytes").type))
        )

    if is_image(type_):
        return "one"
    if (pa.types.is_list(type_) or pa.types.is_large_list(type_)) and is_image(type_.value_type):
        return "list"
    return None


def iter_rows(path: Path, label: str, columns: dict[str, str] | None = None) -> Iterator[tuple[str, dict, int]]:
    """(where, record dict, row) for each row: ``"label: row group G, row N"`` (Parquet) or ``"label: row N"``,
    N counted from 0 over the file as `datasets` and pandas index it."""
    table = _opened(path)
    read, shapes = _row_plan(table, label, columns)
    file = str(path.resolve())
    for group, first, batch in table.batches(list(read), label):
        values = {name: batch.column(name).to_pylist() for name in read}
        for i in range(batch.num_rows):
            row = first + i
            cells = {name: values[name][i] for name in read}
            yield _where(label, group, row), _row_object(cells, read, shapes, file, row), row


def read_rows(path: Path, rows, label: str, columns: dict[str, str] | None = None) -> list[tuple[str, dict]]:
    """(where, record dict) of each of ``rows``, in that order, as ``iter_rows`` gives them: training samples or
    a check's measuring built from their rows (a Parquet row group read once and kept, ``KEEP_GROUPS`` of them
    per process; the rows of one group converted together)."""
    table = _opened(path)
    read, shapes = _row_plan(table, label, columns)
    file = str(Path(path).resolve())
    return [
        (_where(label, group, row), _row_object(cells, read, shapes, file, row))
        for row, group, cells in table.rows(list(read), [int(r) for r in rows])
    ]


def _row_plan(table: _Table, label: str, columns: dict[str, str] | None) -> tuple[dict[str, str], dict]:
    """({the file's column: the key it is read as}, {column: its image shape or None})."""
    read, _ = _reading_plan(table.schema.names, check_column_map(columns))
    if not read:
        raise DataError(
            f"{label}: none of its columns ({', '.join(table.schema.names)}) is one vlft reads "
            f"({', '.join(RECORD_KEYS)}); map the set's own names with --columns OURS=THEIRS"
        )
    return read, {name: _image_shape(table.schema.field(name).type) for name in read}


def _where(label: str, group: int | None, row: int) -> str:
    return f"{label}: row group {group}, row {row}" if group is not None else f"{label}: row {row}"


def _row_object(cells: dict, read: dict[str, str], shapes: dict, file: str, row: int) -> dict:
    """One row's cells as the dict a JSON record would be, its images as places in the file."""
    obj = {}
    for name, key in read.items():
        value = cells[name]
        if shapes[name] == "one":
            value = None if value is None else [_image(value, StoredImage(file, row, name))]
        elif shapes[name] == "list" and value is not None:
            value = [_image(v, StoredImage(file, row, name, k)) for k, v in enumerate(value)]
        obj[key] = value
    return obj


def _image(value: dict | None, ref: StoredImage) -> Any:
    """An image struct as the records reader takes it: its bytes with their place, else its path."""
    if value is None:
        return None
    if value.get("bytes") is not None:
        return EmbeddedImage(ref, value["bytes"])
    return value.get("path")


class _Table:
    """One columnar file opened in this process: its schema, its rows in batches, one cell by row."""

    def __init__(self, path: Path):
        import pyarrow as pa  # a columnar file is being read
        import pyarrow.parquet as pq  # (its Parquet reader)

        self.path, self.format = path, file_format(path)
        self._groups: OrderedDict = OrderedDict()
        try:
            if self.format == "parquet":
                # read, not mapped: pages of a mapped file the check read would stay resident for the run
                self.parquet = pq.ParquetFile(str(path), memory_map=False)
                self.schema = self.parquet.schema_arrow
                counts = [self.parquet.metadata.row_group(g).num_rows for g in range(self.parquet.num_row_groups)]
                self.group_starts = [sum(counts[:g]) for g in range(len(counts) + 1)]
            else:
                self.table = _read_arrow(path)
                self.schema = self.table.schema
        except (pa.ArrowException, OSError) as e:
            kind = "Parquet" if self.format == "parquet" else "Arrow (IPC file or stream)"
            raise DataError(
                f"{path}: cannot be read as {kind} ({e}); the file is damaged or not {kind} at all "
                f"(a partial download?): download or export it again"
            ) from None

    def batches(self, names: list[str], label: str) -> Iterator[tuple[int | None, int, Any]]:
        """(row group or None, the batch's first row, the batch), ``BATCH_ROWS`` rows at most at a time."""
        import pyarrow as pa  # a columnar file is being read

        if self.format != "parquet":
            first = 0
            for batch in self.table.select(names).to_batches(max_chunksize=BATCH_ROWS):
                yield None, first, batch
                first += batch.num_rows
            return
        for group in range(self.parquet.num_row_groups):
            first = self.group_starts[group]
            try:
                for batch in self.parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=names):
                    yield group, first, batch
                    first += batch.num_rows
            except (pa.ArrowException, OSError) as e:
                raise DataError(
                    f"{label}: row group {group} cannot be read as Parquet ({e}); the file is "
                    f"damaged: download or export it again"
                ) from None

    def rows(self, names: list[str], rows: list[int]) -> list[tuple[int, int | None, dict]]:
        """(row, row group or None, {column: value}) of each row, in order; a Parquet row group's columns are
        read once and kept (the last ``KEEP_GROUPS``), so samples drawn from one group cost one read, and
        a stretch of consecutive rows is converted in one call (slices: ``take`` would load pyarrow.compute,
        and with it pandas, in every check worker)."""
        out = []
        start = 0
        while start < len(rows):  # stretches of consecutive rows within one row group
            if self.format == "parquet":
                group = self._group_of(rows[start])
                lo, hi = self.group_starts[group], self.group_starts[group + 1]
                table = self._kept(
                    (group, tuple(names)), lambda group=group: self.parquet.read_row_group(group, columns=names)
                )
            else:
                group, lo, hi, table = None, 0, self.table.num_rows, self.table.select(names)
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1 and rows[end] < hi:
                end += 1
            cells = table.slice(rows[start] - lo, end - start).to_pylist()
            out += [(row, group, c) for row, c in zip(rows[start:end], cells)]
            start = end
        return out

    def _group_of(self, row: int) -> int:
        from bisect import bisect_right  # only Parquet rows are found through their row group

        return bisect_right(self.group_starts, row) - 1

    def _kept(self, key: tuple, read):
        """A row group's columns from the kept ones, or read and kept (dropping the oldest)."""
        values = self._groups.pop(key, None)
        if values is None:
            values = read()
        self._groups[key] = values
        while len(self._groups) > KEEP_GROUPS:
            self._groups.popitem(last=False)
        return values

    def cell(self, column: str, row: int) -> Any:
        if self.format != "parquet":
            return self.table.column(column)[row].as_py()
        group = self._group_of(row)
        values = self._kept((group, column), lambda: self.parquet.read_row_group(group, columns=[column]).column(0))
        return values[row - self.group_starts[group]].as_py()


def _read_arrow(path: Path):
    """An Arrow IPC file or stream, memory-mapped: the table's buffers are the file's pages, read in place."""
    import pyarrow as pa  # a columnar file is being read

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


_OPEN: OrderedDict[tuple, _Table] = OrderedDict()
_OPEN_PID: list[int] = []  # the process the open files belong to: a forked worker opens its own


def _opened(path: Path) -> _Table:
    if _OPEN_PID != [os.getpid()]:
        _OPEN.clear()
        _OPEN_PID[:] = [os.getpid()]
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)  # a file written again is opened again
    table = _OPEN.pop(key, None) or _Table(Path(path))
    _OPEN[key] = table
    while len(_OPEN) > KEEP_FILES:
        _OPEN.popitem(last=False)
    return table


def close(files: list[Path]) -> None:
    """Forget these files' open tables: after the check, the pages it read of a memory-mapped Arrow file (and
    the row groups kept) leave the process; training opens again the few it reads."""
    for key in [k for k in _OPEN if k[0] in {str(f) for f in files}]:
        del _OPEN[key]


def read_image_bytes(ref: StoredImage) -> bytes:
    """The bytes of a stored image, read from its file when a sample is built."""
    value = _opened(Path(ref.file)).cell(ref.column, ref.row)
    if ref.item is not None:
        value = value[ref.item]
    data = value.get("bytes") if isinstance(value, dict) else None
    if data is None:
        raise DataError(
            f"{ref.file}: row {ref.row}, column '{ref.column}': the image's bytes are gone (the file "
            f"changed after it was checked)"
        )
    return data
