"""Gemma 4 (transformers ``model_type`` "gemma4"): ``--model embedded:gemma4``. Images, video and text; audio is
left out (see below).

transformers 5.24 module tree (``Gemma4ForConditionalGeneration``):
``model.vision_tower`` (``Gemma4VisionModel``: ``patch_embedder`` (an nn.Linear over flattened 3*p*p patches
plus a learned 2-D position table), ``encoder.rotary_emb`` (its own 2-D rotary positions from
``image_position_ids``), ``encoder.layers[i]`` (``Gemma4VisionEncoderLayer``: ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``, each a ``Gemma4ClippableLinear`` wrapping an nn.Linear ``.linear``: PEFT's LoRA
and OFT cannot take the wrapper, so the targets are the inner ``.linear`` leaves), ``pooler`` (no weights:
averages k x k patches into one soft token by their positions, then scales by sqrt(hidden))),
``model.embed_vision`` (``Gemma4MultimodalEmbedder``: an RMS norm without scale and ``embedding_projection``,
the projector to the text width; outside the tower), ``model.language_model.layers[i]``
(``Gemma4TextDecoderLayer``: ``self_attn.{q,k,v,o}_proj`` plain nn.Linear, ``mlp.{gate,up,down}_proj``;
sliding and full attention layers with their own rope; optional per-layer embeddings (PLE), KV sharing and
K=V full-attention layers in the checkpoints), ``model.audio_tower`` / ``model.embed_audio`` when the config
has audio, ``lm_head`` (tied).

``Gemma4Processor`` writes each image's ``<|image>`` + ``<|image|>`` x N + ``<image|>`` itself from the
template's ``<|image|>`` placeholder, N = the image's soft tokens after an aspect-preserving resize to at most
``max_soft_tokens`` x k^2 patches (k = ``pooling_kernel_size``); it returns ``pixel_values`` [images,
max_patches, 3*p*p] (every image padded to the budget's patch count), ``image_position_ids`` [images,
max_patches, 2] ((x, y) per patch, -1 on padding) and ``mm_token_type_ids`` (1 on image tokens, per token).
Plain 1-D text positions: no ``positions`` capability.

Video (``Gemma4VideoProcessor``, the model's ``get_video_features``): the clips vlft sampled at ``--video-fps`` /
``--video-max-frames`` go to the processor as they are (``vlft.clip_arguments``); it writes each frame's
``mm:ss <|image><|video|> x N<image|>`` (N the frame's soft tokens at the video processor's own
``max_soft_tokens``: ``--max-pixels`` caps images only) and returns ``pixel_values_videos`` [frames, max_patches,
3*p*p] and ``video_position_ids`` (every clip's frames laid end to end, padded to the budget's patch count, so
clips of any length join along dim 0) with ``num_frames_per_video``.

Left out, and why: audio (``Gemma4AudioModel``, ``input_features``): vlft's data has no audio; the tiny model
is built without an audio tower, and a checkpoint's audio tower stays frozen and unused. Mixture-of-experts text layers (``enable_moe_block``, the 26B-A4B checkpoint): each such layer runs
the dense ``mlp`` AND ``router`` + ``experts`` (``Gemma4TextExperts``: fused 3-D ``gate_up_proj`` [E, 2I, H]
and ``down_proj`` [E, H, I]); an ``Experts`` capability would name ``experts.gate_up_proj`` /
``experts.down_proj`` for PEFT's ``target_parameters`` and ``router.proj`` (an nn.Linear) as the router to keep
frozen; not declared here because no MoE tiny model was checked.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is built
or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vlft import (
    Chat,
    ConfigError,
    ImageInputs,
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
from .family import GATED_MLP, TEXT_ATTENTION

NAME = "gemma4"
SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
]
# the image processor refuses any other budget (transformers 5.24 image_processing_gemma4._SUPPORTED_SOFT_TOKENS)
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
# Gemma4ImageProcessor's class defaults, the checkpoints' (patch 16, pooling 3 x 3, 280 soft tokens per image)
PATCH_SIZE, POOLING, MAX_SOFT_TOKENS = 16, 3, 280

RECIPE: dict[str, Any] = {
    "version": 2,
    "family": NAME,
    "seed": 1234,
    "vocab_size": 512,  # 2: the vision position table drawn
    # patch 4, pooling 3: the smallest budget (70 soft tokens) is 630 patches of 48 values, about 100 x 100 px
    "image": dict(patch_size=4, pooling_kernel_size=POOLING, max_soft_tokens=70),
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=16,
        sliding_window=64,
        max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
    ),
    "vision": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        position_embedding_size=256,
    ),
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
    "embedding_row_norm": 1.0,
}


# --- image size: the processor's own rule ---------------------------------------------------------------------


def resized(height: int, width: int, patch: int, pooling: int, soft_tokens: int) -> tuple[int, int]:
    """The (height, width) Gemma4ImageProcessor resizes an image to (processing_gemma4
    ``get_aspect_ratio_preserving_size``, restated): the largest aspect-preserving size within ``soft_tokens``
    x pooling^2 patches whose sides are multiples of pooling x patch."""
    max_patches = soft_tokens * pooling**2
    target = max_patches * patch**2
    factor = math.sqrt(target / (height * width))
    side = pooling * patch
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    longest = (max_patches // pooling**2) * side
    if h == 0 and w == 0:
        raise ValueError(f"a {height}x{width} image resizes to 0 x 0")
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    return h, w


def soft_token_budget(max_pixels: int | None, patch: int, pooling: int, default: int) -> int:
    """The image processor's ``max_soft_tokens`` under ``--max-pixels``: the largest supported budget whose
    patches cover at most ``max_pixels`` pixels, never above the processor's own ``default``."""
    if max_pixels is None:
        return default
    per_token = pooling**2 * patch**2
    fits = [s for s in SOFT_TOKEN_BUDGETS if s * per_token <= max_pixels]
    if not fits:
        raise ConfigError(
            f"--max-pixels {max_pixels}: Gemma 4's smallest image budget is {SOFT_TOKEN_BUDGETS[0]} "
            f"soft tokens = {SOFT_TOKEN_BUDGETS[0] * per_token} pixels at patch {patch} and pooling "
            f"{pooling} x {pooling}; give at least that"
        )
    return min(max(fits), default)


def _grid(height, width, patch, pooling, soft_tokens) -> tuple[int, int, int]:
    h, w = resized(height, width, patch, pooling, soft_tokens)
    return 1, h // patch, w // patch


def grid(height: int, width: int, max_pixels: int | None = None) -> tuple[int, int, int]:
    """(1, h, w) patch grid of one image at a checkpoint's processor (patch 16, pooling 3, 280 soft tokens)."""
    return _grid(
        height, width, PATCH_SIZE, POOLING, soft_token_budget(max_pixels, PATCH_SIZE, POOLING, MAX_SOFT_TOKENS)
    )


def _numbers(processor) -> tuple[int, int, int]:
    ip = processor.image_processor
    return int(ip.patch_size), int(ip.pooling_kernel_size), int(ip.max_soft_tokens)


def image_grids(processor, sizes, max_pixels: int | None = None) -> list[tuple[int, int, int]]:
    """``ImageInputs``' written grids: each image's (``sizes``: (width, height)) at the loaded processor's numbers."""
    return [processor_grid(processor, height, width, max_pixels) for width, height in sizes]


def processor_grid(processor, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int, int]:
    """The grid at the loaded processor's own numbers (the tiny model's differ from a checkpoint's)."""
    patch, pooling, default = _numbers(processor)
    return _grid(height, width, patch, pooling, soft_token_budget(max_pixels, patch, pooling, default))


def processor_kwargs(processor, max_pixels: int | None) -> dict:
    """``--max-pixels`` reaches Gemma4ImageProcessor as its ``max_soft_tokens`` (one of 70/140/280/560/1120)."""
    if max_pixels is None:
        return {}
    patch, pooling, default = _numbers(processor)
    return {"max_soft_tokens": soft_token_budget(max_pixels, patch, pooling, default)}


def padded_patches(patches: int, pooling: int) -> int:
    """The patch count the processor pads an image of ``patches`` patches to: its budget's ``max_soft_tokens``
    x pooling^2. The resize fills the budget (it scales small images up), so the budget is the smallest
    supported one that holds the patches."""
    return next(
        (b * pooling**2 for b in SOFT_TOKEN_BUDGETS if b * pooling**2 >= patches),
        -(-patches // pooling**2) * pooling**2,
    )


def trace_vision(tower, grids, dtype, run_block):
    """The vision tower on the meta device for the memory plan, as ``Gemma4VisionModel.forward`` runs it: each
    image padded to its budget's patch count (``padded_patches``), the patch embedder, the encoder layers with
    their 2-D rotary tables, then the pooler (k x k patches into one soft token, by their positions). The
    projector (``model.embed_vision``, outside the tower: a scale-less norm and one linear) is not traced."""
    import torch

    pool = int(tower.config.pooling_kernel_size)
    n = max(padded_patches(h * w, pool) for _, h, w in grids)
    pixels = torch.empty(len(grids), n, 3 * int(tower.config.patch_size) ** 2, device="meta", dtype=dtype)
    pos = torch.zeros(len(grids), n, 2, dtype=torch.long, device="meta")
    padding = torch.zeros(len(grids), n, dtype=torch.bool, device="meta")
    hidden = run_block(tower.patch_embedder, lambda: tower.patch_embedder(pixels, pos, padding))
    pe = tower.encoder.rotary_emb(hidden, pos)
    for layer in tower.encoder.layers:
        hidden = run_block(
            layer,
            lambda lay=layer, h=hidden: lay(h, attention_mask=None, position_embeddings=pe, position_ids=pos),
            hidden,
        )
    return run_block(tower.pooler, lambda h=hidden: tower.pooler(h, pos, padding, n // pool**2)[0])


def trace_layer_kwargs(text, hidden) -> dict:
    """What Gemma4TextModel hands each decoder layer besides hidden states, mask and rotary tables: the
    ``shared_kv_states`` dict (every config has layers that store their keys and values there, KV-shared layers
    read them back) and, with per-layer embeddings (PLE, E2B/E4B), a ``per_layer_input`` of the PLE width."""
    import torch

    out: dict[str, Any] = {"shared_kv_states": {}}
    width = int(getattr(text.config, "hidden_size_per_layer_input", 0) or 0)
    if width:
        out["per_layer_input"] = torch.empty(*hidden.shape[:2], width, device=hidden.device, dtype=hidden.dtype)
    return out


IMAGE_INPUTS: ImageInputs = processor_image_inputs(
    {
        "pixel_values": "concat",
        "image_position_ids": "concat",
        "mm_token_type_ids": "sequence",
        "pixel_values_videos": "concat",
        "video_position_ids": "concat",
        "num_frames_per_video": "concat",
    },
    size_cap="the image processor's soft-token budget (max_soft_tokens, one of 70/140/280/560/1120): --max-pixels "
    "picks the largest budget whose patches (budget x pooling^2 x patch^2 pixels) fit, never above the "
    "processor's own; the resize keeps the aspect ratio",
    grid=grid,
    patch_size=PATCH_SIZE,
    patches_per_token=POOLING**2,
    trace=trace_vision,
    processor_kwargs=processor_kwargs,
    image_grids=image_grids,
)


# --- the tiny model ------------------------------------------------------------------------------------------------


def _tokenizer(r: dict, corpus=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=r["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus or _tiny.DEFAULT_CORPUS) * 4, trainer)
    # Gemma4Processor reads the image and audio tokens from the tokenizer; its input check refuses a tokenizer
    # without boa/eoa tokens even for images only (transformers 5.24 processing_gemma4.validate_inputs)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=r["text"]["max_position_embeddings"],
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
            "audio_token": "<|audio|>",
        },
    )


def make_processor(tokenizer, recipe: dict | None = None):
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    img = (recipe or RECIPE)["image"]
    return Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(**img),
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(**img),
        chat_template=_tiny.template("gemma4"),
        image_seq_length=img["max_soft_tokens"],
    )


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random Gemma 4 (images and text, no audio tower) with tokenizer, template and processor."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    r = recipe or RECIPE
    tok = _tokenizer(r, corpus)
    ids = _tiny.token_ids(tok)
    processor = make_processor(tok, r)
    config = Gemma4Config(
        text_config=dict(
            r["text"],
            vocab_size=len(tok),
            vocab_size_per_layer_input=len(tok),
            initializer_range=r["initializer_range"],
            pad_token_id=ids("<pad>"),
            bos_token_id=ids("<bos>"),
            eos_token_id=[ids("<eos>"), ids("<turn|>")],
        ),
        vision_config=dict(
            r["vision"],
            patch_size=r["image"]["patch_size"],
            pooling_kernel_size=r["image"]["pooling_kernel_size"],
            initializer_range=r["vision_initializer_range"],
        ),
        audio_config=None,
        image_token_id=ids("<|image|>"),
        boi_token_id=ids("<|image>"),
        eoi_token_id=ids("<image|>"),
        video_token_id=ids("<|video|>"),
        audio_token_id=ids("<|audio|>"),
        boa_token_id=ids("<|audio>"),
        eoa_token_index=ids("<audio|>"),
        initializer_range=r["initializer_range"],
    )
    torch.manual_seed(r["seed"])
    model = Gemma4ForConditionalGeneration(config)
    with torch.no_grad():
        # transformers initialises the patch embedder's position table to ones (a checkpoint overwrites it): every
        # patch then gets the same +2 in each width, which swamps the tiny tower's patch projection (std 0.02), so
        # a red and a blue image gave image features of cosine 0.997 and the demo task could not be learned
        tower = model.model.vision_tower
        tower.patch_embedder.position_embedding_table.normal_(0.0, r["vision_initializer_range"])  # pyright: ignore[reportOptionalMemberAccess]  # the tiny model has one
        # unit-norm embedding rows, as the other tiny models (_tiny.initialise)
        emb = model.get_input_embeddings().weight
        emb.normal_()  # pyright: ignore[reportCallIssue]  # a module's attribute, typed Tensor | Module
        emb.mul_(r["embedding_row_norm"] / emb.norm(dim=-1, keepdim=True))  # pyright: ignore[reportCallIssue]  # as above
    model.generation_config.eos_token_id = ids("<turn|>")  # a reply ends there, not at <eos>
    model.generation_config.pad_token_id = ids("<pad>")
    model.generation_config.do_sample = False
    _tiny.save_atomically(Path(path), model, processor, r)


def load_processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


# --- the vision warm-up -----------------------------------------------------------------------------------------


def vision_dummy(model, modality: str):
    """The smallest input the tower takes: one image of pooling x pooling zero patches (one soft token), with
    its patch positions, through ``get_image_features``; for video, the same patches as a one-frame clip
    through ``get_video_features``. None for a model without the tower."""
    if modality not in ("image", "video"):
        return None
    inner = None
    for module in model.modules():  # the innermost Gemma4Model (the ForConditionalGeneration delegates to it)
        if (
            hasattr(module, "get_image_features")
            and hasattr(module, "vision_tower")
            and hasattr(module, "get_input_embeddings")
        ):
            inner = module
    if inner is None or inner.vision_tower is None:
        return None
    import torch

    vc = inner.vision_tower.config
    k, p = int(vc.pooling_kernel_size), int(vc.patch_size)
    ys, xs = torch.meshgrid(torch.arange(k), torch.arange(k), indexing="ij")
    positions = torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)[None]
    pixels = torch.zeros(1, k * k, 3 * p * p)
    if modality == "video":
        one_frame = {"video_position_ids": positions, "num_frames_per_video": torch.tensor([1])}
        return VisionWarmup(inner, "get_video_features", {"pixel_values_videos": pixels, **one_frame})
    return VisionWarmup(inner, "get_image_features", {"pixel_values": pixels, "image_position_ids": positions})


FAMILY = ModelFamily(
    name=NAME,
    model_types=("gemma4",),
    description="Gemma 4 (E2B/E4B/26B-A4B/31B): 2-D rotary vision encoder, k x k pooled soft tokens, images, "
    "video and text (audio not wired)",
    towers=Towers(
        vision="model.vision_tower",
        vision_blocks="model.vision_tower.encoder.layers",
        vision_mergers=("model.embed_vision",),
        decoder_layers="model.language_model.layers",
        lm_head="lm_head",
    ),
    targets=Targets(
        vision_attention=(
            "self_attn.q_proj.linear",
            "self_attn.k_proj.linear",
            "self_attn.v_proj.linear",
            "self_attn.o_proj.linear",
        ),
        vision_mlp=("mlp.gate_proj.linear", "mlp.up_proj.linear", "mlp.down_proj.linear"),
        text_attention=TEXT_ATTENTION,
        text_mlp=GATED_MLP,
        default="both",
    ),
    chat=Chat(
        processor_class="Gemma4Processor",
        load_processor=load_processor,
        reply_end_token="<turn|>",
        box_coordinates="absolute",
    ),
    image_inputs=IMAGE_INPUTS,
    video_inputs=VideoInputs(pixels="pixel_values_videos"),
    packing=Packing(
        refusal="Gemma 4's checkpoints with use_bidirectional_attention='vision' let each image's "
        "tokens attend both ways (blocks found from mm_token_type_ids), and vlft has not "
        "checked that a packed row keeps those blocks and the sliding-window layers inside "
        "each sample"
    ),
    sharding=Sharding(
        ("Gemma4TextDecoderLayer", "Gemma4VisionEncoderLayer", "Gemma4VisionPatchEmbedder", "Gemma4AudioLayer")
    ),
    vision_dummy=vision_dummy,
    trace_layer_kwargs=trace_layer_kwargs,
    tiny=Tiny(build_tiny, RECIPE),
)
