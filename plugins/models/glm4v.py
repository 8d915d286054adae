"""GLM-4.1V (``model_type`` "glm4v", e.g. zai-org/GLM-4.1V-9B-Thinking) and GLM-4.6V with a dense text model
(``model_type`` "glm46v", a separate config/model/processor class in transformers 5.24 built on GLM-4.1V's).

transformers 5.24 module tree (checked on the tiny models): ``Glm4vForConditionalGeneration`` -> ``.model``
(``Glm4vModel``) with ``.visual`` (``Glm4vVisionModel``: ``patch_embed`` Conv3d, ``post_conv_layernorm``,
``embeddings`` (a learned position table, bicubically interpolated to each grid), ``blocks[Glm4vVisionBlock]``
with ``attn.qkv/attn.proj`` and a gated MLP ``mlp.gate_proj/up_proj/down_proj`` (width ``out_hidden_size``),
``post_layernorm``, ``downsample`` (Conv2d merge x merge, to ``out_hidden_size``), ``merger``
(``Glm4vVisionPatchMerger``: ``proj``, LayerNorm, gated ``gate_proj/up_proj/down_proj``)) and
``.language_model`` (``Glm4vTextModel``: ``layers[Glm4vTextDecoderLayer]`` with ``self_attn.q/k/v/o_proj``
(q/k/v biased) and a fused ``mlp.gate_up_proj`` + ``mlp.down_proj``, four RMSNorms per layer); ``lm_head``.
GLM-4.6V's ``Glm46VModel`` builds the same towers through AutoModel (``glm4v_vision``/``glm4v_text``).

Images: ``Glm4vProcessor`` writes each image's tokens itself (``<|begin_of_image|>`` + ``<|image|>`` x grid/4 +
``<|end_of_image|>``, the template writing one ``<|image|>``) and returns ``mm_token_type_ids``, so the family's
image inputs are ``vlft.processor_image_inputs`` with Qwen's batch-input kinds. The resize rule is not Qwen2-VL's:
the GLM image processor resizes each image as a 2-frame clip (``num_frames = temporal_patch_size``), so its
pixel budget ``size['longest_edge']`` counts each pixel twice, and an image with a side under 28 px is first
scaled up. ``--max-pixels`` means pixels of one image here too: the family passes twice that as the budget.

Positions: 3-D mRoPE by ``Glm4vModel.get_rope_index`` (same signature as Qwen3-VL's; an image's positions after
it advance by max(h, w) / merge, not by its largest position + 1 as in Qwen2-VL), called unbound on the config
(``family.rope_index_from_class``) with the sample's own ``mm_token_type_ids`` (GLM marks video frames with the
image token too: the type, not the id, tells them apart).

Video: the processor takes the clips vlft sampled at ``--video-fps`` (``vlft.clip_arguments``), writes each frame
pair's ``<|begin_of_image|><|image|>...<|end_of_image|>`` after the frame's second from ``video_metadata``, and
returns ``pixel_values_videos`` and ``video_grid_thw`` (each frame pair one temporal patch), which the rope index
reads beside the images'.

The template (``templates/glm4v.jinja``, GLM-4.1V's layout, reconstructed: see NOTES.md) leaves every assistant
reply open: the turn ends where the next ``<|user|>`` begins, and the checkpoints' generation config stops on
``<|endoftext|>``, ``<|user|>`` or ``<|observation|>``. ``reply_end_appended`` makes the core train ``<|user|>``
as the reply's last token, so the model learns to stop.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is
built or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from vlft import Chat, ModelFamily, Packing, Positions, Sharding, Targets, Tiny, VideoInputs, processor_image_inputs

from . import _tiny
from ._warmup import qwen_vision_dummy
from .family import QWEN_TOWERS, QWEN_VISION_ATTENTION, TEXT_ATTENTION, rope_index_from_class, video_smart_resize_qwen3

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
]
EXTRA_TOKENS = ["<think>", "</think>"]
REPLY_END = "<|user|>"
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # the checkpoints' generation eos ids

PATCH, MERGE, TEMPORAL = 14, 2, 2
# Glm4vImageProcessor's class defaults (transformers 5.24 image_processing_glm4v.py): 112*112 .. 28*28*15000,
# both over the 2-frame clip an image is resized as
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 112 * 112, 28 * 28 * 15000
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

RECIPE: dict[str, Any] = {
    # version 2: the towers widened (version 1, text 64 / vision 32 wide, 2 blocks, reached 28.5% exact match on
    # the demo task with the defaults; this one 96.5%, the colour 100% in both)
    "version": 2,
    "family": "glm4.1v",
    "seed": 1234,
    "vocab_size": 512,
    # head_dim 32, partial rotary 0.5 (as the checkpoints): 16 rotary dims, 8 frequencies split 4/2/2 over t/h/w
    "text": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "partial_rotary_factor": 0.5,
        },
    ),
    # out_hidden_size = the text width (the merger keeps it); intermediate_size is the merger's inner width;
    # image_size 56: a 4x4 learned position table, interpolated to each grid
    "vision": dict(
        depth=4,
        hidden_size=64,
        num_heads=4,
        out_hidden_size=128,
        intermediate_size=128,
        image_size=56,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
    ),
    # 112x112 images: 8x8 patches of 14 px, merged 2x2 into 16 tokens (budgets over the 2-frame clip)
    "min_pixels": 2 * 56 * 56,
    "max_pixels": 2 * 112 * 112,
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}
RECIPE_46 = dict(RECIPE, family="glm4.6v")


# --- the resize rule ---------------------------------------------------------------------------------------------


def smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int = TEMPORAL,
    factor: int = PATCH * MERGE,
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = IMAGE_MAX_PIXELS,
) -> tuple[int, int]:
    """transformers.models.glm4v.image_processing_glm4v.smart_resize (5.24), with these defaults: the rule of
    Qwen3-VL's video resize to the letter (sides under ``factor`` scaled up first, the budget over
    ``t_bar * h * w``), so the plan needs no transformers import (a test checks it against transformers')."""
    return video_smart_resize_qwen3(num_frames, height, width, temporal_factor, factor, min_pixels, max_pixels)


@lru_cache(maxsize=4096)
def image_grid(
    height: int, width: int, min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS
) -> tuple[int, int, int]:
    """(1, h, w) patch grid of one image, as ``image_grid_thw`` gives it (budgets as the processor's ``size``)."""
    h, w = smart_resize(TEMPORAL, height, width, TEMPORAL, PATCH * MERGE, min_pixels, max_pixels)
    return 1, h // PATCH, w // PATCH


def budget(max_pixels: int) -> int:
    """``--max-pixels`` (pixels of one image) as the processor's budget over the 2-frame clip."""
    return TEMPORAL * max_pixels


def capped_grid(height: int, width: int, max_pixels: int | None = None) -> tuple[int, int, int]:
    """``ImageInputs.grid``: the default budget, or ``--max-pixels`` (the floor lowered with it, as size_kwargs)."""
    if max_pixels is None:
        return image_grid(height, width)
    hi = budget(max_pixels)
    return image_grid(height, width, min(IMAGE_MIN_PIXELS, hi), hi)


def size_kwargs(processor, max_pixels: int) -> dict:
    """The processor's ``size`` under ``--max-pixels``: its budget twice the pixels (the 2-frame clip), the floor
    lowered to it where it is above."""
    size = dict(getattr(processor.image_processor, "size", None) or {})
    hi = budget(max_pixels)
    return {"size": {"shortest_edge": min(size.get("shortest_edge", hi), hi), "longest_edge": hi}}


# --- the tower traced for the memory plan ------------------------------------------------------------------------


def trace_vision(tower, grids, dtype, run_block):
    """The GLM vision tower once on the meta device: every block on the images' patches (full attention per
    image), then the merge (post_layernorm, the merge x merge Conv2d ``downsample``) and the merger, counted
    as the merger's step."""
    import torch

    grid = torch.tensor(grids)
    patches = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    per_image = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    cu = torch.nn.functional.pad(per_image.cumsum(0, dtype=torch.int32), (1, 0))
    width, merge = tower.config.hidden_size, tower.spatial_merge_size
    hidden = torch.empty(patches, width, device="meta", dtype=dtype)
    pe = tower.rotary_pos_emb(hidden, torch.zeros(patches, 2, dtype=torch.long, device="meta"))
    for block in tower.blocks:
        hidden = run_block(block, lambda b=block, h=hidden: b(h, cu_seqlens=cu, position_embeddings=pe), hidden)

    def merge_and_project(h=hidden):
        h = tower.post_layernorm(h).view(-1, merge, merge, width).permute(0, 3, 1, 2)
        return tower.merger(tower.downsample(h).view(-1, tower.config.out_hidden_size))

    return run_block(tower.merger, merge_and_project)


# --- processor and tiny model -------------------------------------------------------------------------------------


def _tokenizer(recipe: dict, corpus=None):
    return _tiny.build_tokenizer(
        recipe["vocab_size"], SPECIAL_TOKENS, EXTRA_TOKENS, corpus, eos="<|endoftext|>", pad="<|endoftext|>"
    )


def make_processor(tokenizer, recipe: dict | None = None, image_processor=None, glm46: bool = False):
    import transformers

    r = recipe or RECIPE
    prefix = "Glm46V" if glm46 else "Glm4v"
    common = dict(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, image_mean=CLIP_MEAN, image_std=CLIP_STD
    )
    if image_processor is None:
        image_processor = getattr(transformers, f"{prefix}ImageProcessor")(
            size={
                "shortest_edge": r.get("min_pixels", IMAGE_MIN_PIXELS),
                "longest_edge": r.get("max_pixels", IMAGE_MAX_PIXELS),
            },
            **common,
        )
    video_processor = getattr(transformers, f"{prefix}VideoProcessor")(**common)
    return getattr(transformers, f"{prefix}Processor")(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=_tiny.template("glm4v"),
    )


def _build(path: Path, recipe: dict, corpus, glm46: bool) -> None:
    import torch
    import transformers

    tokenizer = _tokenizer(recipe, corpus)
    ids = _tiny.token_ids(tokenizer)
    config_cls = transformers.Glm46VConfig if glm46 else transformers.Glm4vConfig
    config = config_cls(
        text_config=dict(
            recipe["text"],
            vocab_size=len(tokenizer),
            pad_token_id=ids("<|endoftext|>"),
            initializer_range=recipe["initializer_range"],
        ),
        vision_config=dict(recipe["vision"], initializer_range=recipe["initializer_range"]),
        image_token_id=ids("<|image|>"),
        video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"),
        image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"),
        video_end_token_id=ids("<|end_of_video|>"),
        tie_word_embeddings=True,
    )
    config.initializer_range = recipe["initializer_range"]
    torch.manual_seed(recipe["seed"])
    model_cls = transformers.Glm46VForConditionalGeneration if glm46 else transformers.Glm4vForConditionalGeneration
    model = model_cls(config)  # pyright: ignore[reportArgumentType]  # both classes chosen by glm46: they match
    _tiny.initialise(model, recipe["seed"], recipe["vision_initializer_range"], recipe["embedding_row_norm"])
    model.generation_config.eos_token_id = [ids(t) for t in STOP_TOKENS]
    model.generation_config.pad_token_id = ids("<|endoftext|>")
    model.generation_config.do_sample = False
    _tiny.save_atomically(path, model, make_processor(tokenizer, recipe, glm46=glm46), recipe)


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random GLM-4.1V (about 3 MB of fp32 weights) with tokenizer, template and processor."""
    _build(path, recipe or RECIPE, corpus, glm46=False)


def build_tiny_46(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random GLM-4.6V (dense text model, ``Glm46VConfig``)."""
    _build(path, recipe or RECIPE_46, corpus, glm46=True)


def load_processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


class SampleRopeIndex:
    """``Positions.rope_index``: the model class's ``get_rope_index`` on one sample, with its own
    ``mm_token_type_ids`` (what the processor wrote: GLM's video frames carry the image token too)."""

    def __init__(self, rope_index):
        self.rope_index = rope_index
        self.__qualname__ = rope_index.__qualname__

    def __call__(self, model_config, sample: dict):
        return self.rope_index(
            model_config,
            sample["input_ids"],
            image_grid_thw=sample.get("image_grid_thw"),
            video_grid_thw=sample.get("video_grid_thw"),
            mm_token_type_ids_=sample.get("mm_token_type_ids"),
        )


IMAGE_INPUTS = processor_image_inputs(
    {
        "pixel_values": "concat",
        "image_grid_thw": "concat",
        "pixel_values_videos": "concat",
        "video_grid_thw": "concat",
        "mm_token_type_ids": "sequence",
    },
    size_cap="pixels per image: each image is resized keeping its aspect ratio to at most this many pixels, each "
    "side a multiple of 28 (patch 14 x merge 2); the GLM processor's budget (size['longest_edge']) counts "
    "the 2-frame clip an image is resized as, so it is given twice this",
    grid=capped_grid,
    patch_size=PATCH,
    patches_per_token=MERGE**2,
    trace=trace_vision,
    processor_kwargs=size_kwargs,
)


def _family(
    name: str, model_types: tuple, model_class: str, description: str, build, recipe, processor_class: str
) -> ModelFamily:
    return ModelFamily(
        name=name,
        model_types=model_types,
        description=description,
        towers=QWEN_TOWERS,
        targets=Targets(
            vision_attention=QWEN_VISION_ATTENTION,
            vision_mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),  # the vision blocks' own
            text_attention=TEXT_ATTENTION,
            text_mlp=("mlp.gate_up_proj", "mlp.down_proj"),
        ),
        chat=Chat(
            processor_class=processor_class,
            load_processor=load_processor,
            reply_end_token=REPLY_END,
            reply_end_appended=True,
            box_coordinates="relative-1000",
        ),  # GLM-4.1V/4.5V grounding: [x1, y1, x2, y2] normalised to 0-1000
        vision_dummy=qwen_vision_dummy,  # the same tower inputs as Qwen's: patches [merge^2, C*T*P*P], grid (1, m, m)
        image_inputs=IMAGE_INPUTS,
        video_inputs=VideoInputs(pixels="pixel_values_videos"),
        positions=Positions(SampleRopeIndex(rope_index_from_class(model_class))),
        packing=Packing(refusal=""),
        sharding=Sharding(("Glm4vTextDecoderLayer", "Glm4vVisionBlock")),
        tiny=Tiny(build, recipe),
    )


GLM4_1V = _family(
    "glm4.1v",
    ("glm4v",),
    "transformers.models.glm4v.modeling_glm4v.Glm4vModel",
    "GLM-4.1V (9B): patch 14 x merge 2 (28 px), 3-D mRoPE, images written by its processor",
    build_tiny,
    RECIPE,
    "Glm4vProcessor",
)
GLM4_6V = _family(
    "glm4.6v",
    ("glm46v",),
    "transformers.models.glm46v.modeling_glm46v.Glm46VModel",
    "GLM-4.6V with a dense GLM-4.1V text model (model_type glm46v): GLM-4.1V's towers and processor",
    build_tiny_46,
    RECIPE_46,
    "Glm46VProcessor",
)

FAMILIES = (GLM4_1V, GLM4_6V)
