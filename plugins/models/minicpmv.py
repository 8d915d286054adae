"""MiniCPM-V 4.6 built in, as facts declared on the generic family (generic.py; the shape of declared.py):
``model_type`` "minicpmv4_6".

transformers 5.2x MiniCPMV4_6ForConditionalGeneration: model.vision_tower (a SigLIP on NaViT-packed patches:
encoder.layers[i] with self_attn.{q,k,v,out}_proj and mlp.fc1/fc2; after layer ``insert_layer_id`` a window-attention
``vit_merger`` halves each side), model.merger (a 2 x 2 patch merge and a 2-layer MLP, the projector),
model.language_model (Qwen3.5's text model: Gated DeltaNet and gated full attention layers, 1-D positions).
MiniCPMV4_6ImageProcessor resizes an image to about ``scale_resolution``^2 pixels (sides rounded to 4 patches) and,
for a larger image, adds up to ``max_slice_nums`` slices of a refined copy; every view's patches are laid end to end
in ONE row, ``pixel_values`` [1, 3, p, patches], cut back by ``target_sizes`` [views, 2] (patch rows and columns of
each view): a batch joins the pixels along their last dim ('concat_last'). Each view costs rows x columns / 16
image tokens, written by the processor as ``<image>...</image>`` (the source view) and ``<slice>...</slice>`` (each
slice, a row of slices per line), the image's run opened by ``<image_id>N</image_id>``.

The N of that tag counts the images of the WHOLE text the processor is given; the core gives it one rendered piece
at a time, so an image of a later turn would read 0 again: ``write`` renumbers the tags after each piece's first
(``_numbered``), so every sample's ids equal the processor's on the whole conversation.

Packing is refused as for Qwen3.5 (its Gated DeltaNet layers carry state along the row). MiniCPM-V 4.7 (3-D
positions from the image layout) and MiniCPM-o / OCR are left to the generic family; video is not declared here
(the model's forward reads only ``pixel_values_videos[:1]``), so a clip is refused naming the family.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is built
or loaded, or a run builds its dummy image.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from vlft import Chat, ModelFamily, Packing, Targets, Tiny, Towers, processor_image_inputs

from . import _tiny, generic
from .declared import TINY_INIT
from .family import GATED_MLP, SIGLIP_ATTENTION, SIGLIP_MLP, TEXT_ATTENTION
from .qwen3_5 import PACKING_REFUSAL
from .qwen3_5 import RECIPE as QWEN3_5_RECIPE
from .qwen3_5 import TARGETS as QWEN3_5_TARGETS

NAME = "minicpmv4.6"
IMAGE_TOKENS = dict(
    image_token="<|image_pad|>",
    video_token="<|video_pad|>",
    image_start_token="<image>",
    image_end_token="</image>",
    slice_start_token="<slice>",
    slice_end_token="</slice>",
    image_id_start_token="<image_id>",
    image_id_end_token="</image_id>",
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IMAGE_TOKENS.values()]
RECIPE: dict[str, Any] = {
    "version": 1,
    "family": NAME,
    "seed": 1234,
    "vocab_size": 512,
    # 8 px patches; a view of about 64 x 64 px (8 x 8 patches, merged twice 2 x 2: 4 tokens), up to 4 slices more
    "patch_size": 8,
    "scale_resolution": 64,
    "max_slice_nums": 4,
    "insert_layer_id": 0,
    # Qwen3.5's tiny text model: one Gated DeltaNet layer, one gated full attention layer
    "text": dict(QWEN3_5_RECIPE["text"], model_type="qwen3_5_text"),
    "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64),
    **TINY_INIT,
}
SIZE_CAP = (
    "a pixel budget per image: below the processor's own (a view of scale_resolution^2 pixels and max_slice_nums "
    "slices of about as many), one view of about --max-pixels pixels (scale_resolution lowered to its square root, "
    "never below one token's side) and no slices"
)


def minicpmv_kwargs(processor, max_pixels: int | None) -> dict:
    """The image processor's keyword arguments under ``--max-pixels``: one view of about the budget, no slices."""
    if max_pixels is None:
        return {}
    image_processor = processor.image_processor
    own = int(image_processor.scale_resolution)
    if int(max_pixels) >= own * own * (int(image_processor.max_slice_nums) + 1):
        return {}
    unit = int(image_processor.patch_size) * 4  # two 2 x 2 merges: a token's side
    return {"scale_resolution": min(own, max(unit, math.isqrt(int(max_pixels)))), "slice_mode": False}


def minicpmv_grids(processor, sizes, max_pixels=None) -> list:
    """Each image's views as the image processor cuts them: (1, rows, columns) of patches for the source view, then
    (slices, rows, columns) for its slices where it slices (the plan counts each grid as an image)."""
    image_processor = processor.image_processor
    kwargs = minicpmv_kwargs(processor, max_pixels)
    scale = int(kwargs.get("scale_resolution", image_processor.scale_resolution))
    slicing = bool(kwargs.get("slice_mode", image_processor.slice_mode))
    patch, mode = int(image_processor.patch_size), image_processor.downsample_mode
    out = []
    for w, h in sizes:
        grid = image_processor.get_sliced_grid((h, w), int(image_processor.max_slice_nums), scale) if slicing else None
        rows, cols = image_processor.find_best_resize((h, w), scale, patch, mode, allow_upscale=grid is None)
        out.append((1, rows // patch, cols // patch))
        if grid is not None:
            rows, cols = image_processor.get_refine_size((h, w), grid, scale, patch, mode, allow_upscale=True)
            out.append((grid[0] * grid[1], rows // grid[0] // patch, cols // grid[1] // patch))
    return out


def _numbered(processor, texts: list[str], ids: list[list[int]]) -> list[list[int]]:
    """Each piece's ``<image_id>N</image_id>`` tags renumbered from the images before the piece (the processor,
    given one piece, counts from 0): the ids the whole conversation gets."""
    tokenizer = processor.tokenizer
    start, end = (
        tokenizer.convert_tokens_to_ids(t) for t in (processor.image_id_start_token, processor.image_id_end_token)
    )
    out, before = [], 0
    for text, piece in zip(texts, ids):
        mine = text.count(processor.image_token)
        if before and mine:
            piece, at, n = list(piece), 0, 0
            while start in piece[at:]:
                at = piece.index(start, at) + 1
                stop = piece.index(end, at)
                piece[at:stop] = tokenizer.encode(str(before + n), add_special_tokens=False)
                at, n = at + 1, n + 1
        out.append(piece)
        before += mine
    return out


def minicpmv_image_inputs():
    """The processor's own image inputs (``vlft.processor_image_inputs``), the pixels joined along their last dim,
    each piece's image tags numbered as on the whole conversation."""
    base = processor_image_inputs(
        {"pixel_values": "concat_last", "target_sizes": "concat"},
        size_cap=SIZE_CAP,
        processor_kwargs=minicpmv_kwargs,
        image_grids=minicpmv_grids,
        patches_per_token=16,
    )

    def write(processor, texts: list[str], prepared):
        written = base.write(processor, texts, prepared)
        return replace(written, ids=_numbered(processor, texts, written.ids))

    return replace(base, write=write)


def minicpmv_dummy(model, modality: str):
    """One blank view of 4 x 4 patches (one token after both merges) through the generic warm-up."""
    import torch

    vision = model.config.vision_config
    patch = int(vision.patch_size)
    pixels = torch.zeros(1, int(vision.num_channels), patch, 16 * patch)
    warmup = {"pixel_values": pixels, "target_sizes": torch.tensor([[4, 4]], dtype=torch.int32)}
    return generic.vision_dummy(model, modality, warmup=warmup)


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random MiniCPM-V 4.6 (NaViT SigLIP with its window merger, the 2 x 2 merger, Qwen3.5's text model)
    with its processor and a ChatML template (the Qwen-based MiniCPM-V's, no thinking)."""
    import torch
    from transformers import (
        MiniCPMV4_6Config,
        MiniCPMV4_6ForConditionalGeneration,
        MiniCPMV4_6ImageProcessor,
        MiniCPMV4_6Processor,
        MiniCPMV4_6VideoProcessor,
        PreTrainedTokenizerFast,
    )

    r = recipe or RECIPE
    trained = _tiny.build_tokenizer(r["vocab_size"], SPECIALS, (), corpus)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=r["text"]["max_position_embeddings"],
        **IMAGE_TOKENS,
    )
    ids = _tiny.token_ids(tokenizer)
    config = MiniCPMV4_6Config(
        text_config=dict(
            r["text"],
            vocab_size=len(tokenizer),
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            initializer_range=r["initializer_range"],
        ),
        vision_config=dict(r["vision"], patch_size=r["patch_size"], initializer_range=r["initializer_range"]),
        insert_layer_id=r["insert_layer_id"],
        image_size=r["scale_resolution"],
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = MiniCPMV4_6ForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"], "vision_tower")
    _tiny.finish_generation_config(model, tokenizer)
    sizes = dict(patch_size=r["patch_size"], scale_resolution=r["scale_resolution"], max_slice_nums=r["max_slice_nums"])
    processor = MiniCPMV4_6Processor(
        image_processor=MiniCPMV4_6ImageProcessor(**sizes),
        video_processor=MiniCPMV4_6VideoProcessor(**sizes),
        tokenizer=tokenizer,
        chat_template=_tiny.template("minicpmv"),
    )
    _tiny.save_atomically(Path(path), model, processor, r)


FAMILY = ModelFamily(
    name=NAME,
    model_types=("minicpmv4_6",),
    description="MiniCPM-V 4.6: NaViT SigLIP on a source view + slices, window and 2 x 2 mergers, Qwen3.5 text "
    "model (Gated DeltaNet + gated attention)",
    towers=Towers(
        vision="model.vision_tower",
        vision_blocks="model.vision_tower.encoder.layers",
        vision_mergers=("model.merger",),
        decoder_layers="model.language_model.layers",
        lm_head="lm_head",
    ),
    targets=Targets(
        vision_attention=SIGLIP_ATTENTION,
        vision_mlp=SIGLIP_MLP,
        text_attention=TEXT_ATTENTION,
        text_linear_attention=QWEN3_5_TARGETS.text_linear_attention,
        text_mlp=GATED_MLP,
        default="both",
    ),
    chat=Chat(
        processor_class="MiniCPMV4_6Processor",
        load_processor=generic.load_processor,
        reply_end_token="<|im_end|>",
    ),
    image_inputs=minicpmv_image_inputs(),
    packing=Packing(refusal=PACKING_REFUSAL),
    vision_dummy=minicpmv_dummy,
    tiny=Tiny(build_tiny, RECIPE),
)
