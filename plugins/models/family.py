"""What the built-in families share: the Qwen image and video numbers and functions (``QwenVision``), the
Qwen resize rules restated, the per-sample rope index from a model class, ``qwen_family`` (a ``vlft.ModelFamily``
with the Qwen towers and capabilities), and the target names several families use.

A family answers for the ``model_type`` values it owns (``config.model_type`` of the checkpoint, as
transformers writes it); its contract is ``vlft.ModelFamily`` (docs/writing-plugins.md, 'A model family').

Imports inside functions: torch and transformers, only when a record is encoded or positions are computed
(registering the plugin loads neither).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from vlft import (
    Experts,
    ImageInputs,
    ModelFamily,
    Packing,
    Positions,
    Sharding,
    Towers,
    VideoInputs,
    Written,
    tokenize_pieces,
)

from . import _trace
from ._warmup import qwen_vision_dummy

# What the Qwen processors return for the model (transformers 5.2x), and how a batch joins each: the core
# joins them as declared (ImageInputs.batch_inputs) and never names one.
QWEN_BATCH_INPUTS = {
    "pixel_values": "concat",
    "image_grid_thw": "concat",
    "pixel_values_videos": "concat",
    "video_grid_thw": "concat",
    "second_per_grid_ts": "concat",
    "mm_token_type_ids": "sequence",
}

# Target leaf names several families share (module paths within a block): a Llama-style text attention and
# gated MLP, and SigLIP's vision attention and MLP.
TEXT_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
GATED_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SIGLIP_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
SIGLIP_MLP = ("mlp.fc1", "mlp.fc2")

# The module tree of Qwen's towers (model.visual + model.language_model), which GLM-4.1V shares too, and
# what the Qwen vision blocks adapt, their patch embedding and the token that ends a Qwen reply.
QWEN_TOWERS = Towers(
    vision="model.visual",
    vision_blocks="model.visual.blocks",
    vision_mergers=("model.visual.merger",),
    decoder_layers="model.language_model.layers",
    lm_head="lm_head",
)
QWEN_VISION_ATTENTION = ("attn.qkv", "attn.proj")
QWEN_VISION_STEM = "model.visual.patch_embed"
QWEN_REPLY_END = "<|im_end|>"


@dataclass(frozen=True)
class QwenVision:
    """The Qwen image and video processors' numbers (patch side, spatial merge, temporal patch, default pixel
    budgets) and the image-input functions over them: a record's images become ``pixel_values`` and
    ``image_grid_thw``, each image's placeholder is repeated once per LLM token of its grid, and every token
    gets its modality type (``mm_token_type_ids``: 0 text, 1 image, 2 video). Moved here from the core's
    encoder and collator, unchanged. ``video_rule``: 'qwen2' resizes each frame by the image rule, 'qwen3'
    spreads the budget over all frames."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_min_pixels: int = 56 * 56
    image_max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    video_rule: str = "qwen2"

    # --- the resize rule -------------------------------------------------------------------------------------
    def image_grid(
        self, height: int, width: int, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> tuple[int, int, int]:
        """(t, h, w) patch grid of one image, as ``image_grid_thw`` gives it."""
        return _image_grid(self, height, width, min_pixels, max_pixels)

    def image_tokens(
        self, height: int, width: int, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> int:
        t, h, w = self.image_grid(height, width, min_pixels, max_pixels)
        return t * h * w // self.merge_size**2

    def capped_grid(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int, int]:
        """``ImageInputs.grid``: the grid under ``--max-pixels`` (the floor lowered with it, as the encoder does)."""
        if max_pixels is None:
            return self.image_grid(height, width)
        return self.image_grid(height, width, min(self.image_min_pixels, max_pixels), max_pixels)

    def video_grid(
        self, frames: int, height: int, width: int, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> tuple[int, int, int]:
        lo = self.video_min_pixels if min_pixels is None else min_pixels
        hi = self.video_max_pixels if max_pixels is None else max_pixels
        factor = self.patch_size * self.merge_size
        if self.video_rule == "qwen3":
            h, w = video_smart_resize_qwen3(frames, height, width, self.temporal_patch_size, factor, lo, hi)
            t = (frames + -frames % self.temporal_patch_size) // self.temporal_patch_size
        else:  # Qwen2VLVideoProcessor: the image rule per frame; frames padded to the temporal patch
            h, w = smart_resize(height, width, factor, lo, hi)
            t = (frames + self.temporal_patch_size - 1) // self.temporal_patch_size
        return t, h // self.patch_size, w // self.patch_size

    def video_tokens(self, frames: int, height: int, width: int, **budget) -> int:
        t, h, w = self.video_grid(frames, height, width, **budget)
        return t * h * w // self.merge_size**2

    # --- ImageInputs: prepare once per record, write once per conversation --------------------------------------
    def prepare(self, processor, media, max_pixels=None) -> dict:
        import torch

        kwargs = _size_kwargs(processor, max_pixels)
        out: dict = {"inputs": {}, "image_grids": None, "video_grids": None}
        if media.images:
            done = processor.image_processor(images=list(media.images), return_tensors="pt", **kwargs)
            out["inputs"].update(pixel_values=done["pixel_values"], image_grid_thw=done["image_grid_thw"])
            out["image_grids"] = done["image_grid_thw"]
        elif media.images is None and media.sizes:  # measuring: the grid by the formula, no pixels
            size = kwargs.get("size", processor.image_processor.size)
            out["image_grids"] = torch.tensor(
                [self.image_grid(h, w, size["shortest_edge"], size["longest_edge"]) for w, h in media.sizes]
            )
        if media.videos:
            vp = processor.video_processor
            # frames are already sampled, at the rate given with each clip; the processor must not sample again
            done = vp(videos=[clip for clip, _ in media.videos], return_tensors="pt", do_sample_frames=False, **kwargs)
            seconds = torch.tensor([vp.temporal_patch_size / rate for _, rate in media.videos], dtype=torch.float32)
            out["inputs"].update(
                pixel_values_videos=done["pixel_values_videos"],
                video_grid_thw=done["video_grid_thw"],
                second_per_grid_ts=seconds,
            )
            out["video_grids"] = done["video_grid_thw"]
        return out

    def write(self, processor, texts: list[str], prepared: dict):
        import torch

        merge_length = getattr(processor.image_processor, "merge_size", 1) ** 2

        def tokens(grids):
            return iter([int(g.prod()) // merge_length for g in grids] if grids is not None else [])

        image_token, video_token = processor.image_token, getattr(processor, "video_token", None)
        counts = {image_token: tokens(prepared["image_grids"]), video_token: tokens(prepared["video_grids"])}
        pads = re.compile("|".join(re.escape(t) for t in counts if t))
        texts = [pads.sub(lambda m: m.group(0) * next(counts[m.group(0)]), text) for text in texts]
        ids = tokenize_pieces(processor.tokenizer, texts)
        flat = torch.tensor([i for piece in ids for i in piece], dtype=torch.long)
        # 1 image, 2 video: the 3-D rotary positions space video tokens out in time
        types = (flat == processor.image_token_id).long()
        video_id = getattr(processor, "video_token_id", None)
        if video_id is not None:
            types = types + 2 * (flat == video_id).long()
        grids = [
            tuple(int(x) for x in g)
            for key in ("image_grids", "video_grids")
            for g in (prepared[key] if prepared[key] is not None else [])
        ]
        return Written(ids, {**prepared["inputs"], "mm_token_type_ids": types}, grids)

    def capabilities(self, trace=None) -> dict:
        """The family's ``image_inputs`` and ``video_inputs``."""
        return dict(
            image_inputs=ImageInputs(
                prepare=self.prepare,
                write=self.write,
                batch_inputs=dict(QWEN_BATCH_INPUTS),
                pixels="pixel_values",
                size_cap="a pixel budget per image (the image processor's size['longest_edge']): the resize keeps "
                "the aspect ratio and rounds each side to the patch x merge factor",
                grid=self.capped_grid,
                patch_size=self.patch_size,
                patches_per_token=self.merge_size**2,
                trace=trace,
            ),
            video_inputs=VideoInputs(pixels="pixel_values_videos", grid=self.video_grid),
        )


@lru_cache(maxsize=4096)
def _image_grid(vision: QwenVision, height: int, width: int, min_pixels, max_pixels) -> tuple[int, int, int]:
    """Remembered per size: a data set holds few sizes."""
    factor = vision.patch_size * vision.merge_size
    h, w = smart_resize(
        height,
        width,
        factor,
        vision.image_min_pixels if min_pixels is None else min_pixels,
        vision.image_max_pixels if max_pixels is None else max_pixels,
    )
    return 1, h // vision.patch_size, w // vision.patch_size


def _size_kwargs(processor, max_pixels) -> dict:
    """``--max-pixels`` as the Qwen processors take it: ``size['longest_edge']`` is a pixel budget (and the floor
    ``shortest_edge`` is lowered to it). Applied to the image and the video processor alike."""
    size = getattr(processor.image_processor, "size", None) or {}
    if max_pixels is None or "longest_edge" not in size:
        return {}
    size = dict(size)
    size["longest_edge"] = max_pixels
    size["shortest_edge"] = min(size.get("shortest_edge", max_pixels), max_pixels)
    return {"size": size}


class SampleRopeIndex:
    """``Positions.rope_index`` of a Qwen family: a sample's grids read from its own inputs, then the model
    class's ``get_rope_index`` (``rope_index_from_class``)."""

    def __init__(self, rope_index):
        self.rope_index = rope_index
        self.__qualname__ = rope_index.__qualname__

    def __call__(self, model_config, sample: dict):
        return self.rope_index(
            model_config,
            sample["input_ids"],
            image_grid_thw=sample.get("image_grid_thw"),
            video_grid_thw=sample.get("video_grid_thw"),
            second_per_grid_ts=sample.get("second_per_grid_ts"),
        )


def qwen_family(
    vision: QwenVision,
    rope_class: str,
    no_split_modules: tuple[str, ...],
    packing_refusal: str = "",
    experts: Experts | None = None,
    marked_inputs: dict[str, tuple[str, ...]] | None = None,
    **fields_,
) -> ModelFamily:
    """A ModelFamily with the Qwen towers and warm-up, ``fields_`` on top, and its capabilities: image and video
    inputs by ``vision``'s numbers (with the Qwen vision tracer for the memory plan), 3-D positions by
    ``rope_class``'s ``get_rope_index``, packing (or its refusal), FSDP units with the inputs a sequence split
    cuts besides the tokens (``marked_inputs``) and, for a MoE family, ``experts``."""
    base = dict(towers=QWEN_TOWERS, vision_dummy=qwen_vision_dummy)
    base.update(fields_)
    return ModelFamily(
        **base,
        **vision.capabilities(trace=_trace.trace_qwen_vision),
        positions=Positions(SampleRopeIndex(rope_index_from_class(rope_class))),
        packing=Packing(refusal=packing_refusal),
        sharding=Sharding(no_split_modules, marked_inputs or {}),
        experts=experts,
    )


def fused_experts_load_kwargs(param_dtype: str) -> dict:
    """``ModelFamily.load_kwargs`` of the MoE families. transformers 5.2x runs fused experts with
    ``torch._grouped_mm`` by default; its meta-device and CUDA kernels take bf16/fp16 weights only ("Expected
    mat_a to be BFloat16"), and it casts the input to the weight's dtype (autocast does not apply), so fp32
    weights take transformers' eager per-expert loop. The plan's meta copy and the run load alike."""
    return {} if param_dtype in ("bfloat16", "float16") else {"experts_implementation": "eager"}


# --- the Qwen resize rule (transformers' qwen2_vl image processor smart_resize, restated) ------------------


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize (5.2x), restated so the plan
    needs no transformers import; a test checks it against the processor. Note ``round`` is Python's
    banker's rounding, as in transformers."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_smart_resize_qwen3(
    frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize (5.2x): the budget covers all
    frames (t * h * w), and frames smaller than the factor are first scaled up."""
    if frames < temporal_factor:
        raise ValueError(f"t:{frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# --- positions -------------------------------------------------------------------------------------------


def mm_token_type_ids(input_ids, image_token_id: int, video_token_id: int | None):
    """0 text, 1 image, 2 video: what transformers 5.2x's get_rope_index groups positions by."""
    out = (input_ids == image_token_id).long()
    if video_token_id is not None:
        out = out + 2 * (input_ids == video_token_id).long()
    return out


def rope_index_from_class(model_class_path: str) -> Callable[..., Any]:
    """A per-sample rope-index callable that runs the model class's own ``get_rope_index``.

    transformers 5.2x: ``XModel.get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None,
    video_grid_thw=None, [second_per_grid_ts=None,] attention_mask=None) -> (position_ids [3, B, L],
    deltas [B, 1])``; it reads only ``self.config`` (vision_config.spatial_merge_size, and for Qwen2.5-VL
    vision_config.tokens_per_second) and ``self.get_vision_position_ids`` (which uses no state). So it is
    called unbound on a stand-in holding the model config: no model instance, usable in a DataLoader worker.
    A test compares it with the positions the model computes in its own forward.
    """
    module_name, cls_name = model_class_path.rsplit(".", 1)

    def rope_index(
        model_config,
        input_ids,
        image_grid_thw=None,
        video_grid_thw=None,
        attention_mask=None,
        second_per_grid_ts=None,
        mm_token_type_ids_=None,
    ):
        import torch

        cls = getattr(importlib.import_module(module_name), cls_name)
        ids = torch.as_tensor(input_ids).reshape(1, -1)
        types_ = (
            mm_token_type_ids(ids, model_config.image_token_id, getattr(model_config, "video_token_id", None))
            if mm_token_type_ids_ is None
            else torch.as_tensor(mm_token_type_ids_).reshape(1, -1)
        )
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).reshape(1, -1)
        stand_in = SimpleNamespace(config=model_config)
        stand_in.get_vision_position_ids = lambda *a, **k: cls.get_vision_position_ids(stand_in, *a, **k)
        kwargs = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, attention_mask=mask)
        if second_per_grid_ts is not None:
            kwargs["second_per_grid_ts"] = second_per_grid_ts
        if video_grid_thw is not None:
            kwargs["video_grid_thw"] = video_grid_thw.clone()  # Qwen3-VL edits it in place (t -> 1 per frame)
        if image_grid_thw is None and video_grid_thw is None:
            # text only: the model uses plain 1-D positions broadcast to 3 rows (masked tokens at 1... see NOTES)
            n = ids.shape[1]
            if mask is None:
                pos = torch.arange(n)
            else:
                pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[0]
            return pos.view(1, 1, -1).expand(3, 1, -1).clone()
        position_ids, _ = cls.get_rope_index(stand_in, ids, mm_token_type_ids=types_, **kwargs)
        return position_ids

    rope_index.__qualname__ = f"rope_index[{cls_name}.get_rope_index]"
    return rope_index
