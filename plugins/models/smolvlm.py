"""SmolVLM / SmolVLM2 (``model_type`` "smolvlm") and Idefics3 ("idefics3"), the same architecture.

transformers 5.24 classes: ``SmolVLMForConditionalGeneration`` -> ``.model`` (``SmolVLMModel``) with
``.vision_model`` (``SmolVLMVisionTransformer``, SigLIP: ``embeddings`` (Conv2d patches + learned positions),
``encoder.layers[SmolVLMEncoderLayer]`` with ``self_attn.{q,k,v,out}_proj`` and ``mlp.fc1/fc2``,
``post_layernorm``), ``.connector`` (``SmolVLMConnector``: pixel shuffle by ``scale_factor``, then
``modality_projection.proj``, one bias-free Linear to the text width) and ``.text_model`` (a Llama:
``layers[LlamaDecoderLayer]`` with ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``); ``lm_head`` on
the outer model. Idefics3 is the same tree with ``Idefics3*`` class names. Positions are plain 1-D (Llama's
RoPE): no ``positions`` capability.

The processor writes each image's tokens itself: the image is resized so its longest edge is
``size.longest_edge``, padded up to whole tiles of ``max_image_size.longest_edge`` (the vision encoder's square
input), cut into rows x cols tiles plus one global image (no tiles when it fits in one), and every tile costs
``image_seq_len`` = (tile / patch)^2 / scale_factor^2 ``<image>`` tokens between ``<fake_token_around_image>``
and ``<row_r_col_c>`` / ``<global-img>`` markers. ``pixel_values`` come back ``[1, tiles, 3, tile, tile]`` per
call (``pixel_attention_mask`` ``[1, tiles, tile, tile]``); the model views them as ``batch x images`` and drops
all-zero padding images, so a batch laid as ``[tiles, 1, 3, tile, tile]`` (every tile a "sample" of one image,
joined along dim 0: the core's 'concat') gives the same features in the same order as the processor's own
``[batch, max tiles, ...]`` padding (tests/test_smolvlm.py checks the logits).

Video (SmolVLM2; the ``smolvlm`` family only, Idefics3's processor has no video processor): the clips vlft
sampled at ``--video-fps`` / ``--video-max-frames`` go to the processor (``vlft.clip_arguments``), whose
``SmolVLMVideoProcessor`` resizes each frame to one tile and whose prompt writes "You are provided the following
series of <n> frames ..." and each frame's ``Frame from mm:ss:`` before the frame's tokens (one global-image
tile's ``image_seq_len`` tokens). The frames come back in ``pixel_values`` like an image's tiles, so the model
reads them as images (``VideoInputs.pixels`` is the image input, and the image warm-up serves clips too).

SmolVLMProcessor refuses to build without the ``num2words`` package, which it uses only to spell a video's
frame count in its prompt (vlft's ``dev`` extra installs it); where it is missing the family loads the processor
with a stand-in that refuses a video record, saying what to install (``_allow_without_num2words``).

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is
built or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

from vlft import (
    Chat,
    DataError,
    ModelFamily,
    Packing,
    Sharding,
    Targets,
    Tiny,
    Towers,
    VideoInputs,
    VisionWarmup,
    processor_image_inputs,
)

from . import _tiny
from .family import GATED_MLP, SIGLIP_ATTENTION, SIGLIP_MLP, TEXT_ATTENTION

# The tiny model's template is transformers' DEFAULT_CHAT_TEMPLATE of processing_smolvlm.py (5.24; "the correct
# chat template to be used for videos after #38105", which the processor itself falls back to): <|im_start|>, then
# "User:"/"Assistant:" turns closed by <end_of_utterance>\n, images as <image>. A real checkpoint brings its own.
# The special tokens below are the ones it and the processor write.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<video>",
]
GRID_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]  # as the checkpoints' 6 x 6
IMAGE_MEAN = IMAGE_STD = [0.5, 0.5, 0.5]

RECIPE: dict[str, Any] = {
    "version": 1,
    "family": "smolvlm",
    "seed": 1234,
    "vocab_size": 512,
    # 32 px tiles of 8 px patches (4 x 4), pixel-shuffled 2 x 2 into 4 tokens a tile; images resized to a
    # 64 px longest edge: up to 2 x 2 tiles + the global image = 5 tiles, 20 <image> tokens
    "tile": 32,
    "longest_edge": 64,
    "scale_factor": 2,
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8),
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}


def _allow_without_num2words() -> None:
    """SmolVLMProcessor's constructor refuses to run without ``num2words``, which only its video prompt uses;
    where it is missing, put a stand-in that says so if a video prompt is ever built."""
    from transformers.models.smolvlm import processing_smolvlm

    if processing_smolvlm.num2words is None:  # pyright: ignore[reportPrivateImportUsage]  # None where it is missing

        def num2words(n, *args, **kwargs):
            raise DataError(
                "SmolVLM2's video prompt spells the frame count with the `num2words` package, which is not "
                "installed: pip install num2words (or leave the video records out)"
            )

        processing_smolvlm.num2words = num2words  # pyright: ignore[reportPrivateImportUsage]  # the stand-in


def _tokenizer(r: dict, corpus=None):
    """A byte-level BPE tokenizer trained on ``corpus`` with SmolVLM's special tokens, and the names the processor
    reads from it (``getattr(tokenizer, 'image_token', ...)``)."""
    from transformers import PreTrainedTokenizerFast

    trained = _tiny.build_tokenizer(r["vocab_size"], SPECIAL_TOKENS, GRID_TOKENS, corpus)
    return PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
        model_max_length=r["text"]["max_position_embeddings"],
        extra_special_tokens={
            "fake_image_token": "<fake_token_around_image>",
            "image_token": "<image>",
            "end_of_utterance_token": "<end_of_utterance>",
            "global_image_token": "<global-img>",
        },
    )


def _image_seq_len(r: dict) -> int:
    return (r["tile"] // r["vision"]["patch_size"]) ** 2 // r["scale_factor"] ** 2


def make_processor(kind: str, tokenizer, r: dict):
    """The family's processor for the tiny model: tiles of ``r['tile']`` px, images resized to a
    ``r['longest_edge']`` px longest edge, mean/std 0.5, transformers' SmolVLM chat template (note 6 of
    NOTES.md section 8: a real Idefics3 checkpoint brings its own)."""
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    sizes: dict[str, Any] = dict(
        size={"longest_edge": r["longest_edge"]},
        max_image_size={"longest_edge": r["tile"]},
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    if kind == "idefics3":
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        return Idefics3Processor(
            image_processor=Idefics3ImageProcessor(**sizes),
            tokenizer=tokenizer,
            image_seq_len=_image_seq_len(r),
            chat_template=DEFAULT_CHAT_TEMPLATE,
        )
    _allow_without_num2words()
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    video = SmolVLMVideoProcessor(
        size={"longest_edge": r["tile"]},
        max_image_size={"longest_edge": r["tile"]},
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    return SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(**sizes),
        tokenizer=tokenizer,
        video_processor=video,
        image_seq_len=_image_seq_len(r),
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )


def build_tiny(kind: str, path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random SmolVLM (or Idefics3) with its tokenizer, template and processor, about 0.5 MB."""
    import torch

    r = recipe or RECIPES[kind]
    tok = _tokenizer(r, corpus)
    ids = _tiny.token_ids(tok)
    text = dict(
        r["text"],
        model_type="llama",
        vocab_size=len(tok),
        bos_token_id=ids("<|im_start|>"),
        eos_token_id=ids("<end_of_utterance>"),
        pad_token_id=ids("<|endoftext|>"),
        initializer_range=r["initializer_range"],
    )
    vision = dict(r["vision"], image_size=r["tile"], initializer_range=r["initializer_range"])
    if kind == "idefics3":
        from transformers import Idefics3Config as Config
        from transformers import Idefics3ForConditionalGeneration as Model
    else:
        from transformers import SmolVLMConfig as Config
        from transformers import SmolVLMForConditionalGeneration as Model
    config = Config(
        text_config=text,
        vision_config=vision,
        scale_factor=r["scale_factor"],
        image_token_id=ids("<image>"),
        pad_token_id=ids("<|endoftext|>"),  # pyright: ignore[reportCallIssue]  # a PretrainedConfig keyword
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = Model(config)  # pyright: ignore[reportArgumentType]  # both classes chosen by kind: they match
    with torch.no_grad():  # the embedded default's measured init (_tiny.initialise), on this tree
        for module in model.model.vision_model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                module.weight.normal_(0.0, r["vision_initializer_range"])
        emb = model.get_input_embeddings().weight
        emb.normal_()
        emb.mul_(r["embedding_row_norm"] / emb.norm(dim=-1, keepdim=True))
    _tiny.finish_generation_config(model, tok)
    _tiny.save_atomically(Path(path), model, make_processor(kind, tok, r), r)


def load_processor(path: str):
    _allow_without_num2words()
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


# --- image inputs ------------------------------------------------------------------------------------------------


def longest_edge(processor, max_pixels: int | None) -> dict:
    """The processor's keyword arguments under ``--max-pixels``: ``size.longest_edge`` lowered to the largest whole
    number of tiles whose square fits ``max_pixels`` (never below one tile, never above the processor's own)."""
    if max_pixels is None:
        return {}
    ip = processor.image_processor
    tile, own = int(ip.max_image_size["longest_edge"]), int(ip.size["longest_edge"])
    edge = max(tile, math.isqrt(int(max_pixels)) // tile * tile)
    return {"size": {"longest_edge": min(own, edge)}} if edge < own else {}


def tiles_of(processor, height: int, width: int, max_pixels: int | None = None) -> int:
    """Tiles one image becomes (rows x cols + the global image, or 1), by the image processor's own count."""
    kwargs = longest_edge(processor, max_pixels)
    n, _, _ = processor.image_processor.get_number_of_image_patches(height, width, kwargs)
    return max(1, n)


def per_tile(name: str, value):
    """A processor output [1, tiles, ...] as [tiles, 1, ...]: tiles joined along dim 0 over a batch."""
    return value.reshape(value.shape[1], 1, *value.shape[2:])


def image_grids(processor, sizes, max_pixels=None) -> list:
    """Each image's (tiles, s, s), s x s the tokens of one tile (``image_seq_len``, after the connector's pixel
    shuffle): the processor does not say the vision patch side (it differs by checkpoint: 14 or 16, shuffled by 2,
    3 or 4), so the grid counts merged patches, one per LLM token; the tracer takes the patch count from the
    tower's own config."""
    side = math.isqrt(int(processor.image_seq_len))
    return [(tiles_of(processor, h, w, max_pixels), side, side) for w, h in sizes]


def trace_vision(tower, grids, dtype, run_block):
    """The SigLIP encoder on the meta device, every tile a full (tile/patch)^2 sequence (the memory plan)."""
    import torch

    tiles = sum(int(t) for t, _, _ in grids)
    seq = (int(tower.config.image_size) // int(tower.config.patch_size)) ** 2
    hidden = torch.empty(tiles, seq, tower.config.hidden_size, device="meta", dtype=dtype)
    for layer in tower.encoder.layers:
        hidden = run_block(layer, lambda m=layer, h=hidden: m(h, attention_mask=None), hidden)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return run_block(tower.post_layernorm, lambda h=hidden: tower.post_layernorm(h))


def vision_dummy(model, modality: str):
    """One grey tile through ``get_image_features`` (the model's own path, connector included) on a step without
    images, so DDP and FSDP see every process use the tower. Not an all-zero tile: both models drop all-zero
    images as padding, and Idefics3 (unlike SmolVLM's ``real_images_inds[0] |= ~any``) then runs the tower on
    none and fails (``pos_ids.reshape(0, -1)``). The core multiplies the output by 0, so the value is immaterial.
    No video tower of its own (frames are images)."""
    if modality != "image":
        return None
    inner = None
    for m in model.modules():
        if hasattr(m, "get_image_features") and hasattr(m, "vision_model") and hasattr(m, "get_input_embeddings"):
            inner = m
    if inner is None:
        return None
    import torch

    vc = inner.vision_model.config
    side = int(vc.image_size)
    return VisionWarmup(
        inner,
        "get_image_features",
        {
            "pixel_values": torch.ones(1, 1, int(vc.num_channels), side, side),
            "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.long),
        },
    )


SIZE_CAP = (
    "the image's longest edge (SmolVLM's size.longest_edge) is lowered to the largest whole number of "
    "tiles (max_image_size.longest_edge, the vision encoder's square input) whose square fits --max-pixels; "
    "never below one tile (then the image is one global tile) nor above the processor's own; the "
    "tile count is what it saves: rows x cols tiles + 1 global"
)


def _family(kind: str) -> ModelFamily:
    prefix = "SmolVLM" if kind == "smolvlm" else "Idefics3"
    return ModelFamily(
        name=kind,
        model_types=(kind,),
        description=(
            f"{'SmolVLM / SmolVLM2 (256M/500M/2.2B)' if kind == 'smolvlm' else 'Idefics3 (8B)'}: SigLIP "
            f"on tiles + a global image, pixel-shuffle connector, Llama text model"
            f"{'; video as timestamped frames' if kind == 'smolvlm' else ''}"
        ),
        towers=Towers(
            vision="model.vision_model",
            vision_blocks="model.vision_model.encoder.layers",
            vision_mergers=("model.connector",),
            decoder_layers="model.text_model.layers",
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
            processor_class=f"{prefix}Processor",
            load_processor=load_processor,
            reply_end_token="<end_of_utterance>",
            box_coordinates="absolute",
        ),
        image_inputs=processor_image_inputs(
            {"pixel_values": "concat", "pixel_attention_mask": "concat"},
            size_cap=SIZE_CAP,
            processor_kwargs=longest_edge,
            reshape=per_tile,
            image_grids=image_grids,
            trace=trace_vision,
        ),
        # SmolVLM2's clips: frames folded into the image input (the module docstring); Idefics3 has no video
        video_inputs=VideoInputs(pixels="pixel_values") if kind == "smolvlm" else None,
        packing=Packing(),
        sharding=Sharding(("LlamaDecoderLayer", f"{prefix}VisionAttention")),  # the instance's _no_split_modules
        vision_dummy=vision_dummy,
        tiny=Tiny(partial(build_tiny, kind), RECIPES[kind]),
    )


RECIPES = {"smolvlm": RECIPE, "idefics3": dict(RECIPE, family="idefics3")}
FAMILIES = (_family("smolvlm"), _family("idefics3"))
