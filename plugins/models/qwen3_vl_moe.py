"""Qwen3-VL MoE: 30B-A3B and 235B-A22B. ``model_type`` "qwen3_vl_moe".

Same vision tower, processor, template and rope index as dense Qwen3-VL. The decoder MLP is
``Qwen3VLMoeTextSparseMoeBlock``: ``mlp.gate`` (``Qwen3VLMoeTextTopKRouter``, a bare ``weight`` [E, H]
parameter, not an nn.Linear) and ``mlp.experts`` (``Qwen3VLMoeTextExperts``: fused 3-D parameters
``gate_up_proj`` [E, 2*I, H] and ``down_proj`` [E, H, I], I = moe_intermediate_size). There is no shared
expert. Layers listed in ``mlp_only_layers`` (none in the published configs) keep a dense
``Qwen3VLMoeTextMLP`` with gate/up/down_proj.

Adapters go on attention by default. Expert LoRA is opt-in through PEFT's ``target_parameters`` (the
names in ``experts.parameters``); the router never trains. transformers 5.2x does compute a
load-balancing loss when ``output_router_logits=True`` (off by default); with a frozen router it only
pushes the adapters upstream of the router, so vlft should leave it off.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor
is built or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from vlft import Experts, Kernels, Tiny

from . import _tiny
from . import qwen3_vl as dense
from .family import QWEN_VISION_STEM, fused_experts_load_kwargs, qwen_family

NAME = "qwen3-vl-moe"

RECIPE: dict[str, Any] = dict(
    dense.RECIPE,
    version=1,
    family=NAME,
    text=dict(
        dense.RECIPE["text"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
)


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    r = recipe or RECIPE
    tokenizer = _tiny.build_tokenizer(r["vocab_size"], dense.SPECIAL_TOKENS, _tiny.QWEN3_EXTRA_TOKENS, corpus)
    config = Qwen3VLMoeConfig(**_tiny.qwen3_config_kwargs(r, tokenizer))
    torch.manual_seed(r["seed"])
    model = Qwen3VLMoeForConditionalGeneration(config)
    _tiny.initialise(model, r["seed"], r["vision_initializer_range"], r["embedding_row_norm"])
    with torch.no_grad():  # the router starts at zeros in __init__; give it a spread so experts differ
        for layer in model.model.language_model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and not isinstance(gate, torch.nn.Linear):
                gate.weight.normal_(0.0, r["initializer_range"])
    _tiny.finish_generation_config(model, tokenizer)
    _tiny.save_atomically(path, model, dense.make_processor(tokenizer, r), r)


def tiny_dir() -> Path:
    return _tiny.cached_dir(NAME, RECIPE, build_tiny)


FAMILY = qwen_family(
    dense.VISION,
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeModel",
    ("Qwen3VLMoeTextDecoderLayer", "Qwen3VLMoeVisionBlock"),
    experts=Experts(parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), routers=("mlp.gate",)),
    towers=dense.TOWERS,
    # no dense MLP and no shared expert in its decoder layers: the fused experts are the MLP (experts.parameters);
    # the dense family's names matched nothing (vlft.testing.check_family's targets check found it)
    targets=replace(dense.TARGETS, text_mlp=()),
    chat=dense.CHAT,
    kernels=Kernels(vision_stem=QWEN_VISION_STEM),
    name=NAME,
    model_types=("qwen3_vl_moe",),
    description="Qwen3-VL MoE (30B-A3B/235B-A22B): attention adapters; fused experts via target_parameters",
    load_kwargs=fused_experts_load_kwargs,
    marked_inputs=dense.DEEPSTACK,
    tiny=Tiny(build_tiny, RECIPE),
)
