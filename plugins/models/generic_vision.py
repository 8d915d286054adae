"""``--max-pixels``, the memory plan's vision count and the vision trace for the generic family (generic.py), read
from the checkpoint's processor and module tree.

- ``--max-pixels``: what a user expects is that no image is fed larger than the cap. Blank probe images of two
  sizes go through the processor: where both give the same number of image tokens, the processor resizes every
  image to a fixed size and the cap changes nothing (the description says so); where the count grows with the
  image, the processor keeps its size (dynamic resolution), and each image is scaled down to the budget, aspect
  ratio kept, before the processor, so its image tokens fall with it.
- The vision count: each image's image tokens as the processor writes them for a blank image of its size (as
  capped), the grid (1, 1, tokens); each clip's video tokens, the grid (frames, 1, tokens per frame).
- The trace: the vision tower's own forward on the meta device, on the processor's inputs for an image of each
  counted size (its float inputs as meta tensors of their shapes, the rest as they are), each block wrapped so
  the memory plan counts it. Tried once at read time on the probe image: a tower that does not run on the meta
  device (a data-dependent step) is left untraced, and the description says why. The projector outside the
  tower is not traced.

Imports inside functions: torch and PIL load only when a checkpoint is read or a record is encoded.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

from vlft import ImageInputs, processor_image_inputs

from .llava_onevision import capped_size

PROBE_SIDES = (16, 512)  # the two blank square probe images that tell a fixed-size processor from a dynamic one


class _Counted:
    """The processor's image inputs and token count per image size, kept for the trace (one per token count:
    the trace receives grids, and a grid is its image's token count)."""

    def __init__(self):
        self.by_size: dict[tuple[int, int], int] = {}
        self.inputs: dict[int, dict] = {}

    def tokens(self, processor, size: tuple[int, int]) -> int:
        if size not in self.by_size:
            count, inputs = _image_tokens(processor, size)
            self.by_size[size] = count
            self.inputs.setdefault(count, inputs)
        return self.by_size[size]


def _token_id(processor, token: str) -> int:
    return int(processor.tokenizer.convert_tokens_to_ids(token))


def _image_tokens(processor, size: tuple[int, int]) -> tuple[int, dict]:
    """The image tokens the processor writes for one blank image of ``size`` (width, height), and the model inputs
    it returns for it (besides the text's)."""
    import torch
    from PIL import Image

    out = processor(text=[processor.image_token], images=[[Image.new("RGB", size)]], return_tensors="pt")
    count = int((out["input_ids"] == _token_id(processor, processor.image_token)).sum())
    inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)}
    return count, inputs


def _clip_grid(processor, clip) -> tuple[int, int, int]:
    """(frames, 1, video tokens per frame) of one clip (``[T, C, H, W]`` frames, their rate), as the processor
    writes its tokens; (1, 1, tokens) where the tokens do not split evenly over the frames."""
    from vlft import clip_arguments

    frames = int(clip[0].shape[0])
    token = processor.video_token
    out = processor(text=[token], return_tensors="pt", **clip_arguments([clip]))
    count = int((out["input_ids"] == _token_id(processor, token)).sum())
    return (frames, 1, count // frames) if count % frames == 0 else (1, 1, count)


def _size_cap(processor) -> tuple[str, Any]:
    """(what --max-pixels means in words, processor_kwargs) from two probe images' token counts."""
    counts = [_image_tokens(processor, (side, side))[0] for side in PROBE_SIDES]
    at = " and ".join(f"{side}x{side}" for side in PROBE_SIDES)
    if counts[0] == counts[1]:
        return (
            f"none in effect: the processor resizes every image to a fixed size ({counts[0]} image tokens at {at}), "
            "so --max-pixels changes nothing",
            lambda processor, max_pixels: {},
        )
    return (
        f"a pixel budget per image: scaled down first, aspect ratio kept, before the processor, which sizes an "
        f"image by its own size ({' and '.join(map(str, counts))} image tokens at {at}), so the image tokens fall with it",
        lambda processor, max_pixels: {},
    )


def image_inputs(processor, model, towers, joins: dict, pixels: str) -> tuple[ImageInputs, dict]:
    """The generic family's ImageInputs with its size cap, vision count and trace, and what was found."""
    found: dict[str, str] = {}
    try:
        size_cap, kwargs = _size_cap(processor)
    except Exception as e:  # noqa: BLE001 - a processor that cannot take a bare image token: no cap, said
        size_cap, kwargs = "", None
        found["max pixels"] = f"refused (the processor's token count per image size could not be read: {e})"
    else:
        found["max pixels"] = size_cap
    counted = _Counted()
    trace, why = _checked_trace(processor, model, towers, counted)
    found["vision count"] = "image tokens per image from the processor at each image's size (as capped), clips "
    found["vision count"] += "frames x tokens per frame, tower " + (f"traced ({why})" if trace else f"untraced ({why})")
    base = processor_image_inputs(
        joins,
        pixels=pixels,
        size_cap=size_cap,
        processor_kwargs=kwargs,
        image_grids=lambda proc, sizes, max_pixels=None: [(1, 1, counted.tokens(proc, tuple(s))) for s in sizes],
        trace=trace,
    )
    dynamic = size_cap.startswith("a pixel budget")

    def prepare(processor, media, max_pixels=None):
        if dynamic and max_pixels is not None:
            sizes = [capped_size(w, h, max_pixels) for w, h in media.sizes]
            images = media.images
            if images is not None:
                images = [img if img.size == size else img.resize(size) for img, size in zip(images, sizes)]
            media = replace(media, sizes=sizes, images=images)
        return base.prepare(processor, media, max_pixels)

    def write(processor, texts: list[str], prepared):
        written = base.write(processor, texts, prepared)
        clips = list(prepared[4]) if len(prepared) > 4 else []
        return replace(written, grids=[*written.grids, *(_clip_grid(processor, c) for c in clips)])

    return replace(base, prepare=prepare, write=write), found


def _checked_trace(processor, model, towers, counted: _Counted):
    """(the tracer, how) where the tower runs on the meta device on the probe image, else (None, why not)."""
    rel = towers.vision_blocks[len(towers.vision) + 1 :] if towers.vision_blocks.startswith(towers.vision + ".") else ""
    if not rel:
        return None, f"its blocks {towers.vision_blocks} lie outside the tower {towers.vision}"
    trace = _tracer(rel, counted)
    try:
        tokens = counted.tokens(processor, (PROBE_SIDES[0], PROBE_SIDES[0]))
        trace(model.get_submodule(towers.vision), [(1, 1, tokens)], next(model.parameters()).dtype, _plain)
    except Exception as e:  # noqa: BLE001 - any failure on the meta device: untraced, with the reason
        return None, f"its forward does not run on the meta device: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return trace, f"its forward on the meta device, the processor's inputs per image, each of {towers.vision_blocks}"


def _plain(module, fn, block_input=None):
    return fn()


def _tracer(blocks_path: str, counted: _Counted):
    def trace(tower, grids, dtype, run_block):
        """The tower's forward on the meta device once per image (its processor inputs at the counted size), each
        block run through ``run_block``; a grid the processor was not asked about (a clip's) is left out."""
        import torch

        blocks = list(tower.get_submodule(blocks_path))
        takes = inspect.signature(tower.forward).parameters
        out = None
        for t, h, w in grids:
            inputs = counted.inputs.get(w) if (t, h) == (1, 1) else None
            if inputs is None:
                continue
            args = {
                k: torch.empty(v.shape, device="meta", dtype=dtype) if v.is_floating_point() else v
                for k, v in inputs.items()
                if k in takes
            }
            if not any(v.is_floating_point() for v in args.values()):
                raise ValueError(f"the tower's forward takes none of the processor's pixel inputs ({sorted(inputs)})")
            with _wrapped(blocks, run_block):
                out = tower(**args)
        return _features(out)

    return trace


class _wrapped:
    """Each block's forward run through ``run_block(block, fn, block_input)`` while inside."""

    def __init__(self, blocks, run_block):
        self.blocks, self.run_block = blocks, run_block

    def __enter__(self):
        for block in self.blocks:
            original = block.forward

            def forward(*args, _b=block, _f=original, **kwargs):
                first = args[0] if args else kwargs.get("hidden_states")
                return self.run_block(_b, lambda: _f(*args, **kwargs), first)

            block.forward = forward
        return self

    def __exit__(self, *exc):
        for block in self.blocks:
            del block.forward
        return False


def _features(out):
    import torch

    if out is None or torch.is_tensor(out):
        return out
    hidden = getattr(out, "last_hidden_state", None)
    if torch.is_tensor(hidden):
        return hidden
    return out[0] if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]) else None
