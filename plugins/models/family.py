"""What a model family tells the core: a plain dataclass, answered once at plan time.

This is the interface proposal for issue 20. It lives here for now; it should move to
``vlft/policies.py`` (beside ``BackendInfo``, ``MethodInfo``, ``AdapterDefaults``) so that the core and
third-party family plugins import it as ``from vlft.policies import ModelFamily``.

Imports inside functions: nothing in this module imports torch or transformers at import time (the face
of the package stays light); the helpers that need them import lazily.

A family answers for the ``model_type`` values it owns (``config.model_type`` of the checkpoint, as
transformers writes it). Module paths are dotted attribute paths from the loaded
``AutoModelForImageTextToText`` (the ``*ForConditionalGeneration`` class), not from a PEFT wrapper:
the core resolves them on ``model.get_base_model()`` when the model is wrapped.

Helpers at the bottom (``resolve_module``, ``select_target_modules``, ``smart_resize``, ``image_tokens``,
``video_tokens_qwen3``, ``rope_index_from_class``) are what the core would call; they use only what the
dataclass says, which is the point: a new family needs no core change.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import fields
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

from vlft.policies import FAMILY_TOWERS as TOWERS
from vlft.policies import ModelFamily

from . import _trace
from ._warmup import qwen_vision_dummy

# What the Qwen processors return for the model (transformers 5.2x), and how a batch joins each.
QWEN_BATCH_INPUTS = {"pixel_values": "concat", "image_grid_thw": "concat", "pixel_values_videos": "concat",
                     "video_grid_thw": "concat", "second_per_grid_ts": "concat", "mm_token_type_ids": "sequence"}


# The dataclass is the core's (vlft.policies): its defaults are neutral; these are the Qwen ones every
# family module here starts from.
QWEN_DEFAULTS = dict(
    vision_tower="model.visual",
    vision_blocks="model.visual.blocks",
    vision_mergers=("model.visual.merger",),
    decoder_layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens",
    lm_head="lm_head",
    vision_attention=("attn.qkv", "attn.proj"),
    image_token="<|image_pad|>",
    video_token="<|video_pad|>",
    vision_start_token="<|vision_start|>",
    vision_end_token="<|vision_end|>",
    patch_size=14, merge_size=2, temporal_patch_size=2,
    image_min_pixels=56 * 56, image_max_pixels=28 * 28 * 1280,
    video_min_pixels=128 * 28 * 28, video_max_pixels=28 * 28 * 768,
    reply_end_token="<|im_end|>",
)


def qwen_family(video_tokens_of=None, **fields_) -> ModelFamily:
    """A ModelFamily with the Qwen defaults, ``fields_`` on top; image grid/tokens (and, given
    ``video_tokens_of(fam, frames, height, width, ...)``, video tokens) by its own numbers, and the Qwen
    vision tracer for the memory plan. Bound as partials of the family: the dataclass stays frozen and plain."""
    base = dict(QWEN_DEFAULTS, batch_inputs=dict(QWEN_BATCH_INPUTS))
    base.update(fields_)
    fam = ModelFamily(**base)
    if fam.image_tokens is None:
        object.__setattr__(fam, "image_tokens", partial(image_tokens, fam))
    if fam.video_tokens is None and video_tokens_of is not None:
        object.__setattr__(fam, "video_tokens", partial(video_tokens_of, fam))
    if fam.image_grid is None:
        object.__setattr__(fam, "image_grid", partial(image_grid, fam))
    if fam.vision_dummy is None:
        object.__setattr__(fam, "vision_dummy", qwen_vision_dummy)
    if fam.trace_vision is None:
        object.__setattr__(fam, "trace_vision", _trace.trace_qwen_vision)
    return fam


def fused_experts_load_kwargs(param_dtype: str) -> dict:
    """``ModelFamily.load_kwargs`` of the MoE families. transformers 5.2x runs fused experts with
    ``torch._grouped_mm`` by default; its meta-device and CUDA kernels take bf16/fp16 weights only ("Expected
    mat_a to be BFloat16"), and it casts the input to the weight's dtype (autocast does not apply), so fp32
    weights take transformers' eager per-expert loop. The plan's meta copy and the run load alike."""
    return {} if param_dtype in ("bfloat16", "float16") else {"experts_implementation": "eager"}


def help_text() -> dict[str, str]:
    """Each field's help, for documentation and a docs test (every field documented)."""
    return {f.name: f.metadata.get("help", "") for f in fields(ModelFamily)}


# ------------------------------------------------------------------------------------------------------------
# Helpers the core calls with a family. They rely on the dataclass alone.
# ------------------------------------------------------------------------------------------------------------

# resolve_module, select_target_modules, frozen_router_parameters, vision_parameter_names: the core's
# (vlft.models.families), re-exported here for the family tests.
from vlft.models.families import (  # noqa: E402,F401
    FamilyTargets,
    frozen_router_parameters,
    resolve_module,
    select_target_modules,
    vision_parameter_names,
)

# --- the Qwen resize rule (transformers' qwen2_vl image processor smart_resize, restated) ------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize (5.2x), restated so the plan
    needs no transformers import; a test checks it against the processor. Note ``round`` is Python's
    banker's rounding, as in transformers."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
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


def image_grid(family: ModelFamily, height: int, width: int, min_pixels: int | None = None,
               max_pixels: int | None = None) -> tuple[int, int, int]:
    """(t, h, w) patch grid of one image, as ``image_grid_thw`` gives it."""
    factor = family.patch_size * family.merge_size
    h, w = smart_resize(height, width, factor,
                        family.image_min_pixels if min_pixels is None else min_pixels,
                        family.image_max_pixels if max_pixels is None else max_pixels)
    return 1, h // family.patch_size, w // family.patch_size


def image_tokens(family: ModelFamily, height: int, width: int, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> int:
    t, h, w = image_grid(family, height, width, min_pixels, max_pixels)
    return t * h * w // family.merge_size ** 2


def video_smart_resize_qwen3(frames: int, height: int, width: int, temporal_factor: int, factor: int,
                             min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize (5.2x): the budget covers all
    frames (t * h * w), and frames smaller than the factor are first scaled up."""
    if frames < temporal_factor:
        raise ValueError(f"t:{frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
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


def video_grid_qwen3(family: ModelFamily, frames: int, height: int, width: int, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> tuple[int, int, int]:
    """(t, h, w) grid of a clip of ``frames`` sampled frames (Qwen3-VL / Qwen3.5 video processor,
    ``cap_pixels_per_frame`` off: transformers' 5.2x default)."""
    factor = family.patch_size * family.merge_size
    h, w = video_smart_resize_qwen3(frames, height, width, family.temporal_patch_size, factor,
                                    family.video_min_pixels if min_pixels is None else min_pixels,
                                    family.video_max_pixels if max_pixels is None else max_pixels)
    t = (frames + -frames % family.temporal_patch_size) // family.temporal_patch_size
    return t, h // family.patch_size, w // family.patch_size


def video_tokens_qwen3(family: ModelFamily, frames: int, height: int, width: int, **budget) -> int:
    t, h, w = video_grid_qwen3(family, frames, height, width, **budget)
    return t * h * w // family.merge_size ** 2


def video_smart_resize_qwen2(frames: int, height: int, width: int, factor: int, min_pixels: int,
                             max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL / Qwen2.5-VL video processor: the image rule applied per frame."""
    return smart_resize(height, width, factor, min_pixels, max_pixels)


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

    def rope_index(model_config, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None,
                   second_per_grid_ts=None, mm_token_type_ids_=None):
        import torch

        cls = getattr(importlib.import_module(module_name), cls_name)
        ids = torch.as_tensor(input_ids).reshape(1, -1)
        types_ = (mm_token_type_ids(ids, model_config.image_token_id, getattr(model_config, "video_token_id", None))
                  if mm_token_type_ids_ is None else torch.as_tensor(mm_token_type_ids_).reshape(1, -1))
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


_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)*$")


def check_family(family: ModelFamily) -> list[str]:
    """Problems with a family's declared fields (no model needed): for a meta-test over all families."""
    problems = []
    for name in ("vision_tower", "vision_blocks", "decoder_layers", "embed_tokens", "lm_head", *()):
        if not _PATH.match(getattr(family, name)):
            problems.append(f"{family.name}: {name} is not a dotted path")
    if not family.model_types:
        problems.append(f"{family.name}: owns no model_type")
    if family.default_targets not in TOWERS:
        problems.append(f"{family.name}: default_targets {family.default_targets!r}")
    if not family.vision_blocks.startswith(family.vision_tower + "."):
        problems.append(f"{family.name}: vision_blocks is not under vision_tower")
    for m in family.vision_mergers:  # a projector may live outside the tower (Gemma 3, LLaVA): still vision side
        if not _PATH.match(m):
            problems.append(f"{family.name}: merger {m} is not a dotted path")
    return problems


def count_parameters(model) -> dict[str, int]:
    """total / vision / experts parameter counts (tied tensors once), as the memory plan needs them."""
    total = vision = experts = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".visual." in f".{name}":
            vision += n
        if ".experts." in name:
            experts += n
    return {"total": total, "vision": vision, "experts": experts, "text": total - vision}
