"""From a validated record to model inputs: chat-template rendering, assistant-only labels, image
tensors (lengths: ``data.lengths``; batches: ``data.batching``).

Labels: only assistant replies count in the loss. The mask comes from
rendering the conversation prefix by prefix with the processor's own chat
template and tokenising the pieces, so it needs no token ids of any
particular tokenizer. Templates that render earlier turns differently once
later turns follow (thinking templates drop earlier replies' reasoning
blocks) are split from one render of the whole conversation instead: each
reply starts where the render up to its generation prompt stops agreeing
with the whole, and ends at the family's reply-end token.

What is model-specific (the image grid rule, the reply-end token, extra
template arguments, who writes an image's tokens) comes from the ``ModelFamily``.
Image tokens: by default the encoder repeats the processor's ``image_token``
once per LLM token of the image grid; a family whose processor writes its own
image token sequence (``processor_expands_placeholders``) is encoded by calling
the processor on each rendered piece, keeping the outputs the family's
``batch_inputs`` names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch
from PIL import Image

from vlft.data.records import IGNORE_INDEX, IMAGE_PLACEHOLDER, Record, Turn, image_file_or_bytes, load_image
from vlft.data.video import VideoError, read_frames
from vlft.errors import DataError


class _NotPrefix(Exception):
    """The template does not render the conversation prefix by prefix."""


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


class SampleEncoder:
    """Turns a Record into model inputs with assistant-only labels.

    ``processor`` is a transformers multimodal processor (a tokenizer, an
    image processor and a chat template). ``max_pixels`` caps each image's
    pixel count through the image processor's own resize.
    """

    def __init__(self, processor, max_pixels: int | None = None, video_fps: float = 2.0, video_max_frames: int = 16,
                 family=None):
        self.processor = processor
        self.family = family
        self.template_kwargs = dict(family.chat_template_kwargs) if family is not None else {}
        self.tokenizer = processor.tokenizer
        self.image_token = processor.image_token
        self.video_token = getattr(processor, "video_token", None)
        self.video_fps, self.video_max_frames = video_fps, video_max_frames
        self.expands = bool(family is not None and family.processor_expands_placeholders)
        self.merge_length = getattr(processor.image_processor, "merge_size", 1) ** 2
        self.eos_text = (family.reply_end_token if family is not None else "") or self.tokenizer.eos_token
        self.image_kwargs: dict = {}
        # a pixel budget caps the image processor's resize; a processor with a fixed size has none to cap
        if max_pixels is not None and "longest_edge" in (getattr(processor.image_processor, "size", None) or {}):
            ip_size = dict(processor.image_processor.size)
            ip_size["longest_edge"] = max_pixels
            ip_size["shortest_edge"] = min(ip_size.get("shortest_edge", max_pixels), max_pixels)
            self.image_kwargs["size"] = ip_size
        self._grids: dict[tuple[int, int], tuple[int, int, int]] = {}  # image size -> patch grid

    def render(self, turns: list[Turn], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            _chat_messages(turns), tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def pieces(self, turns: list[Turn], where: str = "") -> list[tuple[str, bool]]:
        """The rendered conversation as (text, trained) pieces, in order."""
        try:
            return self._pieces_by_prefix(turns)
        except _NotPrefix:
            return self._pieces_from_whole(turns, where)

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
            pieces.append((prompt[len(done):], False))
            reply = full[len(prompt):]
            end = reply.find(self.eos_text) if self.eos_text else -1
            cut = end + len(self.eos_text) if end >= 0 else len(reply)
            pieces.append((reply[:cut], t.trained))
            if reply[cut:]:
                pieces.append((reply[cut:], False))
            done = full
        return pieces

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid the image processor makes of an image of this size, without decoding it.
        Remembered per size: a data set holds few sizes, and without a family's formula the answer costs a
        run of the image processor on a blank image (57% of measuring a record, profiled)."""
        grid = self._grids.get((width, height))
        if grid is None:
            grid = self._grids[(width, height)] = self._image_grid(width, height)
        return grid

    def _image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        ip = self.processor.image_processor
        size = self.image_kwargs.get("size", ip.size)
        if self.family is not None and self.family.image_grid is not None:
            return tuple(self.family.image_grid(height, width, min_pixels=size["shortest_edge"],
                                                max_pixels=size["longest_edge"]))
        out = ip(images=[Image.new("RGB", (width, height))], return_tensors="pt", **self.image_kwargs)
        return tuple(int(x) for x in out["image_grid_thw"][0])

    def measure(self, record: Record) -> tuple[int, list[tuple[int, int, int]]]:
        """(tokens, image grids) of a record as ``encode`` would make it, image tokens included."""
        n, grids, _ = self.measure_labelled(record)
        return n, grids

    def measure_labelled(self, record: Record) -> tuple[int, list[tuple[int, int, int]], int]:
        """``measure`` and the number of label tokens the loss counts (the positions the head runs at)."""
        sizes = record.image_sizes
        if sizes is None:
            sizes = []
            for source in record.images:
                with Image.open(image_file_or_bytes(source)) as img:
                    sizes.append(img.size)
        if self.expands:  # the processor's count: blank images of the recorded sizes (no grid to report)
            self._no_videos(record)
            input_ids, labels, _ = self._tokenize_expanded(self.pieces(record.turns, record.where),
                                                           [Image.new("RGB", size) for size in sizes], record.where)
            return len(input_ids), [], sum(1 for x in labels[1:] if x != IGNORE_INDEX)
        grids = [self.image_grid(w, h) for w, h in sizes]
        counts = torch.tensor(grids) if grids else None
        video = self._videos(record)  # decoding is the only way to know a clip's frame count at this rate
        video_grids = [tuple(int(x) for x in g) for g in video.get("video_grid_thw", [])]
        input_ids, labels = self._tokenize(self.pieces(record.turns, record.where), counts,
                                           video.get("video_grid_thw"))
        return len(input_ids), grids + video_grids, sum(1 for x in labels[1:] if x != IGNORE_INDEX)

    def _images(self, record: Record) -> dict:
        if not record.images:
            return {}
        out = self.processor.image_processor(
            images=[load_image(s) for s in record.images], return_tensors="pt", **self.image_kwargs
        )
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def _videos(self, record: Record) -> dict:
        if not record.videos:
            return {}

        clips, rates = [], []
        for path in record.videos:
            try:
                frames, rate = read_frames(path, self.video_fps, self.video_max_frames)
            except VideoError as e:
                raise DataError(f"{record.where}: video '{path}' cannot be read ({e})") from None
            clips.append(torch.from_numpy(frames).permute(0, 3, 1, 2))
            rates.append(rate)
        vp = self.processor.video_processor
        # frames are already sampled here, at the rate in ``rates``; the processor must not sample again
        out = vp(videos=clips, return_tensors="pt", do_sample_frames=False, **self.image_kwargs)
        seconds = torch.tensor([vp.temporal_patch_size / r for r in rates], dtype=torch.float32)
        return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"],
                "second_per_grid_ts": seconds}

    def _tokenize(self, pieces: list[tuple[str, bool]], grid_thw, video_grid_thw=None) -> tuple[list[int], list[int]]:
        def tokens(grids):
            return iter([int(g.prod()) // self.merge_length for g in grids] if grids is not None else [])

        counts = {self.image_token: tokens(grid_thw), self.video_token: tokens(video_grid_thw)}
        pads = re.compile("|".join(re.escape(t) for t in counts if t))
        input_ids: list[int] = []
        labels: list[int] = []
        texts = [pads.sub(lambda m: m.group(0) * next(counts[m.group(0)]), text) for text, _ in pieces]
        # one tokenizer call for the first piece (special tokens) and one for the rest: the same ids as a call each
        encoded = self.tokenizer(texts[:1], add_special_tokens=True)["input_ids"] if texts else []
        if len(texts) > 1:
            encoded += self.tokenizer(texts[1:], add_special_tokens=False)["input_ids"]
        for ids, (_, trained) in zip(encoded, pieces):
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
        return input_ids, labels

    def _no_videos(self, record: Record) -> None:
        if record.videos:
            raise DataError(f"{record.where}: videos are not supported for the {self.family.name} family (its "
                            "processor writes its own image tokens; vlft reads video only where it writes them)")

    def _tokenize_expanded(self, pieces: list[tuple[str, bool]], images: list, where: str = ""):
        """(input_ids, labels, extra inputs) with the processor writing each image's tokens: one processor call
        per rendered piece with that piece's images, in order. The extra inputs are the outputs the family's
        ``batch_inputs`` names: 'sequence' ones concatenated along the tokens (1-D, aligned with input_ids),
        'concat' ones along dim 0."""
        wanted = self.family.batch_inputs
        placeholder = self.image_token or ""
        left = list(images)
        input_ids: list[int] = []
        labels: list[int] = []
        sequences: dict[str, list[torch.Tensor]] = {k: [] for k, how in wanted.items() if how == "sequence"}
        stacked: dict[str, list[torch.Tensor]] = {k: [] for k, how in wanted.items() if how == "concat"}
        for k, (text, trained) in enumerate(pieces):
            n = text.count(placeholder) if placeholder else 0
            if n > len(left):
                raise DataError(f"{where}: the rendered conversation has more image placeholders than images")
            mine, left = left[:n], left[n:]
            out = self.processor(text=[text], images=[mine] if mine else None, add_special_tokens=(k == 0),
                                 return_tensors="pt", **self.image_kwargs)
            ids = out["input_ids"][0].tolist()
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
            for key, parts in sequences.items():
                parts.append(out[key][0] if key in out else torch.zeros(len(ids), dtype=torch.long))
            for key, parts in stacked.items():
                if key in out:
                    parts.append(out[key])
        if left:
            raise DataError(f"{where}: {len(left)} image(s) have no placeholder in the rendered conversation")
        extra = {key: torch.cat(parts) for key, parts in (*sequences.items(), *stacked.items()) if parts}
        return input_ids, labels, extra

    def encode(self, record: Record) -> dict:
        """Training inputs: input_ids and labels (1-D), plus the image tensors."""
        if self.expands:
            self._no_videos(record)
            input_ids, labels, extra = self._tokenize_expanded(
                self.pieces(record.turns, record.where), [load_image(s) for s in record.images], record.where)
            return {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels), **extra}
        vision = {**self._images(record), **self._videos(record)}
        input_ids, labels = self._tokenize(self.pieces(record.turns, record.where), vision.get("image_grid_thw"),
                                           vision.get("video_grid_thw"))
        return {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels), **vision}

    def encode_conversations(self, record: Record, conversations: list[list[Turn]]) -> list[dict]:
        """``encode`` for each of ``conversations`` (turn lists over ``record``'s images and videos, in the same
        placeholder order): the images and videos are processed once and their tensors shared by every sample.
        A family whose processor writes the image tokens processes them once per conversation."""
        if self.expands:
            return [self.encode(Record(turns, record.images, record.where, record.id, record.image_sizes))
                    for turns in conversations]
        vision = {**self._images(record), **self._videos(record)}
        out = []
        for turns in conversations:
            input_ids, labels = self._tokenize(self.pieces(turns, record.where), vision.get("image_grid_thw"),
                                               vision.get("video_grid_thw"))
            out.append({"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels), **vision})
        return out

    def encode_prompt(self, record: Record) -> dict:
        """Generation inputs: the conversation up to its last assistant reply."""
        last = max(i for i, t in enumerate(record.turns) if t.role == "assistant")
        prompt = self.render(record.turns[:last], add_generation_prompt=True)
        if self.expands:
            self._no_videos(record)
            input_ids, _, extra = self._tokenize_expanded([(prompt, False)], [load_image(s) for s in record.images],
                                                          record.where)
            return {"input_ids": torch.tensor(input_ids), **extra}
        vision = {**self._images(record), **self._videos(record)}
        input_ids, _ = self._tokenize([(prompt, False)], vision.get("image_grid_thw"), vision.get("video_grid_thw"))
        return {"input_ids": torch.tensor(input_ids), **vision}


class EncodedDataset(torch.utils.data.Dataset):
    """Records encoded on access, so DataLoader workers share the work."""

    def __init__(self, records: Sequence[Record], encoder: SampleEncoder):  # a list or data.lazy rows
        self.records = records
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        return self.encoder.encode(self.records[index])
