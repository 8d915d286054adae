"""Built-in families declared on the generic family (generic.py): InternVL 3 / 3.5 (``internvl``), LLaVA-NeXT
(``llava_next``), LLaVA-NeXT-Video (``llava_next_video``) and Mistral 3 / Pixtral (``mistral3``).

The generic family reads a checkpoint's towers, targets, processor and chat template at plan time; what it cannot
read a family states here as facts, each a line or a small function:

- the towers and targets: what the generic reader finds in the module tree, written down (a family exists before
  any checkpoint is read: `vlft plugins`, `--model embedded:<name>` and the plan of a bundled config ask for it);
  tests/test_declared_families.py checks the two agree on the tiny model;
- packing: the text model takes 1-D ``position_ids`` through transformers' attention interface (the core's
  segments attention keeps packed samples apart; check_family's packing check: packed and padded losses equal),
  the vision tower runs each tile alone, the pixels join in sample order;
- ``--max-pixels``: the family's own cap, as its processor takes it (``size_cap`` in words, ``processor_kwargs``
  how it reaches the processor);
- the memory plan's vision count: each image's tiles from the image processor's own count
  (``get_number_of_image_patches``), one grid (tiles, s, s) per image with s x s the tokens of a tile, and the
  tower traced over them;
- the vision warm-up's input (the generic ``vision_dummy`` with one blank tile of the tower's size);
- a tiny model built from the config class (``--model embedded:<name>``, offline).

The processor writes each image's tokens itself (``vlft.processor_image_inputs``), and loads as the generic
family loads it (``generic.load_processor``: the tokenizer's template where the processor has none).

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is built
or loaded, or a run builds its dummy image.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from vlft import Chat, ModelFamily, Packing, Targets, Tiny, Towers, VideoInputs, processor_image_inputs

from . import _tiny, generic
from .family import GATED_MLP, SIGLIP_ATTENTION, SIGLIP_MLP, TEXT_ATTENTION
from .llava_onevision import capped_size

# --- InternVL 3 / 3.5 ---------------------------------------------------------------------------------------------
#
# transformers 5.2x InternVLForConditionalGeneration: model.vision_tower (InternViT: encoder.layer[i] with
# attention.{q,k,v}_proj, attention.projection_layer, mlp.fc1/fc2; a CLS token before the patches), the
# pixel-shuffle projector model.multi_modal_projector, model.language_model (Qwen2 for InternVL 3, Qwen3 for 3.5;
# 1-D RoPE). GotOcr2ImageProcessor cuts an image into up to max_patches tiles of the tower's square (the grid of
# the closest aspect ratio) plus a thumbnail when it cuts more than one; each tile costs image_seq_length
# <IMG_CONTEXT> tokens, the image's run closed by <img> ... </img>; pixel_values [tiles, 3, S, S].

INTERNVL = "internvl"
INTERNVL_IMAGE_TOKENS = dict(start_image_token="<img>", end_image_token="</img>", context_image_token="<IMG_CONTEXT>")
INTERNVL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *INTERNVL_IMAGE_TOKENS.values(), "<video>"]
# what the three tiny models share (each recipe's hash names its cache folder; the keys are hashed sorted)
TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8)
TINY_INIT = {"embedding_row_norm": 1.0, "initializer_range": 0.1, "vision_initializer_range": 0.02}
INTERNVL_RECIPE: dict[str, Any] = {
    "version": 1,
    "family": INTERNVL,
    "seed": 1234,
    "vocab_size": 512,
    # 32 px tiles of 8 px patches (4 x 4), pixel-shuffled by 0.5 into 4 tokens a tile; up to 4 tiles + the
    # thumbnail an image
    "tile": 32,
    "max_patches": 4,
    "downsample_ratio": 0.5,
    "text": TINY_TEXT,
    "vision": TINY_VISION,
    **TINY_INIT,
}
INTERNVL_SIZE_CAP = (
    "the tiling's max_patches lowered to the number of whole tiles (the vision tower's square input) that fit "
    "--max-pixels, never below one (the image is then one tile) nor above the processor's own; the thumbnail tile "
    "the tiling adds when it cuts more than one comes on top"
)


def _tile(processor) -> int:
    size = processor.image_processor.size
    return int(size["height"] if isinstance(size, dict) else size.height)


def internvl_max_patches(processor, max_pixels: int | None) -> dict:
    """The processor's keyword arguments under ``--max-pixels``: ``max_patches`` lowered to the whole tiles that
    fit the budget (at least one, at most the processor's own)."""
    if max_pixels is None:
        return {}
    own = int(processor.image_processor.max_patches)
    fits = max(1, int(max_pixels) // _tile(processor) ** 2)
    return {"max_patches": fits} if fits < own else {}


def internvl_grids(processor, sizes, max_pixels=None) -> list:
    """Each image's (tiles, s, s): its tiles by the image processor's own count, s x s the tokens of a tile
    (``image_seq_length``, after the pixel shuffle)."""
    import math

    kwargs = internvl_max_patches(processor, max_pixels)
    side = math.isqrt(int(processor.image_seq_length))
    count = processor.image_processor.get_number_of_image_patches
    return [(int(count(h, w, kwargs)), side, side) for w, h in sizes]


def internvl_trace(tower, grids, dtype, run_block):
    """InternViT's layers on the meta device for the memory plan: every tile a sequence of its patches and the
    CLS token. The pixel-shuffle projector lives outside the tower and is not traced."""
    import torch

    tiles = sum(int(t) for t, _, _ in grids)
    config = tower.config
    side = config.image_size[0] if isinstance(config.image_size, (list, tuple)) else config.image_size
    patch = config.patch_size[0] if isinstance(config.patch_size, (list, tuple)) else config.patch_size
    hidden = torch.empty(tiles, (int(side) // int(patch)) ** 2 + 1, config.hidden_size, device="meta", dtype=dtype)
    for layer in tower.encoder.layer:
        hidden = run_block(layer, lambda m=layer, h=hidden: m(h), hidden)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return hidden


def internvl_dummy(model, modality: str):
    """One blank tile of the tower's size through the generic warm-up (the innermost ``get_image_features``)."""
    import torch

    vision = model.config.vision_config
    h, w = (vision.image_size if isinstance(vision.image_size, (list, tuple)) else (vision.image_size,) * 2)[:2]
    pixels = torch.zeros(1, int(vision.num_channels), int(h), int(w))
    return generic.vision_dummy(model, modality, warmup={"pixel_values": pixels})


def internvl_processor(tokenizer, r: dict):
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    size = {"height": r["tile"], "width": r["tile"]}
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, max_patches=r["max_patches"]),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size=size),
        image_seq_length=_tile_tokens(r),
        chat_template=_tiny.template(INTERNVL),
    )


def _tile_tokens(r: dict) -> int:
    return int((r["tile"] // r["vision"]["patch_size"]) ** 2 * r["downsample_ratio"] ** 2)


def build_internvl(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random InternVL 3 (InternViT, pixel-shuffle projector, Qwen2) with its processor and a
    ChatML template, its tokenizer naming the image tokens as the processor reads them."""
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration, PreTrainedTokenizerFast

    r = recipe or INTERNVL_RECIPE
    trained = _tiny.build_tokenizer(r["vocab_size"], INTERNVL_SPECIALS, (), corpus)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        video_token="<video>",
        model_max_length=r["text"]["max_position_embeddings"],
        **INTERNVL_IMAGE_TOKENS,
    )
    ids = _tiny.token_ids(tokenizer)
    config = InternVLConfig(
        text_config=dict(
            r["text"],
            model_type="qwen2",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            initializer_range=r["initializer_range"],
        ),
        vision_config=dict(
            r["vision"],
            image_size=[r["tile"], r["tile"]],
            patch_size=[r["vision"]["patch_size"]] * 2,
            initializer_range=r["initializer_range"],
        ),
        image_token_id=ids("<IMG_CONTEXT>"),
        image_seq_length=_tile_tokens(r),
        downsample_ratio=r["downsample_ratio"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = InternVLForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"], "vision_tower")
    _tiny.finish_generation_config(model, tokenizer)
    _tiny.save_atomically(Path(path), model, internvl_processor(tokenizer, r), r)


def _internvl() -> ModelFamily:
    return ModelFamily(
        name=INTERNVL,
        model_types=(INTERNVL,),
        description="InternVL 3 / 3.5 (1B-78B, the -hf checkpoints): InternViT on tiles + a thumbnail, "
        "pixel-shuffle projector, Qwen2/Qwen3 text model",
        towers=Towers(
            vision="model.vision_tower",
            vision_blocks="model.vision_tower.encoder.layer",
            vision_mergers=("model.multi_modal_projector",),
            decoder_layers="model.language_model.layers",
            lm_head="lm_head",
        ),
        targets=Targets(
            vision_attention=("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.projection_layer"),
            vision_mlp=("mlp.fc1", "mlp.fc2"),
            text_attention=TEXT_ATTENTION,
            text_mlp=GATED_MLP,
            default="both",
        ),
        chat=Chat(
            processor_class="InternVLProcessor",
            load_processor=generic.load_processor,
            reply_end_token="<|im_end|>",
            box_coordinates="relative-1000",
        ),
        image_inputs=processor_image_inputs(
            {"pixel_values": "concat"},
            size_cap=INTERNVL_SIZE_CAP,
            processor_kwargs=internvl_max_patches,
            image_grids=internvl_grids,
            trace=internvl_trace,
        ),
        # the processor folds a clip's frames into pixel_values, one tile each, with its own tokens per frame
        video_inputs=VideoInputs(pixels="pixel_values"),
        # 1-D RoPE through transformers' attention interface; each tile through the tower alone
        packing=Packing(),
        # sharding: None, the model class's own units (InternVLVisionLayer and the text model's decoder layer,
        # Qwen2's or Qwen3's by checkpoint)
        vision_dummy=internvl_dummy,
        tiny=Tiny(build_internvl, INTERNVL_RECIPE),
    )


# --- LLaVA-NeXT (LLaVA-1.6) -----------------------------------------------------------------------------------------
#
# transformers 5.2x LlavaNextForConditionalGeneration: model.vision_tower (CLIPVisionModel, no vision_model level:
# encoder.layers[i] with self_attn.{q,k,v,out}_proj, mlp.fc1/fc2; a CLS token), the 2-layer
# model.multi_modal_projector, model.image_newline (one per row of tiles), model.language_model (Mistral, Vicuna
# (Llama) or Yi; 1-D RoPE). Any resolution: the best of image_grid_pinpoints for the image's size is chosen, the image
# resized and padded to it and cut into tiles of the tower's square, plus one base tile of the whole image:
# pixel_values [images, tiles, 3, S, S] (the tile count differs by size: the batch pads, 'concat_padded'; the model
# reads pixel_values[i, :tiles_i], tiles_i from image_sizes and the config's pinpoints), image_sizes [images, 2].
# Unlike LLaVA-OneVision, an image of a record of several is tiled as a single one: the processor called per
# rendered piece writes the same tokens as on the whole conversation. The published checkpoints take features from
# vision_feature_layer -2, so the tower's last block feeds nothing (its adapters, under --vision-last-n, get no
# gradient); the tiny model takes the last layer's.

LLAVA_NEXT = "llava-next"
LLAVA_NEXT_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "[INST]", "[/INST]"]
LLAVA_NEXT_RECIPE: dict[str, Any] = {
    "version": 1,
    "family": LLAVA_NEXT,
    "seed": 1234,
    "vocab_size": 512,
    # 32 px tiles of 8 px patches (16 tokens a tile, the CLS dropped); pinpoints up to 2 x 2 tiles
    "tile": 32,
    "image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
    "text": TINY_TEXT,
    "vision": TINY_VISION,
    **TINY_INIT,
}
LLAVA_NEXT_SIZE_CAP = (
    "a pixel budget per image: scaled down first, aspect ratio kept, so the grid pinpoint the tiling picks (and its "
    "tiles and tokens) falls with it; the config's pinpoints are unchanged"
)


def _llava_next_tile(processor) -> int:
    size = processor.image_processor.crop_size
    return int(size["height"] if isinstance(size, dict) else size.height)


def llava_next_grids(processor, sizes, max_pixels=None) -> list:
    """Each image's (tiles, S/p, S/p): the base tile and the pinpoint's tiles, as the model counts them from
    image_sizes (the images already scaled under --max-pixels by ``llava_next_image_inputs``)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    side = _llava_next_tile(processor)
    per = side // int(processor.patch_size)
    pinpoints = processor.image_processor.image_grid_pinpoints
    return [(int(image_size_to_num_patches((h, w), pinpoints, side)), per, per) for w, h in sizes]


def llava_next_trace(tower, grids, dtype, run_block):
    """CLIP's encoder layers on the meta device for the memory plan: every tile a sequence of its patches and the
    CLS token. The projector and image_newline live outside the tower and are not traced."""
    import torch

    config = tower.config
    tiles = sum(int(t) for t, _, _ in grids)
    seq = (int(config.image_size) // int(config.patch_size)) ** 2 + 1
    hidden = torch.empty(tiles, seq, config.hidden_size, device="meta", dtype=dtype)
    for layer in tower.encoder.layers:
        hidden = run_block(layer, lambda m=layer, h=hidden: m(h, attention_mask=None), hidden)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return hidden


def llava_next_image_inputs():
    """The processor's own image inputs (``vlft.processor_image_inputs``), each image first scaled down under
    ``--max-pixels`` (the cap is the image's size: the model reads the tiles from image_sizes and the config's
    pinpoints, so the processor's pinpoints cannot change)."""
    base = processor_image_inputs(
        {"pixel_values": "concat_padded", "image_sizes": "concat"},
        image_grids=llava_next_grids,
        trace=llava_next_trace,
    )

    def prepare(processor, media, max_pixels=None):
        sizes = [capped_size(w, h, max_pixels) for w, h in media.sizes]
        images = media.images
        if images is not None:
            images = [img if img.size == size else img.resize(size) for img, size in zip(images, sizes)]
        return base.prepare(processor, replace(media, sizes=sizes, images=images), None)

    return replace(base, prepare=prepare, size_cap=LLAVA_NEXT_SIZE_CAP)


def llava_next_dummy(model, modality: str):
    """One blank image of one tile's size (its base tile and its one tile) through the generic warm-up."""
    import torch
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    vision = model.config.vision_config
    side = int(vision.image_size)
    tiles = image_size_to_num_patches((side, side), model.config.image_grid_pinpoints, side)
    pixels = torch.zeros(1, tiles, int(vision.num_channels), side, side)
    warmup = {"pixel_values": pixels, "image_sizes": torch.tensor([[side, side]])}
    return generic.vision_dummy(model, modality, warmup=warmup)


def build_llava_next(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random LLaVA-NeXT (CLIP, 2-layer projector, Mistral) with its processor and LLaVA-1.6-Mistral's
    [INST] template."""
    import torch
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    r = recipe or LLAVA_NEXT_RECIPE
    tokenizer = _tiny.build_tokenizer(r["vocab_size"], LLAVA_NEXT_SPECIALS, (), corpus, eos="</s>", pad="<pad>")
    tokenizer.bos_token = "<s>"
    ids = _tiny.token_ids(tokenizer)
    config = LlavaNextConfig(
        text_config=dict(
            r["text"],
            model_type="mistral",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
            initializer_range=r["initializer_range"],
        ),
        vision_config=dict(
            r["vision"],
            model_type="clip_vision_model",
            image_size=r["tile"],
            projection_dim=r["vision"]["hidden_size"],
            initializer_range=r["initializer_range"],
        ),
        image_token_index=ids("<image>"),
        image_grid_pinpoints=r["image_grid_pinpoints"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = LlavaNextForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"], "vision_tower")
    _tiny.finish_generation_config(model, tokenizer)
    side = {"height": r["tile"], "width": r["tile"]}
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(
            size={"shortest_edge": r["tile"]}, crop_size=side, image_grid_pinpoints=r["image_grid_pinpoints"]
        ),
        tokenizer=tokenizer,
        patch_size=r["vision"]["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=_tiny.template("llava_next"),
        image_token="<image>",
    )
    _tiny.save_atomically(Path(path), model, processor, r)


def _llava_next() -> ModelFamily:
    return ModelFamily(
        name=LLAVA_NEXT,
        model_types=("llava_next",),
        description="LLaVA-NeXT / LLaVA-1.6 (7B-34B): CLIP on any-resolution tiles by grid pinpoints, 2-layer "
        "projector, Mistral/Vicuna/Yi text model",
        towers=Towers(
            vision="model.vision_tower",
            vision_blocks="model.vision_tower.encoder.layers",
            vision_mergers=("model.multi_modal_projector",),
            decoder_layers="model.language_model.layers",
            lm_head="lm_head",
        ),
        targets=Targets(
            vision_attention=SIGLIP_ATTENTION,  # CLIP's names are SigLIP's
            vision_mlp=SIGLIP_MLP,
            text_attention=TEXT_ATTENTION,
            text_mlp=GATED_MLP,
            default="both",
        ),
        chat=Chat(
            processor_class="LlavaNextProcessor",
            load_processor=generic.load_processor,
            reply_end_token="</s>",
            box_coordinates="relative-1",
        ),
        image_inputs=llava_next_image_inputs(),
        # 1-D RoPE through transformers' attention interface; each image's tiles through the tower alone
        packing=Packing(),
        vision_dummy=llava_next_dummy,
        tiny=Tiny(build_llava_next, LLAVA_NEXT_RECIPE),
    )


# --- LLaVA-NeXT-Video ----------------------------------------------------------------------------------------------
#
# transformers 5.2x LlavaNextVideoForConditionalGeneration: LLaVA-NeXT's towers and image path (any-resolution tiles,
# image_newline), a Llama/Vicuna text model (1-D RoPE) and a video path: LlavaNextVideoVideoProcessor resizes and
# crops every frame to the tower's square (crop_size), pixel_values_videos [clips, frames, 3, S, S];
# get_video_features runs each frame through the tower as one tile, pools its patch grid by
# spatial_pool_stride (model.vision_resampler, an average pool: no weights) and projects it; the processor writes
# (S/p)^2 / 4 <video> tokens a frame. The features of all clips are laid end to end in frame order, so a clip's
# frames may be given as frames of one each ([frames, 1, 3, S, S]): the batch joins clips of any frame count
# ('concat'), without the zero frames 'concat_padded' would add (which the model would run as frames).

LLAVA_NEXT_VIDEO = "llava-next-video"
LLAVA_NEXT_VIDEO_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<video>"]
LLAVA_NEXT_VIDEO_RECIPE: dict[str, Any] = {
    "version": 1,
    "family": LLAVA_NEXT_VIDEO,
    "seed": 1234,
    "vocab_size": 512,
    # LLaVA-NeXT's tiles (32 px of 8 px patches, pinpoints up to 2 x 2); a frame is one tile, pooled 2 x 2: 4 tokens
    "tile": 32,
    "image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
    "spatial_pool_stride": 2,
    "text": TINY_TEXT,
    "vision": TINY_VISION,
    **TINY_INIT,
}
LLAVA_NEXT_VIDEO_SIZE_CAP = (
    LLAVA_NEXT_SIZE_CAP + "; a clip's frames are always resized to the tower's square (the video processor's "
    "crop_size), which --max-pixels leaves as it is"
)


def llava_next_video_frame_grid(processor) -> tuple[int, int]:
    """(S/p, S/p): the patch grid of one frame, cropped to the video processor's square."""
    size = processor.video_processor.crop_size
    side = int(size["height"] if isinstance(size, dict) else size.height)
    per = side // int(processor.patch_size)
    return per, per


def llava_next_video_image_inputs():
    """LLaVA-NeXT's image inputs (each image scaled under --max-pixels), with the clips' pixels as frames of one
    each, and each clip's grid (frames, S/p, S/p) for the memory plan: the tower runs every frame as one tile."""
    base = llava_next_image_inputs()
    joins = {**base.batch_inputs, "pixel_values_videos": "concat"}
    inner = processor_image_inputs(joins, image_grids=llava_next_grids, trace=llava_next_trace, reshape=_frames_apart)

    def write(processor, texts, prepared):
        written = inner.write(processor, texts, prepared)
        per = llava_next_video_frame_grid(processor)
        clips = [(len(frames), *per) for frames, _ in prepared[4]]
        return replace(written, grids=[*written.grids, *clips])

    return replace(base, write=write, batch_inputs=joins, size_cap=LLAVA_NEXT_VIDEO_SIZE_CAP)


def _frames_apart(name: str, tensor):
    """A clip's pixels [1, frames, 3, S, S] as [frames, 1, 3, S, S] (the model lays every frame's features end to
    end either way); the image inputs as the processor gives them."""
    if name != "pixel_values_videos":
        return tensor
    return tensor.reshape(-1, 1, *tensor.shape[2:])


def llava_next_video_dummy(model, modality: str):
    """LLaVA-NeXT's blank image, or a blank clip of one frame, through the generic warm-up."""
    import torch

    if modality != "video":
        return llava_next_dummy(model, modality)
    vision = model.config.vision_config
    side = int(vision.image_size)
    frame = torch.zeros(1, 1, int(vision.num_channels), side, side)
    return generic.vision_dummy(model, modality, video_warmup={"pixel_values_videos": frame})


def build_llava_next_video(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random LLaVA-NeXT-Video (CLIP, 2-layer projector, average pooling of each frame, Llama) with its
    image and video processors and llava-hf's USER/ASSISTANT template (images, then clips, then the text)."""
    import torch
    from transformers import (
        LlavaNextImageProcessor,
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
        LlavaNextVideoProcessor,
        LlavaNextVideoVideoProcessor,
    )

    r = recipe or LLAVA_NEXT_VIDEO_RECIPE
    tokenizer = _tiny.build_tokenizer(r["vocab_size"], LLAVA_NEXT_VIDEO_SPECIALS, (), corpus, eos="</s>", pad="<pad>")
    tokenizer.bos_token = "<s>"
    ids = _tiny.token_ids(tokenizer)
    per = r["tile"] // r["vision"]["patch_size"]
    config = LlavaNextVideoConfig(
        text_config=dict(
            r["text"],
            model_type="llama",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
            initializer_range=r["initializer_range"],
        ),
        vision_config=dict(
            r["vision"],
            model_type="clip_vision_model",
            image_size=r["tile"],
            projection_dim=r["vision"]["hidden_size"],
            initializer_range=r["initializer_range"],
        ),
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        image_grid_pinpoints=r["image_grid_pinpoints"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        spatial_pool_stride=r["spatial_pool_stride"],
        image_seq_length=per * per,
        video_seq_length=(per // r["spatial_pool_stride"]) ** 2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = LlavaNextVideoForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"], "vision_tower")
    _tiny.finish_generation_config(model, tokenizer)
    edge, square = {"shortest_edge": r["tile"]}, {"height": r["tile"], "width": r["tile"]}
    processor = LlavaNextVideoProcessor(
        video_processor=LlavaNextVideoVideoProcessor(size=edge, crop_size=square),
        image_processor=LlavaNextImageProcessor(
            size=edge, crop_size=square, image_grid_pinpoints=r["image_grid_pinpoints"]
        ),
        tokenizer=tokenizer,
        chat_template=_tiny.template("llava_next_video"),
        patch_size=r["vision"]["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    _tiny.save_atomically(Path(path), model, processor, r)


def _llava_next_video() -> ModelFamily:
    return ModelFamily(
        name=LLAVA_NEXT_VIDEO,
        model_types=("llava_next_video",),
        description="LLaVA-NeXT-Video (7B-34B): LLaVA-NeXT's any-resolution image tiles, and clips whose frames "
        "are each one tile, pooled 2 x 2; Vicuna/Llama, Mistral or Yi text model",
        towers=_llava_next().towers,
        targets=_llava_next().targets,
        chat=Chat(
            processor_class="LlavaNextVideoProcessor",
            load_processor=generic.load_processor,
            reply_end_token="</s>",
            box_coordinates="relative-1",
        ),
        image_inputs=llava_next_video_image_inputs(),
        video_inputs=VideoInputs(pixels="pixel_values_videos"),
        # 1-D RoPE through transformers' attention interface; each image's tiles and each frame through the tower
        # alone, the pixels joined in sample order
        packing=Packing(),
        vision_dummy=llava_next_video_dummy,
        tiny=Tiny(build_llava_next_video, LLAVA_NEXT_VIDEO_RECIPE),
    )


# --- Mistral 3 (Mistral Small 3.1 / 3.2, Pixtral's tower) -----------------------------------------------------------
#
# transformers 5.2x Mistral3ForConditionalGeneration: model.vision_tower (PixtralVisionModel: transformer.layers[i]
# with attention.{q,k,v,o}_proj, feed_forward.{gate,up,down}_proj; 2-D rotary positions, each image its own block of
# the attention), model.multi_modal_projector (a spatial_merge_size^2 patch merger, then 2 linears),
# model.language_model (Mistral: 1-D RoPE). PixtralImageProcessor scales an image so neither side passes
# size.longest_edge, then rounds each side up to whole tokens (patch_size x spatial_merge_size px); the processor
# writes a row of [IMG] per token row closed by [IMG_BREAK], the last by [IMG_END]. pixel_values [images, 3, H, W]
# (the batch pads: 'concat_padded'; the tower crops each image to its image_sizes).

MISTRAL3 = "mistral3"
MISTRAL3_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_SPECIALS += ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
MISTRAL3_RECIPE: dict[str, Any] = {
    "version": 1,
    "family": MISTRAL3,
    "seed": 1234,
    "vocab_size": 512,
    # 8 px patches merged 2 x 2: a token per 16 px; images scaled to a 64 px longest edge (at most 4 x 4 tokens)
    "longest_edge": 64,
    "spatial_merge_size": 2,
    "text": TINY_TEXT,
    "vision": dict(TINY_VISION, image_size=64),
    **TINY_INIT,
}
MISTRAL3_SIZE_CAP = (
    "the image processor's size.longest_edge lowered to the square root of --max-pixels (an image of any aspect "
    "then fits the budget, before each side is rounded up to whole tokens), never below one token's side nor above "
    "the processor's own"
)


def _mistral3_unit(processor) -> int:
    """The pixels of one token's side: the vision patch times the merge."""
    return int(processor.patch_size) * int(processor.spatial_merge_size)


def mistral3_longest_edge(processor, max_pixels: int | None) -> dict:
    import math

    if max_pixels is None:
        return {}
    own = int(processor.image_processor.size["longest_edge"])
    edge = max(_mistral3_unit(processor), math.isqrt(int(max_pixels)))
    return {"size": {"longest_edge": edge}} if edge < own else {}


def mistral3_grids(processor, sizes, max_pixels=None) -> list:
    """Each image's (1, token rows, token columns), by the processor's own resize rule: one [IMG] each."""
    import numpy as np
    from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

    edge = mistral3_longest_edge(processor, max_pixels).get("size", processor.image_processor.size)["longest_edge"]
    unit = _mistral3_unit(processor)
    out = []
    for w, h in sizes:
        rh, rw = get_resize_output_image_size(np.zeros((h, w, 3)), size=(edge, edge), patch_size=(unit, unit))
        out.append((1, rh // unit, rw // unit))
    return out


def mistral3_dummy(model, modality: str):
    """One blank image of two tokens through the generic warm-up: of one token, ``get_image_features`` squeezes
    the token dimension away with the batch's (``image_features.squeeze(0)``) and its split fails."""
    import torch

    vision = model.config.vision_config
    side = int(vision.patch_size) * int(model.config.spatial_merge_size)
    pixels = torch.zeros(1, int(vision.num_channels), side, 2 * side)
    warmup = {"pixel_values": pixels, "image_sizes": torch.tensor([[side, 2 * side]])}
    return generic.vision_dummy(model, modality, warmup=warmup)


def build_mistral3(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random Mistral 3 (Pixtral tower, patch merger, Mistral) with its processor and Mistral Small 3.1's
    template (no {% generation %} markers)."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    r = recipe or MISTRAL3_RECIPE
    tokenizer = _tiny.build_tokenizer(r["vocab_size"], MISTRAL3_SPECIALS, (), corpus, eos="</s>", pad="<pad>")
    tokenizer.bos_token = "<s>"
    ids = _tiny.token_ids(tokenizer)
    config = Mistral3Config(
        text_config=dict(
            r["text"],
            model_type="mistral",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
            initializer_range=r["initializer_range"],
        ),
        vision_config=dict(r["vision"], model_type="pixtral", initializer_range=r["initializer_range"]),
        image_token_index=ids("[IMG]"),
        spatial_merge_size=r["spatial_merge_size"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = Mistral3ForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"], "vision_tower")
    _tiny.finish_generation_config(model, tokenizer)
    unit = r["vision"]["patch_size"] * r["spatial_merge_size"]
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(
            size={"longest_edge": r["longest_edge"]}, patch_size={"height": unit, "width": unit}
        ),
        tokenizer=tokenizer,
        patch_size=r["vision"]["patch_size"],
        spatial_merge_size=r["spatial_merge_size"],
        chat_template=_tiny.template(MISTRAL3),
    )
    _tiny.save_atomically(Path(path), model, processor, r)


def _mistral3() -> ModelFamily:
    return ModelFamily(
        name=MISTRAL3,
        model_types=(MISTRAL3,),
        description="Mistral 3 (Mistral Small 3.1 / 3.2, 24B): Pixtral vision tower at native resolution, patch "
        "merger, Mistral text model",
        towers=Towers(
            vision="model.vision_tower",
            vision_blocks="model.vision_tower.transformer.layers",
            vision_mergers=("model.multi_modal_projector",),
            decoder_layers="model.language_model.layers",
            lm_head="lm_head",
        ),
        targets=Targets(
            vision_attention=("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj"),
            vision_mlp=("feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"),
            text_attention=TEXT_ATTENTION,
            text_mlp=GATED_MLP,
            default="both",
        ),
        chat=Chat(
            processor_class="PixtralProcessor",
            load_processor=generic.load_processor,
            reply_end_token="</s>",
            box_coordinates="absolute",
        ),
        image_inputs=processor_image_inputs(
            {"pixel_values": "concat_padded", "image_sizes": "concat"},
            size_cap=MISTRAL3_SIZE_CAP,
            processor_kwargs=mistral3_longest_edge,
            image_grids=mistral3_grids,
        ),
        # 1-D RoPE through transformers' attention interface; each image its own block in the tower
        packing=Packing(),
        vision_dummy=mistral3_dummy,
        tiny=Tiny(build_mistral3, MISTRAL3_RECIPE),
    )


FAMILIES = (_internvl(), _llava_next(), _llava_next_video(), _mistral3())
