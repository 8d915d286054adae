"""Llama 4 (Scout 17B-16E, Maverick 17B-128E) built in, as facts declared on the generic family (generic.py; the
shape of declared.py): ``model_type`` "llama4".

transformers 5.2x Llama4ForConditionalGeneration keeps its towers at the top, not under ``model``:
``vision_model`` (Llama4VisionModel: an unfold patch embedding, ``model.layers[i]`` with self_attn.{q,k,v,o}_proj
and mlp.fc1/fc2, 2-D rotary positions, a CLS token dropped at the end, then ``vision_adapter``: a 0.5 pixel
shuffle and a 2-layer MLP), ``multi_modal_projector`` (one linear), ``language_model`` (Llama4ForCausalLM: its own
``model.layers`` and ``lm_head``). Each decoder layer's ``feed_forward`` is a dense MLP (gate/up/down_proj) or, in
``moe_layers`` (every layer in Scout, every other in Maverick), a Llama4TextMoe: ``router`` (an nn.Linear
subclass, top-k then a sigmoid; never a target), ``experts`` (Llama4TextExperts: 3-D parameters ``gate_up_proj``
[E, H, 2*I] and ``down_proj`` [E, I, H], run with ``bmm`` on every expert), and a ``shared_expert`` MLP. Adapters go
on attention and the dense and shared MLPs by default; the experts through PEFT's ``target_parameters`` when the
method asks (``--adapter-opt target_experts=true``), as the Qwen MoE families do.

Llama4ImageProcessor resizes an image to the best fit of up to ``max_patches`` tiles of ``size`` (padding, not
distorting), cuts it into tiles and adds a global tile when there is more than one; each tile costs (S/p)^2 / 4
``<|patch|>`` tokens (after the pixel shuffle), written by the processor between ``<|image_start|>`` and
``<|image_end|>`` with tile separators. ``pixel_values`` [tiles, 3, S, S] come in bfloat16 (the original
implementation's normalisation): ``vlft.processor_image_inputs`` keeps them in fp32.

Packing is refused (``LLAMA4_PACKING_REFUSAL``): the text model reads the row, not the sample.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor is built
or loaded, or a run builds its dummy image.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vlft import Chat, Experts, ModelFamily, Packing, Targets, Tiny, Towers, processor_image_inputs

from . import _tiny, generic
from .declared import TINY_INIT, TINY_TEXT, internvl_max_patches
from .family import TEXT_ATTENTION

NAME = "llama4"
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eot|>",
    "<|eom|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
]
RECIPE: dict[str, Any] = {
    "version": 1,
    "family": NAME,
    "seed": 1234,
    "vocab_size": 512,
    # 32 px tiles of 8 px patches (4 x 4), pixel-shuffled by 0.5 into 4 tokens a tile; up to 4 tiles + the global one
    "tile": 32,
    "max_patches": 4,
    "pixel_shuffle_ratio": 0.5,
    # layer 0 dense, layer 1 MoE (Maverick's interleaving) and without RoPE (Scout's every 4th layer)
    "text": dict(
        TINY_TEXT,
        head_dim=16,
        intermediate_size=32,
        intermediate_size_mlp=128,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 0],
    ),
    # the pixel shuffle makes 4 x hidden channels: the MLP's and the projector's widths follow from it
    "vision": dict(
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=8,
        projector_input_dim=64,
        projector_output_dim=64,
        vision_output_dim=64,
    ),
    **TINY_INIT,
}
SIZE_CAP = (
    "the tiling's max_patches lowered to the number of whole tiles (the vision tower's square input) that fit "
    "--max-pixels, never below one (the image is then one tile) nor above the processor's own; the global tile the "
    "tiling adds when it cuts more than one comes on top"
)
PACKING_REFUSAL = (
    "Llama 4's text model reads the row, not the sample: its NoPE layers scale the queries by the token's place in "
    "the row (attn_temperature_tuning, from floor_scale tokens on) and its RoPE layers attend in chunks of "
    "attention_chunk_size tokens, which packed rows attended sample by sample do not reproduce"
)


def llama4_grids(processor, sizes, max_pixels=None) -> list:
    """Each image's (tiles, s, s): its tiles (the global one included) by the image processor's own count, s x s
    the <|patch|> tokens of a tile after the pixel shuffle."""
    kwargs = internvl_max_patches(processor, max_pixels)
    image_processor = processor.image_processor
    per_side = int(image_processor.size["height"]) // int(processor.patch_size)
    side = math.isqrt(per_side * per_side // int(processor.downsample_ratio))
    return [(int(image_processor.get_number_of_image_patches(h, w, kwargs)), side, side) for w, h in sizes]


def llama4_trace(tower, grids, dtype, run_block):
    """The vision encoder's layers on the meta device for the memory plan: every tile a sequence of its patches
    and the CLS token, with the tower's 2-D rotary frequencies. The pixel shuffle MLP and the projector are not
    traced."""
    import torch

    tiles = sum(int(t) for t, _, _ in grids)
    config = tower.config
    seq = (int(config.image_size) // int(config.patch_size)) ** 2 + 1
    hidden = torch.empty(tiles, seq, config.hidden_size, device="meta", dtype=dtype)
    freqs = tower.rotary_embedding(hidden)
    for layer in tower.model.layers:
        hidden = run_block(layer, lambda m=layer, h=hidden: m(h, freqs_ci=freqs), hidden)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return hidden


def llama4_dummy(model, modality: str):
    """One blank tile of the tower's size through the generic warm-up (``get_image_features``)."""
    import torch

    vision = model.config.vision_config
    side = int(vision.image_size)
    pixels = torch.zeros(1, int(vision.num_channels), side, side)
    return generic.vision_dummy(model, modality, warmup={"pixel_values": pixels})


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    """A tiny random Llama 4 (a dense and a MoE decoder layer, the pixel-shuffle vision tower) with its processor
    and Llama 4's own chat template (the processor's default, no {% generation %} markers)."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4ImageProcessor, Llama4Processor
    from transformers.models.llama4.processing_llama4 import chat_template

    r = recipe or RECIPE
    tokenizer = _tiny.build_tokenizer(
        r["vocab_size"], SPECIALS, (), corpus, eos="<|eot|>", pad="<|finetune_right_pad|>"
    )
    tokenizer.bos_token = "<|begin_of_text|>"
    ids = _tiny.token_ids(tokenizer)
    config = Llama4Config(
        text_config=dict(
            r["text"],
            vocab_size=len(tokenizer),
            bos_token_id=ids("<|begin_of_text|>"),
            eos_token_id=ids("<|eot|>"),
            pad_token_id=ids("<|finetune_right_pad|>"),
            initializer_range=r["initializer_range"],
        ),
        vision_config=dict(
            r["vision"],
            image_size=r["tile"],
            pixel_shuffle_ratio=r["pixel_shuffle_ratio"],
            initializer_range=r["initializer_range"],
        ),
        boi_token_index=ids("<|image_start|>"),
        eoi_token_index=ids("<|image_end|>"),
        image_token_index=ids("<|patch|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(r["seed"])
    model = Llama4ForConditionalGeneration(config)
    _initialise(model, r)
    _tiny.finish_generation_config(model, tokenizer)
    processor = Llama4Processor(
        image_processor=Llama4ImageProcessor(
            size={"height": r["tile"], "width": r["tile"]}, max_patches=r["max_patches"]
        ),
        tokenizer=tokenizer,
        patch_size=r["vision"]["patch_size"],
        pixel_shuffle_ratio=r["pixel_shuffle_ratio"],
        chat_template=chat_template,
    )
    _tiny.save_atomically(Path(path), model, processor, r)


def _initialise(model, r: dict) -> None:
    """_tiny.initialise's measured init, for towers at the top of the model (no ``model.model``)."""
    import torch

    torch.manual_seed(r["seed"])
    with torch.no_grad():
        for module in model.vision_model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, r["vision_initializer_range"])
        emb = model.get_input_embeddings().weight
        emb.normal_()
        emb.mul_(r["embedding_row_norm"] / emb.norm(dim=-1, keepdim=True))


FAMILY = ModelFamily(
    name=NAME,
    model_types=("llama4",),
    description="Llama 4 (Scout 17B-16E, Maverick 17B-128E): pixel-shuffle vision tower on tiles + a global tile, "
    "MoE text model: attention and shared-expert adapters; experts via target_parameters",
    towers=Towers(
        vision="vision_model",
        vision_blocks="vision_model.model.layers",
        vision_mergers=("multi_modal_projector",),
        decoder_layers="language_model.model.layers",
        lm_head="language_model.lm_head",
    ),
    targets=Targets(
        vision_attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
        vision_mlp=("mlp.fc1", "mlp.fc2"),
        text_attention=TEXT_ATTENTION,
        # the dense layers' MLP and the MoE layers' shared expert (the routed experts: experts.parameters)
        text_mlp=tuple(
            f"feed_forward.{part}{proj}"
            for part in ("", "shared_expert.")
            for proj in ("gate_proj", "up_proj", "down_proj")
        ),
        default="both",
    ),
    chat=Chat(
        processor_class="Llama4Processor",
        load_processor=generic.load_processor,
        reply_end_token="<|eot|>",
    ),
    image_inputs=processor_image_inputs(
        {"pixel_values": "concat"},
        size_cap=SIZE_CAP,
        processor_kwargs=internvl_max_patches,
        image_grids=llama4_grids,
        trace=llama4_trace,
    ),
    packing=Packing(refusal=PACKING_REFUSAL),
    experts=Experts(
        parameters=("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
        routers=("feed_forward.router",),
    ),
    # sharding: None, the model class's own units (Llama4TextDecoderLayer, Llama4VisionEncoderLayer)
    vision_dummy=llama4_dummy,
    tiny=Tiny(build_tiny, RECIPE),
)
