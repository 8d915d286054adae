"""Reading, validating, encoding and batching conversation data.

Two input formats (README.md, "Data"), as a JSON array or JSON Lines:

- conversations: ``{"image": "imgs/a.png", "conversations": [{"from": "user", "value": "<image>\\n..."},
  {"from": "assistant", "value": "..."}]}`` (``image`` may also be a list, ``images`` too)
- messages: ``{"messages": [{"role": "user", "content": "<image>..."}, ...], "images": ["imgs/a.png"]}``

Image paths are relative to the data file; ``data:image/...;base64,`` URIs
and bare base64 strings are accepted too. Every record is checked before
training starts, and all problems are reported together, each with its file
and line (JSONL) or record index (JSON array).

Parquet and Arrow files, saved ``datasets`` folders, folders of shards and globs are read through
``data.columnar``: each row becomes the dict a JSON record would be, its images stored as bytes kept as
``StoredImage`` places (read when a sample is built); locations are ``file: row group G, row N``.

Encoding records into model inputs (labels, images, batches) is
``vlft/encoding.py``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

from vlft.data.columnar import (
    EmbeddedImage,
    StoredImage,
    check_column_map,
    data_files,
    file_format,
    iter_rows,
    read_rows,
)
from vlft.data.formats import FormatProblem, parse_record, stray_marker
from vlft.data.safety import image_file_problem, open_image, read_text_file
from vlft.data.video import VideoError, probe_video
from vlft.errors import DataError

IMAGE_PLACEHOLDER = "<image>"


IGNORE_INDEX = -100


ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "system": "system",
}


MAX_REPORTED_PROBLEMS = 20


@dataclass
class Turn:
    role: str
    text: str
    trained: bool = True  # an assistant turn with ``loss: false`` stays in the context, out of the loss


@dataclass
class Record:
    """One validated sample: turns, resolved image sources, and where it came from."""

    turns: list[Turn]
    images: list[str | bytes | StoredImage]  # absolute path, decoded base64 bytes, or bytes' place in a file
    where: str  # "file.jsonl:12" or "file.json[3]"
    id: str | None = None
    image_sizes: list[tuple[int, int]] | None = None  # (width, height) of each image, read at validation
    videos: list[str] = field(default_factory=list)  # absolute paths, in <video> placeholder order
    layout: str = "messages"
    # a preference record (``data.preferences``): the same prompt with the reply ranked lower; ``turns`` hold the
    # chosen conversation
    rejected: list[Turn] | None = None
    # an unpaired preference record (``data.preferences.parse_unpaired``, KTO's): whether its reply is desirable
    desirable: bool | None = None
    # every acceptable answer, where the record lists them (DocVQA's ``answers``): scorers take the best over these
    # and the reference
    answers: list[str] | None = None

    @property
    def reference(self) -> str:
        """The last assistant reply: what evaluation compares generations with."""
        return next(t.text for t in reversed(self.turns) if t.role == "assistant")


@dataclass
class _Problems:
    path: Path
    items: list[str] = field(default_factory=list)
    count: int = 0

    def add(self, where: str, message: str) -> None:
        self.count += 1
        if len(self.items) < MAX_REPORTED_PROBLEMS:
            self.items.append(f"{where}: {message}")

    def raise_if_any(self) -> None:
        if not self.count:
            return
        more = self.count - len(self.items)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise DataError(
            f"{self.count} problem(s) in {self.path}:\n  "
            + "\n  ".join(self.items)
            + tail
            + "\nFix these records (or remove them) and run again; nothing was written."
        )


def _iter_raw(path: Path, label: str, problems: _Problems, columns: dict[str, str]):
    """Yield (where, object, row) for each record of a JSON array, JSONL, Parquet or Arrow file (row: a
    columnar file's row, None in JSON); ``columns`` (ours -> the set's own name) renames keys before a layout
    reads them."""
    if file_format(path) is not None:
        yield from iter_rows(path, label, columns)
        return
    for where, obj in _iter_json(path, label, problems):
        yield where, _renamed(obj, columns), None


def _renamed(obj: Any, columns: dict[str, str]) -> Any:
    """A JSON record's keys renamed as a columnar file's columns are (``columnar._reading_plan``)."""
    if not columns or not isinstance(obj, dict):
        return obj
    renamed = {theirs: ours for ours, theirs in columns.items() if theirs in obj}
    replaced = set(renamed.values())
    return {renamed.get(k, k): v for k, v in obj.items() if k in renamed or k not in replaced}


def _iter_json(path: Path, label: str, problems: _Problems):
    text = read_text_file(path)
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            problems.add(f"{label}:{e.lineno}", f"invalid JSON ({e.msg}, column {e.colno})")
            return
        for i, obj in enumerate(data):
            yield f"{label}[{i}]", obj
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{label}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            problems.add(f"{label}:{lineno}", f"invalid JSON ({e.msg}, column {e.colno})")


def _decode_base64_image(value: str) -> bytes | None:
    payload = value
    if value.startswith("data:"):
        if ";base64," not in value:
            return None
        payload = value.split(";base64,", 1)[1]
    elif len(value) < 64 or "/" in value[:64] and value.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".bmp")):
        return None
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None


def _url_cache_path(url: str, root: Path | None) -> Path | None:
    """Where a downloaded copy of ``url`` lies under ``root``: ``root/host/path``, as ``wget -x`` saves it."""
    if root is None:
        return None

    u = urlparse(url)
    return root / u.netloc / u.path.lstrip("/")


def _resolve_path(value: str, base_dir: Path, image_root: Path | None, what: str) -> tuple[str | None, str | None]:
    """A media path: absolute as given; relative to --image-root when given, else to the data file."""
    if value.startswith(("http://", "https://")):
        cached = _url_cache_path(value, image_root)
        if cached is not None and cached.is_file():
            return str(cached.resolve()), None
        hint = f" (looked for {cached})" if cached is not None else ""
        return None, (
            f"{what} '{value}' is a URL and vlft reads nothing from the network{hint}; download it "
            f"first and give its local path, or keep the download under --image-root DIR as DIR/host/path "
            f"(what `wget -x` writes)"
        )
    root = image_root if image_root is not None else base_dir
    candidate = Path(value) if Path(value).is_absolute() else root / value
    if not candidate.exists():
        rule = (
            "relative paths are relative to --image-root"
            if image_root is not None
            else "relative paths are relative to the data file's folder; pass --image-root DIR if they are "
            "relative to a dataset root"
        )
        return None, f"{what} '{value}' not found (looked for {candidate}); {rule}"
    problem = image_file_problem(candidate)  # a folder, a device, a link to one: not a file to decode
    if problem:
        return None, f"{what} '{value}' {problem}"
    return str(candidate.resolve()), None


def _resolve_image(value: Any, base_dir: Path, image_root: Path | None = None) -> tuple[str | bytes | None, str | None]:
    """(source, problem): an absolute path or image bytes, or why neither."""
    if isinstance(value, dict):  # HF datasets' {"bytes", "path"} and swift's {"path"}
        value = value.get("path") or value.get("bytes") or value.get("url")
    if not isinstance(value, str) or not value:
        return None, f"image must be a non-empty string (path or base64), got {value!r}"
    if value.startswith("data:"):
        raw = _decode_base64_image(value)
        if raw is None:
            return None, "image data URI is not valid base64 (expected data:image/...;base64,...)"
        return raw, None
    source, problem = _resolve_path(value, base_dir, image_root, "image")
    if problem is not None and not value.startswith(("http://", "https://")):
        raw = _decode_base64_image(value)
        if raw is not None:
            return raw, None
    return source, problem


# each image file is decoded once per process while it is unchanged: (path, size, mtime) -> its size, or the
# problem it raised
_CHECKED_IMAGES: dict[tuple, tuple[int, int] | Exception] = {}


def checked_image_size(source: str | bytes) -> tuple[int, int]:
    """(width, height) of an image, fully decoded (a broken or over-large one raises, as ``load_image``); a
    file is decoded once while its path, size and modification time stay the same."""
    if isinstance(source, bytes):
        return load_image(source).size
    st = os.stat(source)
    key = (source, st.st_size, st.st_mtime_ns)
    found = _CHECKED_IMAGES.get(key)
    if found is None:
        try:
            found = load_image(source).size
        except (UnidentifiedImageError, OSError, ValueError) as e:
            found = e
        _CHECKED_IMAGES[key] = found
    if isinstance(found, Exception):
        raise found
    return found


def load_image(source: str | bytes | StoredImage) -> Image.Image:
    """Open an image from a path, bytes or its place in a columnar file, fully decoded and in RGB."""
    return open_image(source.read() if isinstance(source, StoredImage) else source)


def header_size(source: str | bytes | StoredImage) -> tuple[int, int]:
    """(width, height) of an image from its header alone (no pixels decoded): measuring a record that was
    checked before."""
    if isinstance(source, StoredImage):
        source = source.read()
    with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
        return img.size


def read_records(
    path: str | Path,
    check_images: bool = True,
    image_root: str | Path | None = None,
    add_placeholders: bool = False,
    columns: dict[str, str] | None = None,
    parse=None,
) -> list[Record]:
    """Read and validate a data file (or a folder or glob of them); raise one DataError listing every problem.

    ``image_root``: the folder relative image and video paths start from (default: the data file's).
    ``add_placeholders``: records with images but no placeholder get them at the start of the first user turn.
    ``columns``: the set's own names for the keys the layouts read (``{"messages": "conv"}``).
    """
    records, problems = read_records_collecting(path, check_images, image_root, add_placeholders, columns, parse=parse)
    problems.raise_if_any()
    if not records:
        raise DataError(f"{path} holds no records")
    return records


def read_records_collecting(
    path: str | Path,
    check_images: bool = True,
    image_root: str | Path | None = None,
    add_placeholders: bool = False,
    columns: dict[str, str] | None = None,
    keep=None,
    parse=None,
) -> tuple[list[Record], _Problems]:
    """The valid records and the problems of the others (``vlft data check`` reports both). ``keep(file,
    row, record)``: says whether a valid record is kept in the list (``data.lazy`` keeps its row instead).
    ``parse``: the layout reader of each record (an objective's, ``Objective.parse``); None: ``parse_record``."""

    path = Path(path)
    files = data_files(path)
    columns = check_column_map(columns)
    root = Path(image_root) if image_root is not None else None
    if root is not None and not root.is_dir():
        raise DataError(f"--image-root {root} is not a folder")
    problems = _Problems(path)
    records: list[Record] = []
    images = _ImageChecker(root, check_images)
    for file in files:
        label = f"{path.name}/{file.name}" if path.is_dir() else file.name
        for where, obj, row in _iter_raw(file, label, problems, columns):
            record = _record(where, obj, file.parent, images, add_placeholders, problems, parse)
            if record is not None and (keep is None or keep(file, row, record)):
                records.append(record)
    return records, problems


def record_at(
    file: Path,
    row: int,
    label: str,
    image_root: str | Path | None = None,
    add_placeholders: bool = False,
    columns: dict[str, str] | None = None,
    parse=None,
) -> Record:
    """The record of one row of a columnar file that was checked before, built again from the row (its
    images stay places in the file, decoded when the sample is encoded)."""
    return records_at(file, [row], label, image_root, add_placeholders, columns, parse, sizing=False)[0]


def records_at(
    file: Path,
    rows,
    label: str,
    image_root: str | Path | None = None,
    add_placeholders: bool = False,
    columns: dict[str, str] | None = None,
    parse=None,
    sizing: bool = True,
) -> list[Record]:
    """``record_at`` of several rows of one file, read together (a row group's rows in one conversion, not one
    each) and, with ``sizing``, each image's size read from its header, once per distinct image: measuring a
    checked set's rows needs the sizes, not the pixels."""
    root = Path(image_root) if image_root is not None else None
    images = _ImageChecker(root, check=False, sizing=sizing)
    out = []
    for where, obj in read_rows(file, rows, label, check_column_map(columns)):
        problems = _Problems(file)
        record = _record(where, obj, file.parent, images, add_placeholders, problems, parse)
        if record is None:
            raise DataError(f"{problems.items[0]}\n{file} changed after it was checked; run again to check it anew")
        out.append(record)
    return out


class _ImageChecker:
    """Resolves and decodes a read's images: a path named by many records is resolved once, and an image
    (file or bytes) decoded once however many records name it."""

    def __init__(self, root: Path | None, check: bool, sizing: bool = False):
        self.root, self.check = root, check
        self.sizing = sizing and not check  # unchecked, but each image's size read from its header
        self.resolved: dict[tuple, tuple] = {}  # (folder, path) -> (source, problem); ("size", path) -> size
        self.sizes: dict[bytes, tuple[int, int] | Exception] = {}  # digest of embedded bytes -> size or problem

    def source(self, value: Any, base_dir: Path) -> tuple[str | bytes | StoredImage | None, tuple | None, str | None]:
        """(source, (width, height) or None, problem) of one image value of a record."""
        if isinstance(value, EmbeddedImage):
            return value.ref, *self._embedded(value)
        if isinstance(value, str) and len(value) < 4096:
            key = (base_dir, value)
            if key not in self.resolved:
                self.resolved[key] = _resolve_image(value, base_dir, self.root)
            source, problem = self.resolved[key]
        else:
            source, problem = _resolve_image(value, base_dir, self.root)
        size = None
        if problem is None and source is not None and self.sizing:  # a path named by many rows: its header read once
            key = ("size", source) if isinstance(source, str) else None
            size = self.resolved.get(key) if key else None
            if size is None:
                size = header_size(source)
                if key:
                    self.resolved[key] = size
        if problem is None and source is not None and self.check:
            try:
                size = checked_image_size(source)
            except (UnidentifiedImageError, OSError, ValueError) as e:
                label = value if isinstance(source, str) else "base64 image"
                problem = f"image '{label}' cannot be read ({e.__class__.__name__}: {e})"
        return source, size, problem

    def _embedded(self, image: EmbeddedImage) -> tuple[tuple[int, int] | None, str | None]:
        if not (self.check or self.sizing):
            return None, None
        key = hashlib.blake2b(image.data, digest_size=16).digest()
        found = self.sizes.get(key)
        if found is None and self.sizing:  # checked before: its header says its size
            found = self.sizes[key] = header_size(image.data)
        if found is None:
            try:
                found = load_image(image.data).size
            except (UnidentifiedImageError, OSError, ValueError) as e:
                found = e
            self.sizes[key] = found
        if isinstance(found, Exception):
            where = f"column '{image.ref.column}'" + (f", item {image.ref.item}" if image.ref.item is not None else "")
            return (
                None,
                f"image ({where}, {len(image.data)} bytes) cannot be read ({found.__class__.__name__}: {found})",
            )
        return found, None


def _record(
    where: str, obj: Any, base_dir: Path, images: _ImageChecker, add_placeholders: bool, problems: _Problems, parse=None
) -> Record | None:
    """One raw record checked into a Record, or None with its problem added."""
    if not isinstance(obj, dict):
        problems.add(where, f"record must be a JSON object, got {type(obj).__name__}")
        return None
    try:
        parsed = (parse or parse_record)(obj, add_placeholders)
    except FormatProblem as e:
        problems.add(where, str(e))
        return None
    problem = _check_turns(parsed)
    if problem:
        problems.add(where, problem)
        return None
    turns = [Turn(ROLE_ALIASES[t.role], t.text, t.loss is not False) for t in parsed.turns]
    stray = next(((i, m) for i, t in enumerate(turns) if (m := stray_marker(t.text))), None)
    if stray:
        problems.add(
            where,
            f"turn {stray[0]}: '{stray[1]}' looks like an image marker vlft does not read, so it "
            "would be trained as plain text and the model would never see the picture; write "
            f"{IMAGE_PLACEHOLDER} where the image stands and list the image under 'images'",
        )
        return None
    sources: list[str | bytes | StoredImage] = []
    sizes: list[tuple[int, int]] = []
    for value in parsed.images:
        source, size, problem = images.source(value, base_dir)
        if problem:
            problems.add(where, problem)
            return None
        assert source is not None  # found, as there is no problem
        sources.append(source)
        if size is not None:
            sizes.append(size)
    videos: list[str] = []
    for value in parsed.videos:
        source, problem = (
            _resolve_path(value, base_dir, images.root, "video")
            if isinstance(value, str) and value
            else (None, f"video must be a path, got {value!r}")
        )
        if problem is None and source is not None and images.check:
            problem = video_problem(source, value)
        if problem:
            problems.add(where, problem)
            return None
        assert source is not None  # found, as there is no problem
        videos.append(source)
    rejected = (
        [Turn(ROLE_ALIASES[t.role], t.text, t.loss is not False) for t in parsed.rejected]
        if parsed.rejected is not None
        else None
    )
    answers = obj.get("answers")
    if answers is not None and (not isinstance(answers, list) or not all(isinstance(a, str) for a in answers)):
        problems.add(where, f"'answers' must be a list of strings (every acceptable answer), got {answers!r}")
        return None
    return Record(
        turns,
        sources,
        where,
        obj.get("id"),
        sizes if images.check or images.sizing else None,
        videos,
        parsed.layout,
        rejected,
        desirable=parsed.desirable,
        answers=answers or None,
    )


def _check_turns(parsed) -> str | None:
    """Roles, an assistant turn to learn from, no media in replies, loss only on assistant turns."""
    for i, t in enumerate(parsed.turns):
        if not isinstance(t.role, str) or t.role not in ROLE_ALIASES:
            return f"turn {i}: unknown role {t.role!r}; use one of user/human, assistant/gpt, system"
        if t.loss is not None and ROLE_ALIASES[t.role] != "assistant":
            return f"turn {i}: 'loss' is only read on assistant turns (only replies are trained)"
    roles = [ROLE_ALIASES[t.role] for t in parsed.turns]
    if "assistant" not in roles:
        return "no assistant turn: there is nothing to learn from this record"
    if all(t.loss is False for t, r in zip(parsed.turns, roles) if r == "assistant"):
        return (
            "every assistant turn has loss: false, so no token of this record would be trained; drop the record "
            "or train at least one reply"
        )
    for t, r in zip(parsed.turns, roles):
        if r == "assistant" and (IMAGE_PLACEHOLDER in t.text or "<video>" in t.text):
            return f"an assistant turn contains {IMAGE_PLACEHOLDER}; images belong in user turns"
    return None


def video_problem(path: str, label: str) -> str | None:
    """Why a video cannot be decoded, or None (opens it and reads its first frame)."""

    try:
        probe_video(path)
    except VideoError as e:
        return f"video '{label}' cannot be read ({e})"
    return None
