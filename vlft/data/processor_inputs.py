"""The image inputs of a family whose processor writes each image's tokens itself (``processor_image_inputs``,
re-exported by ``vlft``): the processor called per rendered piece, its outputs kept as the family declares.

Imports inside functions: torch and PIL load when a record is encoded, not when a family plugin builds its
answer at import."""

from __future__ import annotations

from functools import partial

from vlft.contracts.family import ImageInputs, Media, Written
from vlft.errors import DataError


# params: a builder of ImageInputs, every optional part of which a family names by keyword
def processor_image_inputs(
    batch_inputs: dict,
    pixels: str = "pixel_values",
    size_cap: str = "",
    grid=None,
    patch_size: int = 0,
    patches_per_token: int = 1,
    trace=None,
    processor_kwargs=None,
    reshape=None,
    image_grids=None,
) -> ImageInputs:
    """``ImageInputs`` for a family whose processor writes each image's token sequence into the text
    (``processor(text=, images=)``, e.g. Gemma 3's ``<start_of_image><image_soft_token>*N<end_of_image>``): the
    processor is called once per rendered piece with that piece's images (those of its ``processor.image_token``
    placeholders), and the outputs ``batch_inputs`` names are kept: 'sequence' ones laid end to end over the
    pieces (0 where a piece has none), the others joined as a batch joins them ('concat' along dim 0,
    'concat_padded' padded first, 'concat_last' along the last dim). Measuring processes blank images of the
    recorded sizes (no pixels decoded). ``grid(height, width, max_pixels)``, where given, is each image's patch
    grid (the processor writes none): the memory plan counts its patches and, with ``trace``, traces the tower;
    without it the plan says it counted no vision activations.

    Three optional callables for a processor that needs more: ``processor_kwargs(processor, max_pixels) -> dict``,
    the keyword arguments of every processor call of a record with images under ``--max-pixels`` (the family's own
    cap, as its processor takes it: SmolVLM's tile edge, GLM-4.1V's pixel budget, Gemma 4's soft-token budget; it
    comes with ``size_cap``, the cap in words, and may raise ``vlft.errors.ConfigError`` for a cap the family cannot
    meet; ``grid`` then gets ``max_pixels`` too); ``reshape(name, tensor) -> tensor``, each kept output as the batch joins
    it (SmolVLM's ``[1, tiles, ...]`` pixels as ``[tiles, 1, ...]``, so 'concat' joins samples of any tile count);
    ``image_grids(processor, sizes, max_pixels) -> [(t, h, w), ...]``, each image's grid from the processor's own
    numbers, where ``grid`` (which has no processor) cannot give it.

    Clips (a record's videos, where the family declares ``video_inputs``) go the same way: each piece's
    ``processor.video_token`` placeholders take the next clips, passed as the frames vlft sampled
    (``do_sample_frames=False``, with each frame's time in ``video_metadata``), and the processor writes their
    tokens and returns their inputs."""
    if (processor_kwargs is None) != (not size_cap):
        raise ValueError(
            "processor_image_inputs: size_cap (what --max-pixels means, in words) and processor_kwargs "
            "(how the cap reaches the processor) come together"
        )
    return ImageInputs(
        prepare=partial(_processor_prepare, processor_kwargs),
        write=partial(_processor_write, dict(batch_inputs), grid, reshape, image_grids),
        batch_inputs=dict(batch_inputs),
        pixels=pixels,
        size_cap=size_cap,
        grid=grid,
        patch_size=patch_size,
        patches_per_token=patches_per_token,
        trace=trace,
    )


def _processor_prepare(processor_kwargs, processor, media: Media, max_pixels=None):
    from PIL import Image

    images = media.images if media.images is not None else [Image.new("RGB", size) for size in media.sizes]
    clips = list(media.videos)
    if processor_kwargs is None or max_pixels is None:
        return images, media.where, None, {}, clips
    return images, media.where, max_pixels, dict(processor_kwargs(processor, max_pixels)), clips


def _processor_write(wanted: dict, grid, reshape, image_grids, processor, texts: list[str], prepared) -> Written:
    import torch

    left, where, max_pixels, kwargs = list(prepared[0]), prepared[1], prepared[2], prepared[3]
    clips = list(prepared[4]) if len(prepared) > 4 else []
    placeholder = processor.image_token or ""
    ids_per_text: list[list[int]] = []
    sequences: dict[str, list] = {k: [] for k, how in wanted.items() if how == "sequence"}
    stacked: dict[str, list] = {k: [] for k, how in wanted.items() if how != "sequence"}
    for k, text in enumerate(texts):
        n = text.count(placeholder) if placeholder else 0
        if n > len(left):
            raise DataError(f"{where}: the rendered conversation has more image placeholders than images")
        mine, left = left[:n], left[n:]
        videos, clips = _piece_clips(processor, text, clips, where)
        if mine and videos:
            _refuse_shared_pixels(processor, where)
        out = processor(
            text=[text],
            images=[mine] if mine else None,
            add_special_tokens=(k == 0),
            return_tensors="pt",
            **(kwargs if mine else {}),
            **videos,
        )
        ids = out["input_ids"][0].tolist()
        ids_per_text.append(ids)
        for key, parts in sequences.items():
            parts.append(out[key][0] if key in out else torch.zeros(len(ids), dtype=torch.long))
        for key, parts in stacked.items():
            if key in out:
                value = widened(out[key])
                parts.append(reshape(key, value) if reshape is not None else value)
    if left or clips:
        what = f"{len(left)} image(s)" if left else f"{len(clips)} video(s)"
        raise DataError(f"{where}: {what} have no placeholder in the rendered conversation")
    extra = {key: torch.cat(parts) for key, parts in sequences.items() if parts}
    from vlft.data.batching import join_images  # torch's: loaded when a record is encoded (the module docstring)

    extra.update({key: join_images(parts, wanted[key]) for key, parts in stacked.items() if parts})
    if image_grids is not None:
        grids = [tuple(g) for g in image_grids(processor, [img.size for img in prepared[0]], max_pixels)]
    elif grid is not None:
        grids = [tuple(grid(img.size[1], img.size[0], max_pixels)) for img in prepared[0]]
    else:
        grids = []
    return Written(ids_per_text, extra, grids)


def widened(value):
    """A processor output as the model takes it on any precision: half-precision floats in fp32 (an image
    processor may normalise in bfloat16, as an original implementation did, and a fp32 model without autocast
    cannot take those; autocast and the towers' own casts narrow fp32 again), anything else as it is."""
    import torch

    half = torch.is_tensor(value) and value.dtype in (torch.bfloat16, torch.float16)
    return value.float() if half else value


def _piece_clips(processor, text: str, clips: list, where: str) -> tuple[dict, list]:
    """The processor's video arguments for one rendered piece (the clips of its ``processor.video_token``
    placeholders), and the clips left for the pieces after it. A record reaches here with clips only where its
    family declares ``video_inputs``."""
    token = getattr(processor, "video_token", None) or ""
    n = text.count(token) if token and clips else 0
    if n > len(clips):
        raise DataError(f"{where}: the rendered conversation has more video placeholders than videos")
    return (clip_arguments(clips[:n]) if n else {}), clips[n:]


def _refuse_shared_pixels(processor, where: str) -> None:
    """A processor whose video processor returns its frames under the image processor's names (SmolVLM2's
    ``pixel_values``) keeps only the clip's when one call has both (transformers merges the two outputs by
    name): refused, with the way round it, rather than a feature count that fails inside the model."""
    shared = set(getattr(processor.video_processor, "model_input_names", ())) & set(
        getattr(processor.image_processor, "model_input_names", ())
    )
    if shared:
        raise DataError(
            f"{where}: a turn holds both an image and a video, and {type(processor).__name__} returns both "
            f"under {sorted(shared)}, so one would be lost: put the image and the video in different turns"
        )


def clip_arguments(clips: list) -> dict:
    """A processor's video arguments for clips of (frames ``[T, C, H, W]``, the rate they were sampled at): the
    frames vlft sampled at the run's ``--video-fps`` (the processor must not sample again), and where each frame
    lies in time (the processors that write timestamps between frames, GLM-4.1V's and SmolVLM2's, read them
    from ``video_metadata``)."""
    metadata = [
        {"total_num_frames": len(f), "fps": rate, "frames_indices": list(range(len(f))), "duration": len(f) / rate}
        for f, rate in clips
    ]
    return {"videos": [f for f, _ in clips], "do_sample_frames": False, "video_metadata": metadata} if clips else {}
