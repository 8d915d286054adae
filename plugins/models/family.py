"""What a model family tells the core: a plain dataclass, answered once at plan time.

This is the interface proposal for issue 20. It lives here for now; it should move to
``vlft/policies.py`` (beside ``BackendInfo``, ``MethodInfo``, ``AdapterDefaults``) so that the core and
third-party family plugins import it as ``from vlft.policies import ModelFamily``. Nothing in this
module imports torch or transformers at import time (the face of the package stays light); the helpers
that need them import lazily.

A family answers for the ``model_type`` values it owns (``config.model_type`` of the checkpoint, as
transformers writes it). Module paths are dotted attribute paths from the loaded
``AutoModelForImageTextToText`` (the ``*ForConditionalGeneration`` class), not from a PEFT wrapper:
the core resolves them on ``model.get_base_model()`` when the model is wrapped.

Helpers at the bottom (``resolve_module``, ``select_target_modules``, ``smart_resize``, ``image_tokens``,
``video_tokens_qwen3``, ``rope_index_from_class``) are what the core would call; they use only what the
dataclass says, which is the point: a new family needs no core change.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

TOWERS = ("vision", "text", "both")
# What the Qwen processors return for the model (transformers 5.2x), and how a batch joins each.
QWEN_BATCH_INPUTS = {"pixel_values": "concat", "image_grid_thw": "concat", "pixel_values_videos": "concat",
                     "video_grid_thw": "concat", "second_per_grid_ts": "concat", "mm_token_type_ids": "sequence"}


@dataclass(frozen=True)
class ModelFamily:
    """Everything vlft needs to know about one model family (one or more ``model_type`` values)."""

    # --- identity -------------------------------------------------------------------------------------
    name: str = field(metadata={"help": "Short name, used in `--model embedded:<name>` and `vlft plugins`, "
                                        "e.g. 'qwen3-vl'."})
    model_types: tuple[str, ...] = field(metadata={"help": "The `config.model_type` values this family owns, "
                                                           "e.g. ('qwen3_vl',)."})
    description: str = field(default="", metadata={"help": "One line for `vlft plugins`."})

    # --- towers (dotted paths from the *ForConditionalGeneration model) --------------------------------
    vision_tower: str = field(default="model.visual", metadata={
        "help": "The vision encoder module; everything under it (blocks, mergers, patch embedding) is the "
                "vision side for freezing, memory accounting and dtype policies."})
    vision_blocks: str = field(default="model.visual.blocks", metadata={
        "help": "The nn.ModuleList of vision transformer blocks; `--vision-last-n N` adapts its last N."})
    vision_mergers: tuple[str, ...] = field(default=("model.visual.merger",), metadata={
        "help": "Projector(s) from the vision width to the text width. Qwen3-VL also has "
                "`model.visual.deepstack_merger_list` (a ModuleList): it belongs to the vision side and stays "
                "frozen with the tower unless the plan adapts it."})
    decoder_layers: str = field(default="model.language_model.layers", metadata={
        "help": "The nn.ModuleList of text decoder layers."})
    embed_tokens: str = field(default="model.language_model.embed_tokens", metadata={
        "help": "The input token embedding (tied to the head where `tie_word_embeddings`)."})
    lm_head: str = field(default="lm_head", metadata={"help": "The output head (logits)."})

    # --- what --targets / --vision-last-n select (leaf names of nn.Linear modules) ---------------------
    vision_attention: tuple[str, ...] = field(default=("attn.qkv", "attn.proj"), metadata={
        "help": "Linear modules inside each vision block for attention, as paths relative to the block "
                "(the leaf name alone is ambiguous: Qwen2.5-VL's vision MLP and text MLP share names)."})
    vision_mlp: tuple[str, ...] = field(default=(), metadata={
        "help": "Linear modules inside each vision block for the MLP, relative to the block."})
    text_attention: tuple[str, ...] = field(default=("self_attn.q_proj", "self_attn.k_proj",
                                                     "self_attn.v_proj", "self_attn.o_proj"), metadata={
        "help": "Linear modules inside each decoder layer for (full) attention, relative to the layer."})
    text_linear_attention: tuple[str, ...] = field(default=(), metadata={
        "help": "Linear modules of linear-attention layers (Qwen3.5's Gated DeltaNet, `linear_attn.*`) that "
                "are targets. Layers of the other type simply lack them."})
    text_linear_attention_optional: tuple[str, ...] = field(default=(), metadata={
        "help": "Linear modules of linear-attention layers that exist but are not targets by default "
                "(Qwen3.5's per-head gates `in_proj_a`/`in_proj_b`, hidden -> num_value_heads)."})
    text_mlp: tuple[str, ...] = field(default=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), metadata={
        "help": "Linear modules inside each decoder layer for the dense MLP (or a MoE's shared expert)."})
    default_targets: str = field(default="both", metadata={"help": "What `--targets auto` means: vision, text "
                                                                      "or both."})
    default_vision_last_n: int = field(default=6, metadata={"help": "Default `--vision-last-n`."})
    default_parts: tuple[str, ...] = field(default=("attention",), metadata={
        "help": "Which module groups an adapter takes by default: 'attention' (today's behaviour: "
                "q/k/v/o and the vision qkv/proj, plus linear attention), 'mlp', or both."})

    # --- mixture of experts ------------------------------------------------------------------------------
    expert_parameters: tuple[str, ...] = field(default=(), metadata={
        "help": "Fused 3-D expert weights, relative to a decoder layer, for PEFT's `target_parameters` "
                "(e.g. 'mlp.experts.gate_up_proj' [E, 2*I, H] and 'mlp.experts.down_proj' [E, H, I]). Empty for "
                "dense models. Not adapted unless asked."})
    router_modules: tuple[str, ...] = field(default=(), metadata={
        "help": "Router / gate modules relative to a decoder layer; they always stay frozen and are never "
                "targets (Qwen3-VL MoE 'mlp.gate'; Qwen3.5 MoE also 'mlp.shared_expert_gate', an nn.Linear "
                "hidden->1 that a leaf-name 'gate' match would otherwise catch)."})

    # --- tokens and the resize rule --------------------------------------------------------------------
    image_token: str = field(default="<|image_pad|>", metadata={"help": "Placeholder repeated once per image "
                                                                         "token."})
    video_token: str = field(default="<|video_pad|>", metadata={"help": "Placeholder repeated once per video "
                                                                         "token."})
    vision_start_token: str = field(default="<|vision_start|>", metadata={"help": "Opens an image/video (per "
                                                                                   "frame for Qwen3-VL/3.5)."})
    vision_end_token: str = field(default="<|vision_end|>", metadata={"help": "Closes it."})
    patch_size: int = field(default=14, metadata={"help": "Vision patch side in pixels."})
    merge_size: int = field(default=2, metadata={"help": "Spatial merge (tokens = patches / merge_size**2)."})
    temporal_patch_size: int = field(default=2, metadata={"help": "Frames per temporal patch."})
    image_min_pixels: int = field(default=56 * 56, metadata={"help": "The image processor's default "
                                                                      "size['shortest_edge'] (a pixel budget)."})
    image_max_pixels: int = field(default=28 * 28 * 1280, metadata={"help": "Default size['longest_edge']."})
    video_min_pixels: int = field(default=128 * 28 * 28, metadata={"help": "The video processor's default "
                                                                           "size['shortest_edge']."})
    video_max_pixels: int = field(default=28 * 28 * 768, metadata={"help": "Default size['longest_edge'] "
                                                                          "(Qwen3-VL: over all frames)."})
    image_tokens: Callable[..., int] | None = field(default=None, compare=False, metadata={
        "help": "image_tokens(height, width, min_pixels=None, max_pixels=None) -> LLM tokens of one image "
                "by the family's own resize rule (None: the defaults above)."})
    video_tokens: Callable[..., int] | None = field(default=None, compare=False, metadata={
        "help": "video_tokens(frames, height, width, min_pixels=None, max_pixels=None) -> video pad tokens "
                "(excluding per-frame timestamps and vision start/end, which are text)."})
    box_coordinates: str = field(default="absolute", metadata={
        "help": "Grounding convention: 'absolute' pixels of the resized image (Qwen2.5-VL) or 'relative-1000' "
                "(Qwen3-VL, Qwen3.5). vlft never converts silently."})

    # --- processor ---------------------------------------------------------------------------------------
    processor_class: str = field(default="", metadata={"help": "transformers processor class name."})
    load_processor: Callable[[str], Any] | None = field(default=None, compare=False, metadata={
        "help": "load_processor(path) -> processor for a model folder (AutoProcessor by default)."})
    bundled_processor: Callable[[str, Any], Any] | None = field(default=None, compare=False, metadata={
        "help": "bundled_processor(config_dir, tokenizer) -> processor for a weightless bundled config: its "
                "image/video processor from the folder, the given stand-in tokenizer, the family's template."})
    reply_end_token: str = field(default="<|im_end|>", metadata={
        "help": "The token that closes an assistant turn in the template (the trained reply ends there). Qwen: "
                "<|im_end|> (= the tokenizer's eos). Gemma 3: <end_of_turn>, while its eos is <eos>."})
    batch_inputs: dict = field(default_factory=lambda: dict(QWEN_BATCH_INPUTS), compare=False, metadata={
        "help": "Processor outputs the model takes besides input_ids/attention_mask/labels, and how a batch "
                "joins them: 'concat' (along dim 0: pixel_values, image_grid_thw, ...) or 'sequence' (one value "
                "per token, padded like input_ids with 0: mm_token_type_ids, Gemma 3's token_type_ids)."})
    chat_template_kwargs: dict = field(default_factory=dict, compare=False, metadata={
        "help": "Extra keyword arguments for apply_chat_template (Qwen3.5: enable_thinking=False, so prompt "
                "and reply split cleanly)."})

    # --- sharding, positions -------------------------------------------------------------------------------
    no_split_modules: tuple[str, ...] = field(default=(), metadata={
        "help": "Block classes FSDP shards as units (the model class's `_no_split_modules`)."})
    rope_index: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "rope_index(model_config, input_ids [L], image_grid_thw=None, video_grid_thw=None, "
                "attention_mask=None, second_per_grid_ts=None) -> LongTensor [3, 1, L]: the 3-D mRoPE "
                "positions of ONE sample, exactly as the model computes them (for packing: per sample, "
                "then concatenate). None: the model uses plain 1-D positions (Gemma 3, LLaVA, InternVL)."})

    # --- embedded tiny model, bundled configs --------------------------------------------------------------
    build_tiny: Callable[[Any], None] | None = field(default=None, compare=False, metadata={
        "help": "build_tiny(path): writes a tiny random model of the family + processor there (offline)."})
    tiny_recipe: dict = field(default_factory=dict, compare=False, metadata={
        "help": "The tiny model's recipe; its hash names the cache folder."})
    bundled_configs: tuple[str, ...] = field(default=(), metadata={
        "help": "Names of bundled planning configs (folders under plugins/models/configs)."})

    # --- derived views ------------------------------------------------------------------------------------
    def vision_targets(self) -> tuple[str, ...]:
        parts = self.default_parts
        return (self.vision_attention if "attention" in parts else ()) + (self.vision_mlp if "mlp" in parts else ())

    def text_targets(self) -> tuple[str, ...]:
        parts = self.default_parts
        out = (self.text_attention + self.text_linear_attention) if "attention" in parts else ()
        return out + (self.text_mlp if "mlp" in parts else ())

    def owns(self, model_type: str) -> bool:
        return model_type in self.model_types

    def count_image_tokens(self, height: int, width: int, **budget) -> int:
        fn = self.image_tokens or (lambda h, w, **b: image_tokens(self, h, w, **b))
        return fn(height, width, **budget)

    def count_video_tokens(self, frames: int, height: int, width: int, **budget) -> int:
        if self.video_tokens is None:
            raise NotImplementedError(f"family {self.name} gives no video token count")
        return self.video_tokens(frames, height, width, **budget)

    def describe(self) -> dict:
        """Plain-data view (callables by name) for `vlft plugins --json` and the plan report."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = getattr(v, "__qualname__", repr(v)) if callable(v) else v
        return out


def help_text() -> dict[str, str]:
    """Each field's help, for documentation and a docs test (every field documented)."""
    return {f.name: f.metadata.get("help", "") for f in fields(ModelFamily)}


# ------------------------------------------------------------------------------------------------------------
# Helpers the core calls with a family. They rely on the dataclass alone.
# ------------------------------------------------------------------------------------------------------------

def resolve_module(model, path: str):
    """The module at a dotted path; raises AttributeError naming the missing step."""
    obj = model
    for step in path.split("."):
        if not hasattr(obj, step):
            raise AttributeError(f"{type(model).__name__} has no '{path}' (missing '{step}')")
        obj = getattr(obj, step)
    return obj


@dataclass
class FamilyTargets:
    """What an adapter goes on, by family paths: module names and (MoE) parameter names."""

    modules: list[str]
    parameters: list[str]
    vision_blocks: list[int]
    vision_depth: int
    text_layers: int


def select_target_modules(model, family: ModelFamily, targets: str, vision_last_n: int,
                          experts: bool = False, parts: tuple[str, ...] | None = None) -> FamilyTargets:
    """Full names of the nn.Linear modules (and, with ``experts``, fused expert parameters) to adapt.

    ``targets`` is vision / text / both / auto. Only modules that exist and are nn.Linear are returned, so a
    hybrid model's layers each contribute the names they have (Qwen3.5: linear_attn.* in Gated DeltaNet
    layers, self_attn.* in the full-attention ones).
    """
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = "" if base is model else _prefix_of(model, base)
    towers = family.default_targets if targets == "auto" else targets
    if towers not in TOWERS:
        raise ValueError(f"targets must be one of {TOWERS} or auto, not {targets!r}")
    if parts is not None:
        family = _with_parts(family, parts)
    blocks = resolve_module(base, family.vision_blocks)
    layers = resolve_module(base, family.decoder_layers)
    depth = len(blocks)
    chosen = list(range(depth))[-vision_last_n:] if vision_last_n else []

    def linear_names(container_path, index, rel_names):
        out = []
        for rel in rel_names:
            full = f"{container_path}.{index}.{rel}"
            try:
                mod = resolve_module(base, full)
            except AttributeError:
                continue  # e.g. a linear-attention projection in a full-attention layer
            if isinstance(mod, torch.nn.Linear):
                out.append(prefix + full)
        return out

    modules: list[str] = []
    if towers in ("vision", "both"):
        for b in chosen:
            modules += linear_names(family.vision_blocks, b, family.vision_targets())
    params: list[str] = []
    if towers in ("text", "both"):
        for i in range(len(layers)):
            modules += linear_names(family.decoder_layers, i, family.text_targets())
            if experts:
                for rel in family.expert_parameters:
                    full = f"{family.decoder_layers}.{i}.{rel}"
                    try:
                        p = resolve_module(base, full)
                    except AttributeError:
                        continue
                    if isinstance(p, torch.nn.Parameter):
                        params.append(prefix + full)
    return FamilyTargets(modules, params, chosen if towers != "text" else [], depth, len(layers))


def frozen_router_parameters(model, family: ModelFamily) -> list[str]:
    """Names of router parameters (must stay requires_grad=False, whatever the method does)."""
    names = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = resolve_module(base, family.decoder_layers)
    for i in range(len(layers)):
        for rel in family.router_modules:
            try:
                mod = resolve_module(base, f"{family.decoder_layers}.{i}.{rel}")
            except AttributeError:
                continue
            names += [f"{family.decoder_layers}.{i}.{rel}.{n}" for n, _ in mod.named_parameters()]
    return names


def vision_parameter_names(model, family: ModelFamily) -> list[str]:
    """Every vision-side parameter: the tower (blocks, patch embedding, Qwen's mergers and deepstack mergers)
    and any projector outside it (Gemma 3's multi_modal_projector)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = []
    for root in (family.vision_tower, *family.vision_mergers):
        if root.startswith(family.vision_tower + "."):
            continue  # already under the tower
        names += [f"{root}.{n}" for n, _ in resolve_module(base, root).named_parameters()]
    return names


def _prefix_of(wrapper, base) -> str:
    for name, mod in wrapper.named_modules():
        if mod is base:
            return name + "." if name else ""
    return ""


def _with_parts(family: ModelFamily, parts):
    from dataclasses import replace

    return replace(family, default_parts=tuple(parts))


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
        import importlib
        from types import SimpleNamespace

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
