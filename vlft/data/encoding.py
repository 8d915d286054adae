"""From a validated record to model inputs: chat-template rendering, assistant-only labels, image
tensors (lengths: ``data.lengths``; batches: ``data.batching``).

Labels: only assistant replies count in the loss. Where the chat template marks
them (``{% generation %}``), the mask is its spans; otherwise it comes from
rendering the conversation prefix by prefix with the processor's own chat
template and tokenising the pieces, so it needs no token ids of any
particular tokenizer. Templates that render earlier turns differently once
later turns follow (thinking templates drop earlier replies' reasoning
blocks) are split from one render of the whole conversation instead: each
reply starts where the render up to its generation prompt stops agreeing
with the whole, and ends at the family's reply-end token.

What is model-specific (the reply-end token, extra template arguments, how an
image becomes model inputs and who writes its tokens into the text) comes from
the ``ModelFamily``: its ``image_inputs`` prepares a record's images (and clips,
with ``video_inputs``) once and writes them into each conversation's rendered
pieces. The encoder names none of a family's input keys; ``vlft.processor_image_inputs``
is the ready-made answer for a family whose processor writes the image tokens
itself (Gemma 3's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch

from vlft.contracts.family import Media, Written
from vlft.data.records import IGNORE_INDEX, IMAGE_PLACEHOLDER, Record, Turn, header_size, load_image
from vlft.data.video import VideoError, read_frames
from vlft.errors import ConfigError, DataError
from vlft.tokens import tokenize_pieces


class _NotPrefix(Exception):
    """The template does not render the conversation prefix by prefix."""


_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")  # a template's assistant-span markers
_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|<video>)")


def _chat_messages(turns: list[Turn]) -> list[dict]:
    """Turns as chat-template messages, with <image>/<video> placeholders as image/video parts."""
    messages = []
    for t in turns:
        parts: list[dict] = []
        for chunk in _PLACEHOLDERS.split(t.text):
            if chunk == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
            elif chunk == "<video>":
                parts.append({"type": "video"})
            elif chunk:
                parts.append({"type": "text", "text": chunk})
        messages.append({"role": t.role, "content": parts})
    return messages


def _on_token_bounds(tokenizer, text: str, spans: list) -> list[tuple[int, int]]:
    """Each (start, end) character span widened to the tokens of ``text`` it overlaps, as transformers' assistant
    mask counts a token (a reply's first word may carry the space before it: byte-level BPE's " hole"), so the
    pieces split where the whole render's tokens do."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets: the spans as they are
        return [tuple(span) for span in spans]
    out = []
    for start, end in spans:
        inside = [(a, b) for a, b in offsets if a < end and b > start]
        out.append((min(start, inside[0][0]), max(end, inside[-1][1])) if inside else (start, end))
    return out


class SampleEncoder:
    """Turns a Record into model inputs with assistant-only labels.

    ``processor`` is a transformers multimodal processor (a tokenizer, an
    image processor and a chat template); ``family`` the model family it
    encodes for (the plan's). ``max_pixels`` caps each image by the family's
    own rule (``ImageInputs.size_cap``).
    """

    def __init__(
        self, processor, family, max_pixels: int | None = None, video_fps: float = 2.0, video_max_frames: int = 16
    ):
        self.processor = processor
        self.family = family
        self.template_kwargs = dict(self.family.chat.template_kwargs)
        self.tokenizer = processor.tokenizer
        self.video_fps, self.video_max_frames = video_fps, video_max_frames
        self.eos_text = self.family.chat.reply_end_token or self.tokenizer.eos_token
        # the template leaves replies open (ModelFamily.reply_end_appended): each trained reply ends with eos_text
        self.append_end = bool(self.family.chat.reply_end_appended and self.eos_text)
        self.images = self.family.image_inputs
        if max_pixels is not None and self.images is not None and not self.images.size_cap:
            raise ConfigError(
                f"--max-pixels: the {self.family.name} family has no image size cap "
                "(ImageInputs.size_cap is empty): its processor sizes every image itself"
            )
        self.max_pixels = max_pixels

    def render(self, turns: list[Turn], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            _chat_messages(turns), tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def pieces(self, turns: list[Turn], where: str = "") -> list[tuple[str, bool]]:
        """The rendered conversation as (text, trained) pieces, in order: the template's own assistant spans where
        it marks them with ``{% generation %}``, else prefix by prefix; for a family that takes one prompt and one
        reply (``Chat.last_reply_only``), those two."""
        if self.family.chat.last_reply_only:
            return self._prompt_and_last_reply(turns, where)
        try:
            return self._pieces_from_markers(turns)
        except _NotPrefix:
            pass
        try:
            return self._pieces_by_prefix(turns)
        except _NotPrefix:
            return self._pieces_from_whole(turns, where)

    def _pieces_from_markers(self, turns: list[Turn]) -> list[tuple[str, bool]]:
        """One render of the whole conversation cut at the spans the template marks as the assistant's (transformers'
        ``return_assistant_tokens_mask`` reads the same), one per reply, each trained with its reply-end token where
        the template writes it right after the span. _NotPrefix where the template has no markers, or its render
        or its span count differs from what the other methods see."""
        template = getattr(self.processor, "chat_template", None)
        if not isinstance(template, str) or not _GENERATION.search(template):
            raise _NotPrefix
        # transformers' own renderer, loaded only for a marked template: it returns the marked character spans
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, spans = render_jinja_template(
            [_chat_messages(turns)],
            chat_template=template,
            return_assistant_tokens_mask=True,
            **{**self.tokenizer.special_tokens_map, **self.template_kwargs},
        )
        full, spans = rendered[0], sorted(spans[0])
        replies = [t for t in turns if t.role == "assistant"]
        if full != self.render(turns, add_generation_prompt=False) or len(spans) != len(replies):
            raise _NotPrefix
        pieces: list[tuple[str, bool]] = []
        done = 0
        for (start, end), turn in zip(_on_token_bounds(self.tokenizer, full, spans), replies):
            if self.eos_text and not full[start:end].endswith(self.eos_text) and full.startswith(self.eos_text, end):
                end += len(self.eos_text)
            pieces += [(full[done:start], False), (full[start:end], turn.trained)]
            done = end
        pieces.append((full[done:], False))
        return [p for p in pieces if p[0]]

    def _prompt_and_last_reply(self, turns: list[Turn], where: str) -> list[tuple[str, bool]]:
        """The render up to the last reply's generation prompt (earlier replies in it, untrained) and the reply."""
        last = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        prompt = self.render(turns[:last], add_generation_prompt=True)
        full = self.render(turns[: last + 1], add_generation_prompt=False)
        if last < 1 or not full.startswith(prompt) or not full[len(prompt) :].strip():
            raise DataError(
                f"{where}: the chat template does not render this conversation as a prompt followed by its last "
                "reply (does it end with an assistant turn after a user turn?)"
            )
        return [(prompt, False), (full[len(prompt) :], turns[last].trained)]

    def _pieces_from_whole(self, turns: list[Turn], where: str) -> list[tuple[str, bool]]:
        """One render of the whole conversation; each reply from where the render up to its generation prompt
        stops agreeing with it, to the reply-end token."""
        full = self.render(turns, add_generation_prompt=False)
        pieces: list[tuple[str, bool]] = []
        done = 0
        for i, t in enumerate(turns):
            if t.role != "assistant":
                continue
            prompt = self.render(turns[:i], add_generation_prompt=True)
            start = len(os.path.commonprefix([prompt, full]))
            end = full.find(self.eos_text, start) if self.eos_text else -1
            if i == 0 or start < done or end < 0 or not full[start:end].strip():
                raise DataError(
                    f"{where}: the chat template does not render this conversation so that each assistant reply "
                    "can be found (does it start with an assistant turn?)"
                )
            end += len(self.eos_text)
            pieces += [(full[done:start], False), (full[start:end], t.trained)]
            done = end
        if full[done:]:
            pieces.append((full[done:], False))
        return [p for p in pieces if p[0]]

    def _pieces_by_prefix(self, turns: list[Turn]) -> list[tuple[str, bool]]:
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, t in enumerate(turns):
            if t.role != "assistant":
                continue
            prompt = self.render(turns[:i], add_generation_prompt=True)
            full = self.render(turns[: i + 1], add_generation_prompt=False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise _NotPrefix
            pieces.append((prompt[len(done) :], False))
            reply = full[len(prompt) :]
            end = reply.find(self.eos_text) if self.eos_text else -1
            if end < 0 and self.append_end:
                # the reply ends where the next turn's role token begins: trained here, left out of the next
                # prompt piece (a next prompt that does not begin with it fails the prefix test above)
                pieces.append((reply + self.eos_text, t.trained))
                done = full + self.eos_text
                continue
            cut = end + len(self.eos_text) if end >= 0 else len(reply)
            pieces.append((reply[:cut], t.trained))
            if reply[cut:]:
                pieces.append((reply[cut:], False))
            done = full
        return pieces

    # --- the family's image inputs ----------------------------------------------------------------------------
    def _media(self, record: Record, decode: bool) -> Media:
        """The record's images (decoded, or only their sizes) and clips, after refusing what the family lacks."""
        if record.images and self.images is None:
            raise DataError(
                f"{record.where}: images are not supported for the {self.family.name} family (it "
                "declares no image_inputs)"
            )
        if record.videos and self.family.video_inputs is None:
            raise DataError(
                f"{record.where}: videos are not supported for the {self.family.name} family (it "
                "declares no video_inputs)"
            )
        if decode:
            images = [load_image(s) for s in record.images]
            sizes = [img.size for img in images]
        else:  # measuring: the sizes alone (recorded, or read from the file headers)
            images = None
            sizes = record.image_sizes if record.image_sizes is not None else [header_size(s) for s in record.images]
        return Media(list(sizes), images, self._clips(record), record.where)

    def _clips(self, record: Record) -> list:
        """Each clip's frames ``[T, C, H, W]`` at this run's rate, with the rate (decoding is the only way to know a
        clip's frame count at this rate, so measuring decodes too)."""
        clips = []
        for path in record.videos:
            try:
                frames, rate = read_frames(path, self.video_fps, self.video_max_frames)
            except VideoError as e:
                raise DataError(f"{record.where}: video '{path}' cannot be read ({e})") from None
            clips.append((torch.from_numpy(frames).permute(0, 3, 1, 2), rate))
        return clips

    def _prepare(self, media: Media):
        if self.images is None:
            return None
        return self.family.call("image_inputs.prepare", self.images.prepare, self.processor, media, self.max_pixels)

    def _write(self, pieces: list[tuple[str, bool]], prepared) -> tuple[list[int], list[int], dict, list]:
        """(input_ids, labels, the sample's extra model inputs, grids) of rendered pieces over prepared media."""
        texts = [text for text, _ in pieces]
        if self.images is None:
            written = Written(tokenize_pieces(self.tokenizer, texts))
        else:
            written = self.family.call("image_inputs.write", self.images.write, self.processor, texts, prepared)
        input_ids: list[int] = []
        labels: list[int] = []
        for ids, (_, trained) in zip(written.ids, pieces):
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
        return input_ids, labels, dict(written.inputs), list(written.grids)

    def measure(self, record: Record) -> tuple[int, list[tuple[int, int, int]]]:
        """(tokens, image grids) of a record as ``encode`` would make it, image tokens included."""
        n, grids, _ = self.measure_labelled(record)
        return n, grids

    def measure_labelled(self, record: Record) -> tuple[int, list[tuple[int, int, int]], int]:
        """``measure`` and the number of label tokens the loss counts (the positions the head runs at)."""
        input_ids, labels, _, grids = self._write(
            self.pieces(record.turns, record.where), self._prepare(self._media(record, decode=False))
        )
        return len(input_ids), grids, sum(1 for x in labels[1:] if x != IGNORE_INDEX)

    def encode(self, record: Record) -> dict:
        """Training inputs: input_ids and labels (1-D), plus the family's image inputs."""
        return self.encode_conversations(record, [record.turns])[0]

    def encode_conversations(self, record: Record, conversations: list[list[Turn]]) -> list[dict]:
        """``encode`` for each of ``conversations`` (turn lists over ``record``'s images and videos, in the same
        placeholder order): the media are prepared once and what they give shared by every sample."""
        prepared = self._prepare(self._media(record, decode=True))
        out = []
        for turns in conversations:
            input_ids, labels, extra, _ = self._write(self.pieces(turns, record.where), prepared)
            out.append({"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels), **extra})
        return out

    def encode_prompt(self, record: Record) -> dict:
        """Generation inputs: the conversation up to its last assistant reply."""
        last = max(i for i, t in enumerate(record.turns) if t.role == "assistant")
        prompt = self.render(record.turns[:last], add_generation_prompt=True)
        input_ids, _, extra, _ = self._write([(prompt, False)], self._prepare(self._media(record, decode=True)))
        return {"input_ids": torch.tensor(input_ids), **extra}


class EncodedDataset(torch.utils.data.Dataset):
    """Records encoded on access, so DataLoader workers share the work."""

    def __init__(self, records: Sequence[Record], encoder: SampleEncoder):  # a list or data.lazy rows
        self.records = records
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        return self.encoder.encode(self.records[index])
