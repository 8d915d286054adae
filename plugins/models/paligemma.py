"""PaliGemma / PaliGemma 2 (transformers ``model_type`` "paligemma"): ``--model embedded:paligemma``.

transformers 5.2x ``PaliGemmaForConditionalGeneration``: ``model.vision_tower`` (SigLIP: ``encoder.layers[i]`` with
``self_attn.{q,k,v,out}_proj`` and ``mlp.fc1/fc2``), ``model.multi_modal_projector`` (one Linear),
``model.language_model`` (Gemma for PaliGemma 1, Gemma 2 for PaliGemma 2: ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``), ``lm_head``.

PaliGemma is a prefix-LM, not a chat model, and ships no chat template. ``PaliGemmaProcessor(text=prefix,
suffix=target, images=...)`` writes ``<image>`` x image_seq_length per image, then ``<bos>``, the prefix and ``\\n``
(token type 0: attended both ways), then the suffix and ``<eos>`` (token type 1: causal, the only tokens with
labels); the model builds its attention from ``token_type_ids`` (``block_sequence_ids``: every type-0 token sees
every other type-0 token). So here:

- the conversation: vlft's template (``templates/paligemma.jinja``, given to a processor that has none) writes
  every image first, then ``<bos>`` and each turn before the last reply (system, user, earlier replies; a newline
  after each) as the prefix, and the last reply as the suffix (``Chat.last_reply_only``: the core renders those
  two pieces, and only the last reply trains: an earlier reply lies in the two-way prefix, where a trained token
  would see the token it predicts); ``image_inputs.write`` tokenizes the two as the processor does (its
  text/suffix pair) and gives ``token_type_ids`` 0 over the prefix and 1 over the suffix.
- generation (``vlft predict``): the prefix alone, all type 0; transformers' generation appends type 1 for each
  new token.
- text-only records: the prefix is ``<bos>`` + the prompt + ``\\n`` with no image tokens; the model runs without
  ``pixel_values`` (its processor refuses text without images, so the family tokenizes itself).
- ``--max-pixels``: every image is resized to the checkpoint's fixed square (224, 448 or 896 px: 256, 1024 or
  4096 tokens); the tower's position table is that size, so nothing smaller can be given. A cap at or above the
  square is met as it is; a lower one is refused before step 1.
- packing: refused. vlft keeps packed samples apart by attending each one causally to itself, which drops the
  prefix's two-way attention that ``token_type_ids`` asks for.
- the memory plan: each image one (1, S/p, S/p) grid of SigLIP patches, one token each, traced through the
  SigLIP layers.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is built
or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vlft import Chat, ConfigError, DataError, ImageInputs, ModelFamily, Packing, Targets, Tiny, Towers, Written

from . import _tiny, generic
from .family import GATED_MLP, SIGLIP_ATTENTION, SIGLIP_MLP, TEXT_ATTENTION
from .llava_onevision import trace_vision

NAME = "paligemma"
IMAGE_TOKEN = "<image>"  # PaliGemmaProcessor's (transformers 5.2x processing_paligemma.IMAGE_TOKEN)
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", IMAGE_TOKEN]
PACKING_REFUSAL = (
    "its prefix-LM attention (token_type_ids: the image and prompt tokens attend both ways) would be lost: vlft "
    "keeps packed samples apart by attending each causally to itself"
)
SIZE_CAP = (
    "none below the checkpoint's fixed square: every image is resized to it (224 px: 256 tokens; 448: 1024; 896: "
    "4096) and the tower's position table has that size; a --max-pixels at or above the square changes nothing, "
    "one below it is refused"
)
RECIPE: dict[str, Any] = {
    "version": 1,
    "family": NAME,
    "seed": 1234,
    "vocab_size": 512,
    # a 32 px square of 8 px patches: 16 image tokens an image (the 224 px checkpoints: 16 x 16 = 256)
    "image_size": 32,
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        sliding_window=4096,
    ),
    "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8),
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}


# --- the processor ------------------------------------------------------------------------------------------------


def load_processor(path: str):
    """AutoProcessor with vlft's prefix/suffix template (the published checkpoints ship none; the model's format is
    fixed, so a template a fine-tune added is replaced too: ``write`` reads the prefix and suffix this one writes)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    processor.chat_template = _tiny.template(NAME)
    return processor


def _square(processor) -> int:
    size = processor.image_processor.size
    return int(size["height"] if isinstance(size, dict) else size.height)


# --- image inputs: the prefix (type 0) and the suffix (type 1), tokenized as the processor's text/suffix pair ------


def prepare(processor, media, max_pixels=None):
    """The record's images at the checkpoint's square (none when measuring: the token count needs no pixels)."""
    side = _square(processor)
    if max_pixels is not None and max_pixels < side * side:
        raise ConfigError(
            f"--max-pixels {max_pixels}: PaliGemma resizes every image to its fixed {side}x{side} square "
            f"({side * side} pixels, {processor.image_seq_length} image tokens) and its vision tower takes no other "
            f"size; drop --max-pixels or give at least {side * side} (a smaller square needs a checkpoint of it)"
        )
    pixels = None
    if media.images:
        pixels = processor.image_processor(images=list(media.images), return_tensors="pt")["pixel_values"]
    return pixels, len(media.sizes), media.where


def write(processor, texts: list[str], prepared) -> Written:
    """The prefix piece (its ``<image>`` placeholders expanded) and the reply piece, each tokenized alone (the
    template writes ``<bos>`` and ``<eos>``); token types 0 then 1."""
    import torch

    pixels, images, where = prepared
    if any(IMAGE_TOKEN in text for text in texts[1:]) or texts[0].count(IMAGE_TOKEN) != images:
        raise DataError(
            f"{where}: PaliGemma takes its images before the prompt: {images} image(s), "
            f"{texts[0].count(IMAGE_TOKEN)} placeholder(s) in the prompt"
        )
    prefix = texts[0].replace(IMAGE_TOKEN, IMAGE_TOKEN * int(processor.image_seq_length))
    ids = [processor.tokenizer(text, add_special_tokens=False)["input_ids"] for text in [prefix, *texts[1:]]]
    types = torch.cat([torch.full((len(piece),), int(k > 0), dtype=torch.long) for k, piece in enumerate(ids)])
    inputs: dict = {"token_type_ids": types}
    if pixels is not None:
        inputs["pixel_values"] = pixels
    side = math.isqrt(int(processor.image_seq_length))
    return Written(ids, inputs, [(1, side, side)] * images)


def vision_dummy(model, modality: str):
    """One blank image of the checkpoint's square through the generic warm-up (``get_image_features``)."""
    import torch

    vision = model.config.vision_config
    pixels = torch.zeros(1, int(vision.num_channels), int(vision.image_size), int(vision.image_size))
    return generic.vision_dummy(model, modality, warmup={"pixel_values": pixels})


# --- the tiny model -----------------------------------------------------------------------------------------------


def build(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random PaliGemma 2 (SigLIP, one-Linear projector, Gemma 2) with its processor (which adds the
    1024 <locNNNN> and 128 <segNNN> tokens to the tokenizer) and vlft's prefix/suffix template."""
    import torch
    from transformers import (
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
    )

    r = recipe or RECIPE
    tokenizer = _tiny.build_tokenizer(r["vocab_size"], SPECIAL_TOKENS, (), corpus, eos="<eos>", pad="<pad>")
    tokenizer.bos_token = "<bos>"
    side, patch = r["image_size"], r["vision"]["patch_size"]
    # image_seq_length: the attribute PaliGemmaProcessor reads (the checkpoints' preprocessor_config.json has it)
    image_processor = SiglipImageProcessor(size={"height": side, "width": side}, image_seq_length=(side // patch) ** 2)
    processor = PaliGemmaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=_tiny.template(NAME)
    )
    ids = _tiny.token_ids(tokenizer)
    config = PaliGemmaConfig(
        text_config=dict(
            r["text"],
            model_type="gemma2",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<bos>"),
            eos_token_id=ids("<eos>"),
            pad_token_id=ids("<pad>"),
            initializer_range=r["initializer_range"],
        ),
        vision_config=dict(
            r["vision"],
            model_type="siglip_vision_model",
            image_size=side,
            initializer_range=r["initializer_range"],
        ),
        image_token_index=ids(IMAGE_TOKEN),
        vocab_size=len(tokenizer),
        projection_dim=r["text"]["hidden_size"],
        hidden_size=r["text"]["hidden_size"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = PaliGemmaForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"], "vision_tower")
    _tiny.finish_generation_config(model, tokenizer)
    _tiny.save_atomically(Path(path), model, processor, r)


def _family() -> ModelFamily:
    return ModelFamily(
        name=NAME,
        model_types=(NAME,),
        description="PaliGemma / PaliGemma 2 (3B-28B): SigLIP on every image resized to the checkpoint's fixed "
        "square (224/448/896 px: 256/1024/4096 tokens; --max-pixels cannot lower it), one-Linear projector, Gemma / "
        "Gemma 2 as a prefix-LM (images and prompt attended both ways, the last reply causal and trained)",
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
            processor_class="PaliGemmaProcessor",
            load_processor=load_processor,
            reply_end_token="<eos>",
            last_reply_only=True,
        ),
        image_inputs=ImageInputs(
            prepare=prepare,
            write=write,
            batch_inputs={"pixel_values": "concat", "token_type_ids": "sequence"},
            size_cap=SIZE_CAP,
            patches_per_token=1,
            trace=trace_vision,
        ),
        packing=Packing(refusal=PACKING_REFUSAL),
        vision_dummy=vision_dummy,
        tiny=Tiny(build, RECIPE),
    )


FAMILY = _family()
