"""Qwen3.5, dense (``qwen3_5``) and MoE (``qwen3_5_moe``): native vision, hybrid decoder layers.

transformers 5.2x: ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` ->
``.model.visual`` (``Qwen3_5VisionModel``: blocks + one merger, no deepstack) and ``.model.language_model``
(``Qwen3_5TextModel``). Each decoder layer is one of ``config.text_config.layer_types``:

- "linear_attention": ``linear_attn`` = ``Qwen3_5GatedDeltaNet`` with nn.Linear ``in_proj_qkv``
  (hidden -> 2*key_dim + value_dim), ``in_proj_z`` (hidden -> value_dim, the output gate), ``in_proj_b``
  and ``in_proj_a`` (hidden -> num_value_heads: per-head beta and decay inputs), ``out_proj``
  (value_dim -> hidden); plus a depthwise ``conv1d`` (nn.Conv1d), ``A_log``, ``dt_bias`` and a gated
  RMSNorm ``norm``. Targets: in_proj_qkv, in_proj_z, out_proj (the projections that carry the token
  content). in_proj_a / in_proj_b are opt-in: tiny, and they steer the recurrence's decay.
- "full_attention": ``self_attn`` = gated attention (q_proj gives query and gate, 2x width) with
  q/k/v/o_proj.

By default every 4th layer is full attention (``full_attention_interval`` 4). The MLP is dense
(``Qwen3_5MLP``) or ``Qwen3_5MoeSparseMoeBlock`` with ``gate`` (router, bare weight), ``experts`` (fused
``gate_up_proj`` [E, 2*I, H], ``down_proj`` [E, H, I]), a dense ``shared_expert`` (gate/up/down_proj) and
``shared_expert_gate`` (nn.Linear hidden -> 1: a gate, never a target).

Without flash-linear-attention / causal-conv1d installed, transformers' torch fallbacks
(``torch_chunk_gated_delta_rule``, a conv1d) run the linear-attention layers: they serve on the CPU.
The chat template is Qwen3.5's (thinking by default): vlft renders with ``enable_thinking=False``.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor
is built or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from vlft import Chat, Experts, Kernels, Targets, Tiny

from . import _tiny
from . import qwen3_vl as q3vl
from .family import (
    QWEN_REPLY_END,
    QWEN_TOWERS,
    QWEN_VISION_ATTENTION,
    QWEN_VISION_STEM,
    fused_experts_load_kwargs,
    qwen_family,
)

SPECIAL_TOKENS = _tiny.BASE_SPECIAL_TOKENS

# Qwen3.5 preprocessor configs: the same budgets and patching as Qwen3-VL (configs/SOURCES.md)
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = q3vl.IMAGE_MIN_PIXELS, q3vl.IMAGE_MAX_PIXELS
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = q3vl.VIDEO_MIN_PIXELS, q3vl.VIDEO_MAX_PIXELS

RECIPE = {
    "version": 1,
    "family": "qwen3.5",
    "seed": 1234,
    "vocab_size": 512,
    # 2 layers: one Gated DeltaNet, one gated full attention (the published pattern is 3:1)
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        # partial_rotary_factor 0.25 of head_dim 32 -> 8 rotary dims -> mrope_section sums to 4
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
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
    ),
    "min_pixels": 64 * 64,
    "max_pixels": 128 * 128,
    "video_min_pixels": 64 * 64,
    "video_max_pixels": 4 * 128 * 128,
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}
RECIPE_MOE = dict(
    RECIPE,
    family="qwen3.5-moe",
    text={
        k: v
        for k, v in dict(
            RECIPE["text"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ).items()
        if k != "intermediate_size"
    },
)


def make_processor(tokenizer, recipe: dict | None = None, image_processor=None, video_processor=None):
    return q3vl.make_processor(
        tokenizer, recipe or RECIPE, image_processor, video_processor, chat_template=_tiny.template("qwen3_5")
    )


def _build(path: Path, recipe: dict, moe: bool, corpus=None) -> None:
    import torch
    import transformers

    tokenizer = _tiny.build_tokenizer(recipe["vocab_size"], SPECIAL_TOKENS, _tiny.QWEN3_EXTRA_TOKENS, corpus)
    cfg_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    config = cfg_cls(**_tiny.qwen3_config_kwargs(recipe, tokenizer, tie_word_embeddings=True))
    torch.manual_seed(recipe["seed"])
    model = model_cls(config)  # pyright: ignore[reportArgumentType]  # both classes chosen by moe: they match
    _tiny.initialise(model, recipe["seed"], recipe["vision_initializer_range"], recipe["embedding_row_norm"])
    if moe:
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                layer.mlp.gate.weight.normal_(0.0, recipe["initializer_range"])
    _tiny.finish_generation_config(model, tokenizer)
    _tiny.save_atomically(path, model, make_processor(tokenizer, recipe), recipe)


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    _build(path, recipe or RECIPE, moe=False, corpus=corpus)


def build_tiny_moe(path: Path, recipe: dict | None = None, corpus=None) -> None:
    _build(path, recipe or RECIPE_MOE, moe=True, corpus=corpus)


def bundled_processor(config_dir: str, tokenizer):
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
        ip,
        vp,
    )


# transformers 5.24: the linear-attention layers (3 of every 4) run a causal conv1d and the gated delta rule along
# the whole row; they restart per sample only when handed ``cu_seq_lens_q`` (flash-linear-attention and
# causal-conv1d kernels). Attention masks and segments never reach them, so packed samples would leak state.
PACKING_REFUSAL = (
    "its Gated DeltaNet linear-attention layers carry their recurrent and conv1d state along the "
    "packed row; only varlen kernels (cu_seqlens through flash-linear-attention and causal-conv1d) "
    "restart it per sample, and vlft does not wire those yet; per-sample attention does not reach "
    "those layers"
)

TARGETS = Targets(
    vision_attention=QWEN_VISION_ATTENTION,
    vision_mlp=("mlp.linear_fc1", "mlp.linear_fc2"),
    text_attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    text_linear_attention=("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"),
    # linear_attn.in_proj_a / in_proj_b (per-head gates, hidden -> num_value_heads) exist but are no targets
    text_mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
)
_COMMON: dict[str, Any] = dict(
    packing_refusal=PACKING_REFUSAL,  # qwen_family makes it the family's Packing capability's refusal
    towers=QWEN_TOWERS,
    chat=Chat(
        processor_class="Qwen3VLProcessor",
        load_processor=q3vl.load_processor,
        bundled_processor=bundled_processor,
        reply_end_token=QWEN_REPLY_END,
        box_coordinates="relative-1000",
        template_kwargs={"enable_thinking": False},
    ),
    kernels=Kernels(vision_stem=QWEN_VISION_STEM),
)


QWEN3_5 = qwen_family(
    q3vl.VISION,
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5Model",
    ("Qwen3_5DecoderLayer", "Qwen3_5VisionBlock"),
    name="qwen3.5",
    model_types=("qwen3_5",),
    description="Qwen3.5 dense: Gated DeltaNet + gated attention (3:1), patch 16 x merge 2",
    targets=TARGETS,
    tiny=Tiny(build_tiny, RECIPE),
    **_COMMON,
)

QWEN3_5_MOE = qwen_family(
    q3vl.VISION,
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeModel",
    ("Qwen3_5MoeDecoderLayer", "Qwen3_5MoeVisionBlock"),
    name="qwen3.5-moe",
    model_types=("qwen3_5_moe",),
    description="Qwen3.5 MoE: hybrid layers, routed + shared experts; fused experts via target_parameters",
    targets=replace(
        TARGETS, text_mlp=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
    ),
    experts=Experts(
        parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), routers=("mlp.gate", "mlp.shared_expert_gate")
    ),
    load_kwargs=fused_experts_load_kwargs,
    tiny=Tiny(build_tiny_moe, RECIPE_MOE),
    **_COMMON,
)

FAMILIES = (QWEN3_5, QWEN3_5_MOE)


def tiny_dir(moe: bool = False) -> Path:
    return _tiny.cached_dir(
        "qwen3.5-moe" if moe else "qwen3.5", RECIPE_MOE if moe else RECIPE, build_tiny_moe if moe else build_tiny
    )


def mtp_parameters(model) -> int:
    """Parameters of the checkpoint's multi-token-prediction head (``mtp.*``), which transformers 5.2x does
    not build (``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``) but the published safetensors carry.

    Per MTP layer: one full-attention decoder layer (same shapes as the model's own: for MoE the routed
    experts are stored per expert on disk but hold the same number of values), plus ``mtp.fc``
    (2*hidden -> hidden) and three RMSNorms (pre_fc_norm_embedding, pre_fc_norm_hidden, norm) of ``hidden``.
    Checked exactly against the tensor sums of Qwen3.5-0.8B-Base, -4B and -35B-A3B (configs/SOURCES.md).
    """
    text = model.config.text_config
    n = getattr(text, "mtp_num_hidden_layers", 0) or 0
    if not n:
        return 0
    layers = model.model.language_model.layers
    full = next(i for i, t in enumerate(text.layer_types) if t == "full_attention")
    per_layer = sum(p.numel() for p in layers[full].parameters())
    h = text.hidden_size
    return n * per_layer + 2 * h * h + 3 * h
