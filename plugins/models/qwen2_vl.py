"""Qwen2-VL and Qwen2.5-VL: today's vlft behaviour, moved out of the core.

Two families in one module (they share the processor, the 28-pixel resize rule and the chat template but
not the vision MLP names, block classes or rope index):

- ``qwen2_vl``: ``Qwen2VLForConditionalGeneration``; vision blocks ``Qwen2VLVisionBlock`` with
  ``attn.qkv/attn.proj`` and ``mlp.fc1/mlp.fc2``; merger ``PatchMerger`` (``mlp.0``/``mlp.2`` Linear).
- ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration``; vision blocks ``Qwen2_5_VLVisionBlock`` with
  ``attn.qkv/attn.proj`` and a gated MLP ``mlp.gate_proj/up_proj/down_proj`` (the same leaf names as the
  text MLP: select by path, not leaf); windowed attention except ``fullatt_block_indexes``; its rope index
  spaces video frames by ``tokens_per_second * second_per_grid_ts``.

The tiny builder for Qwen2.5-VL is the embedded default's recipe (``--model embedded`` is
``--model embedded:qwen2.5-vl``, this plugin names the family the default); the Qwen2-VL one is its sibling
with Qwen2-VL's config class.

The Qwen2.5-VL recipe's initialisation, each choice measured on the embedded product-inspection task with
LoRA r=32 at lr 2e-4:

- with the usual std-0.02 weights everywhere the logits stay so small that the loss barely moves (it
  stalled at 1.6 after 300 steps, exact match 0%);
- token embeddings (tied to the output head) get unit-norm rows, so logits span about +-sqrt(hidden) once
  a hidden state aligns with a token;
- text layers use std 0.1, so an adapter's update moves the residual stream visibly (0.02: stalled; 0.2:
  noisier and worse);
- the vision tower and merger keep std 0.02, which leaves them close to the identity and lets the pixels'
  colour and shape reach the text model (0.1 there cost about 10 points of defect accuracy).

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor
is built or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from vlft import Chat, Kernels, Targets, Tiny

from . import _tiny
from .family import (
    GATED_MLP,
    QWEN_REPLY_END,
    QWEN_VISION_ATTENTION,
    QWEN_VISION_STEM,
    TEXT_ATTENTION,
    QwenVision,
    qwen_family,
)

SPECIAL_TOKENS = _tiny.BASE_SPECIAL_TOKENS
# Qwen2-VL / Qwen2.5-VL preprocessor_config.json (vlft/model_configs/SOURCES.md): min 3136, max 12845056
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 3136, 12845056

# The embedded default's recipe (version 4; its weights are those `make run`'s figures come from).
# 112x112 images: 8x8 patches of 14 px, merged 2x2 into 16 tokens.
RECIPE_2_5 = {
    "version": 4,
    "seed": 1234,
    "vocab_size": 512,
    "text": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    ),
    "vision": dict(
        depth=8,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=128,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[3, 7],
    ),
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}
RECIPE_2 = {
    "version": 1,
    "family": "qwen2-vl",
    "seed": 1234,
    "vocab_size": 512,
    "text": RECIPE_2_5["text"],
    # Qwen2-VL's vision config: embed_dim is the ViT width, hidden_size the merger's output (= text width)
    "vision": dict(
        depth=4,
        embed_dim=64,
        hidden_size=128,
        mlp_ratio=2,
        num_heads=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    ),
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}


def make_processor(tokenizer, recipe: dict, processor_cls_name: str = "Qwen2_5_VLProcessor", image_processor=None):
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    v = recipe.get("vision", {})
    kw = dict(
        patch_size=v.get("patch_size", 14),
        merge_size=v.get("spatial_merge_size", 2),
        temporal_patch_size=v.get("temporal_patch_size", 2),
    )
    size = dict(
        min_pixels=recipe.get("min_pixels", IMAGE_MIN_PIXELS), max_pixels=recipe.get("max_pixels", IMAGE_MAX_PIXELS)
    )
    image_processor = image_processor or Qwen2VLImageProcessor(**size, **kw)
    video_processor = Qwen2VLVideoProcessor(**size, **kw)
    cls = getattr(transformers, processor_cls_name)
    return cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=_tiny.template("qwen2_vl"),
    )


def _build(
    path: Path,
    recipe: dict,
    config_cls_name: str,
    model_cls_name: str,
    processor_cls_name: str,
    corpus=None,
    reseed_before_init: bool = True,
) -> None:
    import torch
    import transformers

    tokenizer = _tiny.build_tokenizer(recipe["vocab_size"], SPECIAL_TOKENS, (), corpus)
    ids = tokenizer.convert_tokens_to_ids
    config = getattr(transformers, config_cls_name)(
        # a recipe's padded_vocab_size widens the embedding and head past the tokenizer's ids, as real checkpoints
        # do (Qwen2.5-VL pads 151,665 ids to 151,936 rows); the embedded default has none
        text_config=dict(
            recipe["text"],
            vocab_size=max(len(tokenizer), recipe.get("padded_vocab_size", 0)),
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(recipe["vision"]),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    for c in (config.text_config, config.vision_config, config):
        c.initializer_range = recipe["initializer_range"]
    torch.manual_seed(recipe["seed"])
    model = getattr(transformers, model_cls_name)(config)
    _tiny.initialise(
        model,
        recipe["seed"],
        recipe["vision_initializer_range"],
        recipe["embedding_row_norm"],
        reseed=reseed_before_init,
    )
    _tiny.finish_generation_config(model, tokenizer)
    _tiny.save_atomically(path, model, make_processor(tokenizer, recipe, processor_cls_name), recipe)


def build_tiny_2_5(path: Path, recipe: dict | None = None, corpus=None) -> None:
    # the generator runs on from the model's construction into the initialisation, without a second seed:
    # the embedded default has always been built so, and its weights are those `make run` was measured on
    _build(
        path,
        recipe or RECIPE_2_5,
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLProcessor",
        corpus,
        reseed_before_init=False,
    )


def build_tiny_2(path: Path, recipe: dict | None = None, corpus=None) -> None:
    _build(path, recipe or RECIPE_2, "Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", corpus)


def bundled_processor(config_dir: str, tokenizer, processor_cls_name: str = "Qwen2_5_VLProcessor"):
    """vlft/model.py's bundled-config processor: the folder's image processor + a stand-in tokenizer."""
    from transformers import Qwen2VLImageProcessor

    ip = Qwen2VLImageProcessor.from_pretrained(config_dir)
    return make_processor(
        tokenizer,
        {
            "vision": {
                "patch_size": ip.patch_size,
                "spatial_merge_size": ip.merge_size,
                "temporal_patch_size": ip.temporal_patch_size,
            }
        },
        processor_cls_name,
        image_processor=ip,
    )


def load_processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


VISION = QwenVision(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_min_pixels=IMAGE_MIN_PIXELS,
    image_max_pixels=IMAGE_MAX_PIXELS,
    video_min_pixels=128 * 28 * 28,
    video_max_pixels=28 * 28 * 768,
    video_rule="qwen2",
)  # Qwen2VLVideoProcessor: each frame resized by the image rule

QWEN2_5_VL = qwen_family(
    VISION,
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLModel",
    ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"),
    name="qwen2.5-vl",
    model_types=("qwen2_5_vl",),
    description="Qwen2.5-VL (3B/7B/32B/72B): patch 14 x merge 2 (28 px), windowed vision attention",
    targets=Targets(
        vision_attention=QWEN_VISION_ATTENTION,
        vision_mlp=GATED_MLP,  # the vision MLP is gated too
        text_attention=TEXT_ATTENTION,
        text_mlp=GATED_MLP,
    ),
    chat=Chat(
        processor_class="Qwen2_5_VLProcessor",
        load_processor=load_processor,
        bundled_processor=bundled_processor,
        reply_end_token=QWEN_REPLY_END,
        box_coordinates="absolute",
    ),
    kernels=Kernels(
        vision_stem=QWEN_VISION_STEM,
        targets={
            # transformers 5.24 modeling_qwen2_5_vl: the vision MLP is gated too (hidden_act silu)
            "rms_norm": ("Qwen2_5_VLRMSNorm", "Qwen2RMSNorm"),
            "gated_mlp": ("Qwen2_5_VLMLP", "Qwen2MLP"),
            "rotary": (
                "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:apply_rotary_pos_emb",
                "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:apply_rotary_pos_emb_vision",
            ),
        },
    ),
    tiny=Tiny(build_tiny_2_5, RECIPE_2_5),
)

QWEN2_VL = qwen_family(
    VISION,
    "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLModel",
    ("Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"),
    name="qwen2-vl",
    model_types=("qwen2_vl",),
    description="Qwen2-VL (2B/7B/72B): patch 14 x merge 2 (28 px)",
    targets=Targets(
        vision_attention=QWEN_VISION_ATTENTION,
        vision_mlp=("mlp.fc1", "mlp.fc2"),
        text_attention=TEXT_ATTENTION,
        text_mlp=GATED_MLP,
    ),
    chat=Chat(
        processor_class="Qwen2VLProcessor",
        load_processor=load_processor,
        bundled_processor=partial(bundled_processor, processor_cls_name="Qwen2VLProcessor"),
        reply_end_token=QWEN_REPLY_END,
        box_coordinates="relative-1000",
    ),  # Qwen2-VL grounding used (0,1000) normalised boxes
    kernels=Kernels(vision_stem=QWEN_VISION_STEM),
    tiny=Tiny(build_tiny_2, RECIPE_2),
)

FAMILIES = (QWEN2_5_VL, QWEN2_VL)
