"""LLaVA-OneVision (transformers ``llava_onevision``): SigLIP + a 2-layer projector + Qwen2, any-resolution tiles.

transformers 5.24 ``LlavaOnevisionForConditionalGeneration``: ``model.vision_tower`` (a ``SiglipVisionModel``
with no ``vision_model`` level in 5.x: ``encoder.layers[i]`` with ``self_attn.{q,k,v,out}_proj`` and ``mlp.fc1/fc2``),
``model.multi_modal_projector`` (``linear_1``, GELU, ``linear_2``: outside the tower), ``model.image_newline`` (a
bare Parameter, the text width: one per row of tiles), ``model.language_model.layers[i]`` (``Qwen2DecoderLayer``),
``lm_head``. Plain 1-D positions (no ``positions`` capability).

How an image becomes inputs (``LlavaOnevisionImageProcessor`` + ``LlavaOnevisionProcessor``):

- a record with ONE image: the best of ``image_grid_pinpoints`` for its size is chosen, the image resized and
  padded to it and cut into tiles of the tower's ``image_size``, plus one base tile of the whole image:
  ``pixel_values`` [1, tiles, 3, S, S]; its tokens are the base tile's (S/p)^2, then the tiles' features with
  the padding cut away ("unpadded") and one ``image_newline`` per row, downsampled when over
  ``anyres_max_9``'s budget (``processor._get_number_of_features``);
- a record with SEVERAL images: each image is padded to a square and becomes one base tile only, (S/p)^2 + 1
  tokens (the +1 an ``image_newline``); the processor knows this from the record's image count
  (``batch_num_images``), and so must the model: ``batch_num_images`` is a model input, or the model tiles
  each image as a single one and its feature count no longer matches the tokens.

So the tokens of an image depend on the other images of its record, not on its own text piece: this family
writes its own image inputs (``prepare`` runs the image processor on all of a record's images at once, as
the processor does on a whole conversation; ``write`` repeats ``<image>`` by the processor's own count), not
``vlft.processor_image_inputs`` (which calls the processor per rendered piece: a record with an image in each
of two turns would be tiled as two single images). ``pixel_values`` carries a tile count that differs by
image size: the batch joins it as 'concat_padded' (the model reads ``pixel_values[i, :tiles_i]``, tiles_i from
``image_sizes`` and the config's pinpoints, so zero tiles past it are never seen).

``--max-pixels`` (``size_cap``): each image is first scaled down, aspect ratio kept, to at most that many
pixels; the pinpoint the tiling picks, the tile count and the tokens fall with it (the model config's pinpoints
are unchanged: the model and the processor read the same smaller ``image_sizes``).

Video (``LlavaOnevisionVideoProcessor``, the model's ``get_video_features``): the clips vlft sampled at
``--video-fps`` / ``--video-max-frames`` go through the video processor as they are (``do_sample_frames=False``):
each frame resized to one tile, ``pixel_values_videos`` [1, frames, 3, S, S] per clip; the model runs the tower on
every frame, pools each frame's (S/p)^2 features 2 x 2 (bilinear, sides rounded up) and appends one
``image_newline`` per clip, so a clip is ``frames x ceil(S/p/2)^2 + 1`` ``<video>`` tokens (the processor's
``replace_video_token`` count). The batch joins clips along dim 0, so the clips of one batch must have the same
frame count (every clip at least ``--video-max-frames / --video-fps`` seconds long has the cap's count).

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is
built or loaded, or a run builds its dummy image.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vlft import Chat, ModelFamily, Packing, Sharding, Targets, Tiny, Towers, VideoInputs

from . import _tiny
from .family import GATED_MLP, SIGLIP_ATTENTION, SIGLIP_MLP, TEXT_ATTENTION

NAME = "llava-onevision"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]

# 56 px tiles of 14 px patches (16 tokens a tile); pinpoints up to 2 x 2 tiles, so the demo's 112 px images
# become 4 tiles + the base tile at full resolution: 16 + 8 x 8 + 8 newlines = 88 tokens. Measured on the demo
# task (`vlft run --model embedded:llava-onevision --steps 300 --lr 3e-3`): loss 6.06 -> 0.54, exact match 62%
# (colour 100%, defect 62%), against exact match 20% (defect 20%) with 32 px tiles of 8 px patches (the 112 px
# image then shrunk to 64 px)
RECIPE: dict[str, Any] = {
    "version": 1,
    "family": NAME,
    "seed": 1234,
    "vocab_size": 512,
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    ),
    "vision": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=14,
        image_size=56,
        vision_use_head=False,
    ),
    "image_grid_pinpoints": [[56, 56], [56, 112], [112, 56], [112, 112]],
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}


# --- image inputs ----------------------------------------------------------------------------------------------


def capped_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """(width, height) of an image after ``--max-pixels``: scaled down, aspect ratio kept, to at most
    ``max_pixels`` pixels (each side at least 1); unchanged when it fits or with no cap."""
    if max_pixels is None or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def _tile_side(processor) -> int:
    size = processor.image_processor.size
    return int(size["height"] if size.get("height") else size["shortest_edge"])


def _tiles(processor, height: int, width: int, several: bool) -> int:
    """Tiles the tower runs for one image (the base tile included): the model's own count."""
    if several:
        return 1
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    return image_size_to_num_patches(
        (height, width), processor.image_processor.image_grid_pinpoints, _tile_side(processor)
    )


def _tokens(processor, height: int, width: int, several: bool) -> int:
    """``<image>`` tokens of one image, as LlavaOnevisionProcessor.replace_image_token counts them."""
    side = _tile_side(processor)
    if several:
        n = processor.num_image_tokens + 1  # the base tile and one image_newline
    else:
        n = processor._get_number_of_features(height, width, side, side)
    return n - 1 if processor.vision_feature_select_strategy == "default" else n


def _video_tokens(processor, frames: int) -> int:
    """``<video>`` tokens of a clip of ``frames`` frames, as LlavaOnevisionProcessor.replace_video_token counts
    them: each frame's tile pooled 2 x 2 (sides rounded up), and one image_newline."""
    pooled = math.ceil(math.isqrt(processor.num_image_tokens) / 2)
    return frames * pooled * pooled + 1


def prepare_clips(processor, clips: list, where: str) -> dict:
    """The clips vlft sampled through the video processor as they are (no sampling again):
    ``pixel_values_videos`` [clips, frames, 3, S, S], and each clip's ``<video>`` token count and frames."""
    if not clips:
        return {"inputs": {}, "video_tokens": [], "frames": []}
    import torch

    from vlft import DataError

    pixels = [
        processor.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)["pixel_values_videos"]
        for frames, _ in clips
    ]
    frames = [int(p.shape[1]) for p in pixels]
    if len(set(frames)) > 1:  # the model takes one [clips, frames, ...] tensor
        raise DataError(
            f"{where}: the record's clips give {frames} frames at this --video-fps; LLaVA-OneVision takes a "
            "record's clips as one tensor, so they need the same count: lower --video-max-frames to the shortest"
        )
    return {
        "inputs": {"pixel_values_videos": torch.cat(pixels)},
        "video_tokens": [_video_tokens(processor, n) for n in frames],
        "frames": frames,
    }


def prepare(processor, media, max_pixels=None) -> dict:
    """All of a record's images through the image processor at once (``images=[[...]]``, as the processor
    takes a conversation's), after ``--max-pixels``; from the sizes alone when measuring. Its clips through the
    video processor (``prepare_clips``)."""
    import torch

    sizes = [capped_size(w, h, max_pixels) for w, h in media.sizes]
    clips = prepare_clips(processor, list(media.videos), media.where)
    out = {"inputs": dict(clips["inputs"]), "sizes": [(h, w) for w, h in sizes], "where": media.where}
    out["video_tokens"], out["frames"] = clips["video_tokens"], clips["frames"]
    if media.images:
        images = [img if img.size == size else img.resize(size) for img, size in zip(media.images, sizes)]
        done = processor.image_processor(images=[images], return_tensors="pt")
        out["inputs"].update(
            pixel_values=done["pixel_values"],
            image_sizes=done["image_sizes"],
            batch_num_images=torch.as_tensor(done["batch_num_images"]).reshape(-1),
        )
        out["sizes"] = [tuple(int(x) for x in s) for s in done["image_sizes"]]
    return out


def write(processor, texts: list[str], prepared: dict):
    """Each ``<image>`` repeated by its image's token count (in placeholder order over the pieces), the pieces
    tokenized; the record's pixels, sizes and image count; one grid per image: (tiles, S/p, S/p)."""
    from vlft import Written, tokenize_pieces

    sizes = prepared["sizes"]
    several = len(sizes) > 1
    out = list(texts)
    for token, counts, what in (
        (processor.image_token, [_tokens(processor, h, w, several) for h, w in sizes], "image"),
        (processor.video_token, prepared.get("video_tokens", []), "video"),
    ):
        out = _expand(out, token, iter(counts), what, prepared["where"])
    per_tile = math.isqrt(processor.num_image_tokens)  # a tile's patches a side: (S/p)^2 tokens a tile
    grids = [(_tiles(processor, h, w, several), per_tile, per_tile) for h, w in sizes]
    grids += [(frames, per_tile, per_tile) for frames in prepared.get("frames", [])]  # a frame is one tile
    return Written(tokenize_pieces(processor.tokenizer, out), dict(prepared["inputs"]), grids)


def _expand(texts: list[str], token: str, counts, what: str, where: str) -> list[str]:
    """Each ``token`` placeholder over the pieces repeated by the next of ``counts`` (all of them used)."""
    from vlft import DataError

    out = []
    for text in texts:
        pieces = text.split(token)
        try:
            out.append("".join(p + (token * next(counts) if i < len(pieces) - 1 else "") for i, p in enumerate(pieces)))
        except StopIteration:
            raise DataError(f"{where}: the rendered conversation has more {what} placeholders than {what}s") from None
    if next(counts, None) is not None:
        raise DataError(f"{where}: some {what}s have no placeholder in the rendered conversation")
    return out


def trace_vision(tower, grids, dtype, run_block):
    """The SigLIP encoder layers on the meta device for the memory plan: every tile of every image
    ((tiles, S/p, S/p) grids) as one sequence of (S/p)^2 patches. The projector lives outside the tower and is
    not traced (two Linear layers per image token)."""
    import torch

    tiles = sum(t for t, _, _ in grids)
    per_tile = grids[0][1] * grids[0][2]
    hidden = torch.empty(tiles, per_tile, tower.config.hidden_size, device="meta", dtype=dtype)
    for layer in tower.encoder.layers:
        hidden = run_block(layer, lambda b=layer, h=hidden: _first(b(h, attention_mask=None)), hidden)
    return hidden


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def vision_dummy(model, modality: str):
    """One blank image of one tile's size through ``get_image_features``: its base tile and its one tile
    (``pixel_values`` [1, 2, 3, S, S]), so a micro-batch without images runs the tower (and the projector and
    image_newline) on every process; for video, one blank frame through ``get_video_features`` (the tower, the
    projector and the pooling)."""
    from vlft import VisionWarmup

    if modality not in ("image", "video"):
        return None
    inner = None
    for module in model.modules():
        if (
            hasattr(module, "get_image_features")
            and hasattr(module, "vision_tower")
            and hasattr(module, "get_input_embeddings")
        ):
            inner = module  # the innermost (the ForConditionalGeneration delegates to it)
    if inner is None:
        return None
    import torch

    vc = inner.vision_tower.config
    side = int(vc.image_size)
    if modality == "video":
        return VisionWarmup(
            inner, "get_video_features", {"pixel_values_videos": torch.zeros(1, 1, int(vc.num_channels), side, side)}
        )
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    tiles = image_size_to_num_patches((side, side), inner.config.image_grid_pinpoints, side)
    pixels = torch.zeros(1, tiles, int(vc.num_channels), side, side)
    return VisionWarmup(
        inner, "get_image_features", {"pixel_values": pixels, "image_sizes": torch.tensor([[side, side]])}
    )


# --- the tiny model ----------------------------------------------------------------------------------------------


def make_processor(tokenizer, recipe: dict, image_processor=None):
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    side = recipe["vision"]["image_size"]
    patch = recipe["vision"]["patch_size"]
    image_processor = image_processor or LlavaOnevisionImageProcessor(
        size={"height": side, "width": side}, image_grid_pinpoints=recipe["image_grid_pinpoints"]
    )
    video_processor = LlavaOnevisionVideoProcessor(size={"height": side, "width": side})
    return LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        num_image_tokens=(side // patch) ** 2,
        vision_feature_select_strategy=recipe.get("vision_feature_select_strategy", "full"),
        chat_template=_tiny.template("llava_onevision"),
        image_token="<image>",
        video_token="<video>",
    )


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    import torch
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    r = recipe or RECIPE
    tokenizer = _tiny.build_tokenizer(r["vocab_size"], SPECIAL_TOKENS, (), corpus)
    ids = _tiny.token_ids(tokenizer)
    config = LlavaOnevisionConfig(
        text_config=dict(
            r["text"],
            model_type="qwen2",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            initializer_range=r["initializer_range"],
            tie_word_embeddings=True,
        ),
        vision_config=dict(r["vision"], model_type="siglip_vision_model", initializer_range=r["initializer_range"]),
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        image_grid_pinpoints=r["image_grid_pinpoints"],
        vision_feature_layer=r["vision_feature_layer"],
        vision_feature_select_strategy=r["vision_feature_select_strategy"],
        tie_word_embeddings=True,
    )
    config.initializer_range = r["initializer_range"]
    torch.manual_seed(r["seed"])
    model = LlavaOnevisionForConditionalGeneration(config)
    torch.manual_seed(r["seed"])
    with torch.no_grad():  # the embedded default's measured init (qwen2_vl.py): the vision side near identity
        for module in (model.model.vision_tower, model.model.multi_modal_projector):
            for m in module.modules():
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                    m.weight.normal_(0.0, r["vision_initializer_range"])
        emb = model.get_input_embeddings().weight
        emb.normal_()  # pyright: ignore[reportCallIssue]  # a module's attribute, typed Tensor | Module
        emb.mul_(r["embedding_row_norm"] / emb.norm(dim=-1, keepdim=True))  # pyright: ignore[reportCallIssue]  # as above
    _tiny.finish_generation_config(model, tokenizer)
    _tiny.save_atomically(path, model, make_processor(tokenizer, r), r)


def load_processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def _image_inputs():
    from vlft import ImageInputs

    return ImageInputs(
        prepare=prepare,
        write=write,
        batch_inputs={
            "pixel_values": "concat_padded",
            "image_sizes": "concat",
            "batch_num_images": "concat",
            "pixel_values_videos": "concat",
        },
        pixels="pixel_values",
        size_cap="a pixel budget per image: scaled down first, aspect ratio kept, so the grid pinpoint the tiling "
        "picks (and its tiles and tokens) falls with it; the config's pinpoints are unchanged",
        trace=trace_vision,
    )


def _family() -> ModelFamily:
    return ModelFamily(
        name=NAME,
        model_types=("llava_onevision",),
        description="LLaVA-OneVision (0.5B/7B/72B): SigLIP + Qwen2, any-resolution tiles by grid pinpoints, video "
        "frames pooled 2 x 2",
        towers=Towers(
            vision="model.vision_tower",
            vision_blocks="model.vision_tower.encoder.layers",
            vision_mergers=("model.multi_modal_projector",),
            decoder_layers="model.language_model.layers",
            lm_head="lm_head",
        ),
        targets=Targets(
            vision_attention=SIGLIP_ATTENTION,
            vision_mlp=SIGLIP_MLP,
            text_attention=TEXT_ATTENTION,
            text_mlp=GATED_MLP,
            default="both",
        ),
        chat=Chat(
            processor_class="LlavaOnevisionProcessor",
            load_processor=load_processor,
            reply_end_token="<|im_end|>",
            box_coordinates="relative-1",
        ),
        image_inputs=_image_inputs(),
        video_inputs=VideoInputs(pixels="pixel_values_videos"),
        # plain 1-D positions and causal attention everywhere (image tokens too): the segments attention keeps
        # packed samples apart, the images joined in sample order (check_family's packing check: equal losses)
        packing=Packing(),
        sharding=Sharding(("Qwen2DecoderLayer", "SiglipEncoderLayer")),
        vision_dummy=vision_dummy,
        tiny=Tiny(build_tiny, RECIPE),
    )


FAMILY = _family()
