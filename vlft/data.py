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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from .errors import DataError
from .safety import image_file_problem, open_image, read_text_file

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


@dataclass
class Record:
    """One validated sample: turns, resolved image sources, and where it came from."""

    turns: list[Turn]
    images: list[str | bytes]  # absolute path, or decoded image bytes
    where: str  # "file.jsonl:12" or "file.json[3]"
    id: str | None = None
    image_sizes: list[tuple[int, int]] | None = None  # (width, height) of each image, read at validation

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


def _resolve_image(value: Any, base_dir: Path) -> tuple[str | bytes | None, str | None]:
    """(source, problem): an absolute path or image bytes, or why neither."""
    if not isinstance(value, str) or not value:
        return None, f"image must be a non-empty string (path or base64), got {value!r}"
    if value.startswith("data:") or not (base_dir / value).exists():
        raw = _decode_base64_image(value)
        if raw is not None:
            return raw, None
        if value.startswith("data:"):
            return None, "image data URI is not valid base64 (expected data:image/...;base64,...)"
        return None, f"image '{value}' not found (looked for {base_dir / value}); paths are relative to the data file"
    problem = image_file_problem(base_dir / value)
    if problem:
        return None, f"image '{value}' {problem}"
    return str((base_dir / value).resolve()), None


def load_image(source: str | bytes) -> Image.Image:
    """Open an image from a path or bytes, fully decoded and in RGB."""
    return open_image(source)


def _parse_turns(obj: dict) -> tuple[list[tuple[Any, Any]], list | None, str | None]:
    """Return ([(role, text)], images or None, problem) for either format."""
    if "conversations" in obj:
        convo = obj["conversations"]
        if not isinstance(convo, list):
            return [], None, "'conversations' must be a list of {\"from\", \"value\"} objects"
        turns = []
        for i, t in enumerate(convo):
            if not isinstance(t, dict) or "from" not in t or "value" not in t:
                return [], None, f"turn {i} must have 'from' and 'value'"
            turns.append((t["from"], t["value"]))
        images = obj.get("images", obj.get("image"))
    elif "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list):
            return [], None, "'messages' must be a list of {\"role\", \"content\"} objects"
        turns = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                return [], None, f"message {i} must have 'role' and 'content'"
            turns.append((m["role"], m["content"]))
        images = obj.get("images", obj.get("image"))
    else:
        return [], None, "record has neither 'conversations' nor 'messages'"
    if images is None:
        images = []
    elif isinstance(images, str):
        images = [images]
    elif not isinstance(images, list):
        return [], None, "'images' must be a path, a base64 string or a list of them"
    return turns, images, None


def read_records(path: str | Path, check_images: bool = True) -> list[Record]:
    """Read and validate a data file; raise one DataError listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    problems = _Problems(path)
    records: list[Record] = []
    base_dir = path.parent
    for where, obj in _iter_raw(path, problems):
        if not isinstance(obj, dict):
            problems.add(where, f"record must be a JSON object, got {type(obj).__name__}")
            continue
        raw_turns, raw_images, problem = _parse_turns(obj)
        if problem:
            problems.add(where, problem)
            continue
        turns: list[Turn] = []
        bad = False
        for i, (role, text) in enumerate(raw_turns):
            canon = ROLE_ALIASES.get(role) if isinstance(role, str) else None
            if canon is None:
                problems.add(where, f"turn {i}: unknown role {role!r}; use one of user/human, assistant/gpt, system")
                bad = True
                break
            if not isinstance(text, str):
                problems.add(where, f"turn {i}: text must be a string, got {type(text).__name__}")
                bad = True
                break
            turns.append(Turn(canon, text))
        if bad:
            continue
        if not any(t.role == "assistant" for t in turns):
            problems.add(where, "no assistant turn: there is nothing to learn from this record")
            continue
        if any(IMAGE_PLACEHOLDER in t.text for t in turns if t.role == "assistant"):
            problems.add(where, f"an assistant turn contains {IMAGE_PLACEHOLDER}; images belong in user turns")
            continue
        n_placeholders = sum(t.text.count(IMAGE_PLACEHOLDER) for t in turns)
        if n_placeholders != len(raw_images):
            problems.add(
                where,
                f"{n_placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(raw_images)} image(s); "
                f"put one {IMAGE_PLACEHOLDER} in the text for each image",
            )
            continue
        sources: list[str | bytes] = []
        sizes: list[tuple[int, int]] = []
        for value in raw_images:
            source, problem = _resolve_image(value, base_dir)
            if problem is None and check_images:
                try:
                    sizes.append(load_image(source).size)
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
        records.append(Record(turns, sources, where, obj.get("id"), sizes if check_images else None))
    problems.raise_if_any()
    if not records:
        raise DataError(f"{path} holds no records")
    return records
