"""Qwen3-VL (dense): 2B, 4B, 8B, 32B. ``model_type`` "qwen3_vl".

transformers 5.2x classes: ``Qwen3VLForConditionalGeneration`` -> ``.model`` (``Qwen3VLModel``) with
``.visual`` (``Qwen3VLVisionModel``: patch_embed Conv3d, pos_embed, blocks[Qwen3VLVisionBlock], merger,
deepstack_merger_list) and ``.language_model`` (``Qwen3VLTextModel``: layers[Qwen3VLTextDecoderLayer]);
``lm_head`` on the outer model. Processor ``Qwen3VLProcessor`` = ``Qwen2VLImageProcessor`` (patch 16,
merge 2) + ``Qwen3VLVideoProcessor`` (timestamps between frames) + Qwen2 tokenizer.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor
is built or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlft import Chat, Kernels, ModelFamily, Targets, Tiny, Towers

from . import _tiny
from .family import QWEN_REPLY_END, QWEN_VISION_ATTENTION, QWEN_VISION_STEM, QwenVision, qwen_family

NAME = "qwen3-vl"
SPECIAL_TOKENS = _tiny.BASE_SPECIAL_TOKENS

# Qwen/Qwen3-VL-*-Instruct preprocessor_config.json / video_preprocessor_config.json (see configs/SOURCES.md)
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 65536, 16777216
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 4096, 25165824
IMAGE_MEAN = IMAGE_STD = [0.5, 0.5, 0.5]

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
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    ),
    "vision": dict(
        depth=4,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[1, 2],
    ),
    # 128x128 images: 8x8 patches of 16 px, merged 2x2 into 16 tokens.
    "min_pixels": 64 * 64,
    "max_pixels": 128 * 128,
    "video_min_pixels": 64 * 64,
    "video_max_pixels": 4 * 128 * 128,
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}


def make_processor(
    tokenizer, recipe: dict | None = None, image_processor=None, video_processor=None, chat_template: str | None = None
):
    """Qwen3VLProcessor with the family's image/video processors (patch 16, merge 2, mean/std 0.5)."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    r = recipe or RECIPE
    v = r.get("vision", {})
    common: dict[str, Any] = dict(
        patch_size=v.get("patch_size", 16),
        merge_size=v.get("spatial_merge_size", 2),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    if image_processor is None:
        image_processor = Qwen2VLImageProcessor(
            size={
                "shortest_edge": r.get("min_pixels", IMAGE_MIN_PIXELS),
                "longest_edge": r.get("max_pixels", IMAGE_MAX_PIXELS),
            },
            **common,
        )
    if video_processor is None:
        video_processor = Qwen3VLVideoProcessor(
            size={
                "shortest_edge": r.get("video_min_pixels", VIDEO_MIN_PIXELS),
                "longest_edge": r.get("video_max_pixels", VIDEO_MAX_PIXELS),
            },
            cap_pixels_per_frame=False,
            **common,
        )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template or _tiny.template("qwen3_vl"),
    )


def build_tiny(path: Path, recipe: dict | None = None, corpus: list[str] | None = None) -> None:
    """A tiny random Qwen3-VL (about 1 MB of fp32 weights) with tokenizer, template and processor."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    r = recipe or RECIPE
    tokenizer = _tiny.build_tokenizer(r["vocab_size"], SPECIAL_TOKENS, _tiny.QWEN3_EXTRA_TOKENS, corpus)
    config = Qwen3VLConfig(**_tiny.qwen3_config_kwargs(r, tokenizer))
    import torch

    torch.manual_seed(r["seed"])
    model = Qwen3VLForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"])
    _tiny.finish_generation_config(model, tokenizer)
    _tiny.save_atomically(path, model, make_processor(tokenizer, r), r)


def bundled_processor(config_dir: str, tokenizer):
    """For a weightless bundled config: the folder's preprocessor configs, a stand-in tokenizer."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

    d = Path(config_dir)
    ip = Qwen2VLImageProcessor.from_pretrained(d) if (d / "preprocessor_config.json").exists() else None
    vp = Qwen3VLVideoProcessor.from_pretrained(d) if (d / "video_preprocessor_config.json").exists() else None
    return make_processor(
        tokenizer,
        {
            "vision": {},
            "min_pixels": IMAGE_MIN_PIXELS,
            "max_pixels": IMAGE_MAX_PIXELS,
            "video_min_pixels": VIDEO_MIN_PIXELS,
            "video_max_pixels": VIDEO_MAX_PIXELS,
        },
        image_processor=ip,
        video_processor=vp,
    )


def load_processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def tiny_dir() -> Path:
    return _tiny.cached_dir(NAME, RECIPE, build_tiny)


VISION = QwenVision(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_min_pixels=IMAGE_MIN_PIXELS,
    image_max_pixels=IMAGE_MAX_PIXELS,
    video_min_pixels=VIDEO_MIN_PIXELS,
    video_max_pixels=VIDEO_MAX_PIXELS,
    video_rule="qwen3",
)


# What the MoE family (qwen3_vl_moe) shares with the dense one: the towers with the deepstack mergers, the
# vision targets, the processor and the patch embedding.
TOWERS = Towers(
    vision="model.visual",
    vision_blocks="model.visual.blocks",
    vision_mergers=("model.visual.merger", "model.visual.deepstack_merger_list"),
    decoder_layers="model.language_model.layers",
    lm_head="lm_head",
)
TARGETS = Targets(
    vision_attention=QWEN_VISION_ATTENTION,
    vision_mlp=("mlp.linear_fc1", "mlp.linear_fc2"),
    text_attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    text_mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
)
CHAT = Chat(
    processor_class="Qwen3VLProcessor",
    load_processor=load_processor,
    bundled_processor=bundled_processor,
    reply_end_token=QWEN_REPLY_END,
    box_coordinates="relative-1000",
)

# the text model adds the deepstack mergers' features at the image and video tokens of its first layers: one row a
# marked position, which a sequence split cuts with the tokens
DEEPSTACK = {"visual_pos_masks": ("deepstack_visual_embeds",)}

FAMILY: ModelFamily = qwen_family(
    VISION,
    "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLModel",
    ("Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock"),
    name=NAME,
    model_types=("qwen3_vl",),
    description="Qwen3-VL dense (2B/4B/8B/32B): patch 16 x merge 2, deepstack mergers, interleaved mRoPE",
    towers=TOWERS,
    targets=TARGETS,
    chat=CHAT,
    kernels=Kernels(
        vision_stem=QWEN_VISION_STEM,
        targets={
            # transformers 5.24 modeling_qwen3_vl: the vision MLP is not gated (linear_fc1/fc2)
            "rms_norm": ("Qwen3VLTextRMSNorm",),
            "gated_mlp": ("Qwen3VLTextMLP",),
            "rotary": (
                "transformers.models.qwen3_vl.modeling_qwen3_vl:apply_rotary_pos_emb",
                "transformers.models.qwen3_vl.modeling_qwen3_vl:apply_rotary_pos_emb_vision",
            ),
        },
    ),
    marked_inputs=DEEPSTACK,
    tiny=Tiny(build_tiny, RECIPE),
)
