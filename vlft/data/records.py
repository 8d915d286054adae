"""Reading, validating, encoding and batching conversation data.

Two input formats (README.md, "Data"), as a JSON array or JSON Lines:

- conversations: ``{"image": "imgs/a.png", "conversations": [{"from": "user", "value": "<image>\\n..."},
  {"from": "assistant", "value": "..."}]}`` (``image`` may also be a list, ``images`` too)
- messages: ``{"messages": [{"role": "user", "content": "<image>..."}, ...], "images": ["imgs/a.png"]}``

Image paths are relative to the data file; ``data:image/...;base64,`` URIs
and bare base64 strings are accepted too. Every record is checked before
training starts, and all problems are reported together, each with its file
and line (JSONL) or record index (JSON array).

Encoding records into model inputs (labels, images, batches) is
``vlft/encoding.py``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

from vlft.data.formats import FormatProblem, parse_record, stray_marker
from vlft.data.safety import image_file_problem, open_image, read_text_file
from vlft.data.video import VideoError, probe_video
from vlft.errors import DataError

IMAGE_PLACEHOLDER = "<image>"


IGNORE_INDEX = -100


ROLE_ALIASES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant",
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
    images: list[str | bytes]  # absolute path, or decoded image bytes
    where: str  # "file.jsonl:12" or "file.json[3]"
    id: str | None = None
    image_sizes: list[tuple[int, int]] | None = None  # (width, height) of each image, read at validation
    videos: list[str] = field(default_factory=list)  # absolute paths, in <video> placeholder order
    layout: str = "messages"
    # a preference record (``data.preferences``): the same prompt with the reply ranked lower; ``turns`` hold the
    # chosen conversation
    rejected: list[Turn] | None = None

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
            f"{self.count} problem(s) in {self.path}:\n  " + "\n  ".join(self.items) + tail
            + "\nFix these records (or remove them) and run again; nothing was written."
        )


def _iter_raw(path: Path, problems: _Problems):
    """Yield (where, object) for each record of a JSON array or JSONL file."""
    text = read_text_file(path)
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            problems.add(f"{path.name}:{e.lineno}", f"invalid JSON ({e.msg}, column {e.colno})")
            return
        for i, obj in enumerate(data):
            yield f"{path.name}[{i}]", obj
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path.name}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            problems.add(f"{path.name}:{lineno}", f"invalid JSON ({e.msg}, column {e.colno})")


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
        return None, (f"{what} '{value}' is a URL and vlft reads nothing from the network{hint}; download it "
                      f"first and give its local path, or keep the download under --image-root DIR as DIR/host/path "
                      f"(what `wget -x` writes)")
    root = image_root if image_root is not None else base_dir
    candidate = Path(value) if Path(value).is_absolute() else root / value
    if not candidate.exists():
        rule = ("relative paths are relative to --image-root" if image_root is not None else
                "relative paths are relative to the data file's folder; pass --image-root DIR if they are "
                "relative to a dataset root")
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


def load_image(source: str | bytes) -> Image.Image:
    """Open an image from a path or bytes, fully decoded and in RGB."""
    return open_image(source)


def read_records(path: str | Path, check_images: bool = True, image_root: str | Path | None = None,
                 add_placeholders: bool = False, parse=None) -> list[Record]:
    """Read and validate a data file; raise one DataError listing every problem.

    ``image_root``: the folder relative image and video paths start from (default: the data file's).
    ``add_placeholders``: records with images but no placeholder get them at the start of the first user turn.
    """
    records, problems = read_records_collecting(path, check_images, image_root, add_placeholders, parse)
    problems.raise_if_any()
    if not records:
        raise DataError(f"{path} holds no records")
    return records


def read_records_collecting(path: str | Path, check_images: bool = True, image_root: str | Path | None = None,
                            add_placeholders: bool = False, parse=None) -> tuple[list[Record], _Problems]:
    """The valid records and the problems of the others (``vlft data check`` reports both). ``parse``: the
    layout reader of each JSON object (an objective's, ``Objective.parse``); None: ``parse_record``."""

    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    root = Path(image_root) if image_root is not None else None
    if root is not None and not root.is_dir():
        raise DataError(f"--image-root {root} is not a folder")
    problems = _Problems(path)
    records: list[Record] = []
    base_dir = path.parent
    resolved: dict[str, tuple] = {}  # a path named by many records is resolved once per read
    for where, obj in _iter_raw(path, problems):
        if not isinstance(obj, dict):
            problems.add(where, f"record must be a JSON object, got {type(obj).__name__}")
            continue
        try:
            parsed = (parse or parse_record)(obj, add_placeholders)
        except FormatProblem as e:
            problems.add(where, str(e))
            continue
        problem = _check_turns(parsed)
        if problem:
            problems.add(where, problem)
            continue
        turns = [Turn(ROLE_ALIASES[t.role], t.text, t.loss is not False) for t in parsed.turns]
        stray = next(((i, m) for i, t in enumerate(turns) if (m := stray_marker(t.text))), None)
        if stray:
            problems.add(where, f"turn {stray[0]}: '{stray[1]}' looks like an image marker vlft does not read, so it "
                                "would be trained as plain text and the model would never see the picture; write "
                                f"{IMAGE_PLACEHOLDER} where the image stands and list the image under 'images'")
            continue
        sources: list[str | bytes] = []
        sizes: list[tuple[int, int]] = []
        bad = False
        for value in parsed.images:
            if isinstance(value, str) and len(value) < 4096:
                if value not in resolved:
                    resolved[value] = _resolve_image(value, base_dir, root)
                source, problem = resolved[value]
            else:
                source, problem = _resolve_image(value, base_dir, root)
            if problem is None and check_images:
                try:
                    sizes.append(checked_image_size(source))
                except (UnidentifiedImageError, OSError, ValueError) as e:
                    label = value if isinstance(source, str) else "base64 image"
                    problem = f"image '{label}' cannot be read ({e.__class__.__name__}: {e})"
            if problem:
                problems.add(where, problem)
                bad = True
                break
            sources.append(source)
        if bad:
            continue
        videos: list[str] = []
        for value in parsed.videos:
            source, problem = (_resolve_path(value, base_dir, root, "video") if isinstance(value, str) and value
                               else (None, f"video must be a path, got {value!r}"))
            if problem is None and check_images:
                problem = video_problem(source, value)
            if problem:
                problems.add(where, problem)
                bad = True
                break
            videos.append(source)
        if bad:
            continue
        rejected = [Turn(ROLE_ALIASES[t.role], t.text, t.loss is not False) for t in parsed.rejected] \
            if parsed.rejected is not None else None
        records.append(Record(turns, sources, where, obj.get("id"), sizes if check_images else None, videos,
                              parsed.layout, rejected))
    return records, problems


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
        return "every assistant turn has loss: false, so no token of this record would be trained; drop the record " \
               "or train at least one reply"
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
