"""Record layouts: one reader per layout, each turning a raw JSON record into turns and media sources.

Every reader returns a ``Parsed``: turns whose text holds one ``<image>`` (or
``<video>``) placeholder where each picture (clip) stands, and the raw image
and video values in placeholder order. ``data.py`` then checks roles, resolves
and opens the media, and reports every problem with its file:line.

Layouts (see README "Data"):

- messages (OpenAI / transformers chat / TRL / axolotl / ms-swift): ``content`` a string or a list of typed
  parts (``{"type": "text", "text"}``, ``{"type": "image", "image" | "url" | "path"}``,
  ``{"type": "image_url", "image_url": {"url"}}``, LLaMA-Factory's ``{"type", "value"}``); an image part
  with no source takes the next entry of the record's ``images``. ``loss: false`` on an assistant
  message keeps it in the context and out of the loss (ms-swift).
- conversations / conversation (LLaVA, LLaMA-Factory sharegpt, official Qwen2.5-VL fine-tuning code,
  Qwen-VL): ``{"from", "value"}`` or ``{"role", "content"}`` turns; ``image``/``images``, ``video``/``videos``.
- query/response/history (ms-swift).
- texts: a list of ``{"user", "assistant"}`` turn pairs (extra keys such as ``source`` ignored) with the
  record's ``images``; the text holds no placeholder, so the images stand at the start of the first user
  turn (where a text does hold placeholders, they are read as in every layout).

Qwen-VL's inline ``Picture 1: <img>path</img>`` becomes an image at its place in every layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

IMAGE = "<image>"


VIDEO = "<video>"


# one pass over a text: our placeholders and Qwen-VL's inline image tags, in order of appearance
_MEDIA = re.compile(r"<image>|<video>|(?:Picture\s*\d+\s*:\s*)?<img>(.*?)</img>", re.S)


# anything that still looks like an image/vision marker after the pass would be trained as plain text
_STRAY = re.compile(
    r"</?img>|<\|(?:image_pad|video_pad|vision_start|vision_end|vision_pad|image|img|video)\|>"
    r"|<image_?\d+>|<ImageHere>|<IMAGE>|<Image>|<image_placeholder>|<\|placeholder\|>"
)


class FormatProblem(Exception):
    """A record that does not read as any accepted layout; the message says what to fix."""


@dataclass
class RawTurn:
    role: Any
    text: str
    loss: bool | None = None  # None: the default (assistant turns are trained)


@dataclass
class Parsed:
    layout: str
    turns: list[RawTurn]
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    rejected: list[RawTurn] | None = None  # a preference record: the rejected conversation (data.preferences)
    desirable: bool | None = None  # an unpaired preference record: whether its reply is desirable


class _Media:
    """Collects the placeholders of a record in order: inline sources, or slots for the record's lists."""

    def __init__(self):
        # (inline?, value): an inline source, or a slot for the record's list (value: an explicit index into it,
        # as a typed part's ``"index": k`` gives, or None for the next one)
        self.slots: dict[str, list[tuple[bool, Any]]] = {IMAGE: [], VIDEO: []}
        self.sourceless: dict[str, list[list[str]]] = {IMAGE: [], VIDEO: []}  # the keys of parts without one

    def text(self, value: str) -> str:
        def sub(m: re.Match) -> str:
            if m.group(0) in (IMAGE, VIDEO):
                self.slots[m.group(0)].append((False, None))
                return m.group(0)
            self.slots[IMAGE].append((True, m.group(1).strip()))
            return IMAGE

        return _MEDIA.sub(sub, value)

    def part(self, kind: str, value: Any, keys: list[str] | None = None, index: int | None = None) -> str:
        self.slots[kind].append((value is not None, value if value is not None else index))
        if value is None and index is None:
            self.sourceless[kind].append(sorted(keys or []))
        return kind

    def fill(self, kind: str, listed: list) -> list:
        """The sources in placeholder order; the record's list fills the slots without an inline source."""
        slots = self.slots[kind]
        open_slots = sum(1 for inline, _ in slots if not inline)
        if open_slots != len(listed):
            noun = "image" if kind == IMAGE else "video"
            inline = len(slots) - open_slots
            extra = f" (plus {inline} given inline)" if inline else ""
            parts = "".join(
                f"; an {noun} part without a source (keys found: {', '.join(repr(k) for k in keys)}; a source "
                f"is one of {', '.join(repr(k) for k in _SOURCE_KEYS[kind])}) counts as a placeholder for "
                f"'{noun}s'"
                for keys in self.sourceless[kind][:3]
            )
            raise FormatProblem(
                f"{open_slots} {kind} placeholder(s){extra} but {len(listed)} {noun}(s) in '{noun}s'{parts}; "
                f"put one {kind} in the text for each {noun}"
                + (
                    " (or pass --add-placeholders to put them at the start of the first user turn)"
                    if kind == IMAGE and not slots
                    else ""
                )
            )
        indexed = [value for inline, value in slots if not inline and value is not None]
        if indexed and sorted(indexed) != list(range(len(listed))):
            raise FormatProblem(
                f"{kind} parts name the indices {indexed} of '{noun_of(kind)}s', which holds "
                f"{len(listed)}; each index must name a different entry, from 0"
            )
        it = iter(listed)
        return [value if inline else (listed[value] if value is not None else next(it)) for inline, value in slots]


def noun_of(kind: str) -> str:
    return "image" if kind == IMAGE else "video"


def _as_list(obj: dict, *keys: str) -> list:
    for key in keys:
        if key in obj and obj[key] is not None:
            value = obj[key]
            if isinstance(value, (str, dict)):
                return [value]
            if not isinstance(value, list):
                raise FormatProblem(f"'{key}' must be a path, a base64 string or a list of them")
            return value
    return []


_SOURCE_KEYS = {
    kind: (name, "value", "url", "path", f"{name}_url", "base64") for kind, name in ((IMAGE, "image"), (VIDEO, "video"))
}


def _part_source(part: dict, kind: str) -> Any:
    """The source of an image/video part, or None when it points at the record's list. axolotl's
    ``{"type": "image", "base64": "..."}`` is a bare base64 image."""
    for key in _SOURCE_KEYS[IMAGE if kind == "image" else VIDEO]:
        if key in part and part[key] is not None:
            value = part[key]
            return value.get("url") if isinstance(value, dict) else value
    return None


def _part_index(part: dict, turn: int, k: int) -> int | None:
    """A typed image part's ``"index": k`` (TRL's sets): the entry of the record's ``images`` it stands for."""
    index = part.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise FormatProblem(f"turn {turn}, part {k}: 'index' must be a whole number from 0, got {index!r}")
    return index


def _content(value: Any, media: _Media, turn: int) -> str:
    """A message's content, a string or a list of typed parts, as text with placeholders."""
    if isinstance(value, str):
        return media.text(value)
    if not isinstance(value, list):
        raise FormatProblem(f"turn {turn}: content must be a string or a list of parts, got {type(value).__name__}")
    out = []
    for k, part in enumerate(value):
        if isinstance(part, str):
            out.append(media.text(part))
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text", part.get("value"))
            if not isinstance(text, str):
                raise FormatProblem(f"turn {turn}, part {k}: a text part needs a string 'text' (or 'value')")
            out.append(media.text(text))
        elif kind in ("image", "image_url"):
            out.append(media.part(IMAGE, _part_source(part, "image"), list(part), _part_index(part, turn, k)))
        elif kind in ("video", "video_url"):
            out.append(media.part(VIDEO, _part_source(part, "video"), list(part)))
        else:
            raise FormatProblem(
                f'turn {turn}, part {k}: unknown content part {part!r}; parts are {{"type": "text", "text"}}, '
                '{"type": "image", "image"}, {"type": "image_url", "image_url": {"url"}} or '
                '{"type": "video", "video"}'
            )
    return "".join(out)


def _loss(m: dict, turn: int) -> bool | None:
    value = m.get("loss")
    if value is not None and not isinstance(value, bool):
        raise FormatProblem(f"turn {turn}: 'loss' must be true or false, got {value!r}")
    return value


def _finish(layout: str, obj: dict, turns: list[RawTurn], media: _Media, add_placeholders: bool) -> Parsed:
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise FormatProblem("'system' must be a string")
        if turns and turns[0].role == "system":
            raise FormatProblem("the record has both a 'system' field and a system turn; keep one")
        turns.insert(0, RawTurn("system", media.text(system)))
    images = _as_list(obj, "images", "image")
    videos = _as_list(obj, "videos", "video")
    if add_placeholders:
        first_user = next((t for t in turns if t.role in ("user", "human")), None)
        for kind, listed in ((IMAGE, images), (VIDEO, videos)):
            if listed and not media.slots[kind] and first_user is not None:
                first_user.text = kind * len(listed) + first_user.text
                media.slots[kind] = [(False, None)] * len(listed)
    return Parsed(layout, turns, media.fill(IMAGE, images), media.fill(VIDEO, videos))


def read_messages(obj: dict, add_placeholders: bool = False) -> Parsed:
    """``{"messages": [{"role", "content", "loss"?}], "images"?, "videos"?, "system"?}``."""
    msgs = obj["messages"]
    if not isinstance(msgs, list):
        raise FormatProblem('\'messages\' must be a list of {"role", "content"} objects')
    media, turns = _Media(), []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise FormatProblem(f"message {i} must have 'role' and 'content'")
        turns.append(RawTurn(m["role"], _content(m["content"], media, i), _loss(m, i)))
    return _finish("messages", obj, turns, media, add_placeholders)


def read_conversations(obj: dict, add_placeholders: bool = False) -> Parsed:
    """``{"conversations" | "conversation": [{"from", "value"} | {"role", "content"}], "image(s)"?, ...}``."""
    key = "conversations" if "conversations" in obj else "conversation"
    convo = obj[key]
    if not isinstance(convo, list):
        raise FormatProblem(f'\'{key}\' must be a list of {{"from", "value"}} objects')
    media, turns = _Media(), []
    for i, t in enumerate(convo):
        if isinstance(t, dict) and "from" in t and "value" in t:
            role, content = t["from"], t["value"]
        elif isinstance(t, dict) and "role" in t and "content" in t:
            role, content = t["role"], t["content"]
        else:
            raise FormatProblem(f"turn {i} must have 'from' and 'value'")
        turns.append(RawTurn(role, _content(content, media, i), _loss(t, i)))
    return _finish(key, obj, turns, media, add_placeholders)


def read_query_response(obj: dict, add_placeholders: bool = False) -> Parsed:
    """ms-swift: ``{"query", "response", "history"?: [[q, r], ...], "system"?, "images"?}``."""
    history = obj.get("history") or []
    if not isinstance(history, list) or any(not isinstance(h, (list, tuple)) or len(h) != 2 for h in history):
        raise FormatProblem("'history' must be a list of [query, response] pairs")
    media, turns = _Media(), []
    for i, value in enumerate([x for pair in history for x in pair] + [obj["query"], obj.get("response")]):
        if not isinstance(value, str):
            raise FormatProblem(f"turn {i}: query and response must be strings, got {type(value).__name__}")
        turns.append(RawTurn("user" if i % 2 == 0 else "assistant", media.text(value)))
    return _finish("query/response", obj, turns, media, add_placeholders)


def read_texts(obj: dict, add_placeholders: bool = False) -> Parsed:
    """``{"texts": [{"user", "assistant"}, ...], "images"?}``: turn pairs whose text holds no placeholder; the
    images stand at the start of the first user turn unless a text places them itself."""
    pairs = obj["texts"]
    if not isinstance(pairs, list) or not pairs:
        raise FormatProblem('\'texts\' must be a non-empty list of {"user", "assistant"} objects')
    media, turns = _Media(), []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, dict) or not isinstance(pair.get("user"), str):
            raise FormatProblem(f"texts[{i}] must have a string 'user'")
        reply = pair.get("assistant")
        if not isinstance(reply, str) or not reply.strip():
            raise FormatProblem(f"texts[{i}] has no 'assistant' reply: there is nothing to learn from it")
        turns += [RawTurn("user", media.text(pair["user"])), RawTurn("assistant", media.text(reply))]
    return _finish("texts", obj, turns, media, add_placeholders=True)


READERS = (
    ("messages", read_messages),
    ("conversations", read_conversations),
    ("conversation", read_conversations),
    ("query", read_query_response),
    ("texts", read_texts),
)


# every key some layout reads: a column outside these is listed as not read (``--columns`` maps one in)
RECORD_KEYS = (
    "messages",
    "conversations",
    "conversation",
    "query",
    "response",
    "history",
    "texts",
    "system",
    "images",
    "image",
    "videos",
    "video",
    "id",
)


def parse_record(obj: dict, add_placeholders: bool = False) -> Parsed:
    """Pick the layout by its key and read the record; raise FormatProblem saying what is wrong."""
    for key, reader in READERS:
        if key in obj:
            return reader(obj, add_placeholders)
    keys = ", ".join(sorted(map(str, obj))) or "none"
    raise FormatProblem(
        f"record has neither 'conversations' nor 'messages' (nor 'conversation', 'texts' or swift's "
        f"'query'/'response'); "
        f"its keys: {keys}. See README 'Data' for the accepted layouts"
    )


def stray_marker(text: str) -> str | None:
    """An image/vision marker left in the text that would be trained as plain text, or None."""
    m = _STRAY.search(text)
    return m.group(0) if m else None
