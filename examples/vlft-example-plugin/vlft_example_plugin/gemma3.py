"""A model family from outside vlft's core (issue 20 item 5): Gemma 3, registered through this package's entry
point ``gemma3 = "vlft_example_plugin.gemma3"`` in group "vlft". It imports only vlft's public face
(``vlft.ModelFamily``, ``vlft.hookimpl``), never the core nor the built-in families; its tiny embedded model
(``--model embedded:gemma3``) is built here, offline, from transformers' config classes.

Why Gemma 3: the installed transformers builds a tiny ``Gemma3ForConditionalGeneration`` with
``Gemma3Processor`` (``Gemma3ImageProcessor`` + tokenizer + the official chat template) offline with no extra
package; an image costs a fixed ``mm_tokens_per_image`` tokens; pixel_values are [images, 3, H, W]. And it
differs from Qwen exactly where a family contract must be general: no mRoPE (plain 1-D positions: no
``positions`` capability); roles user/model and a reply that ends with ``<end_of_turn>`` while eos is ``<eos>``;
the placeholder the template writes (``<start_of_image>``) is not the token the model counts
(``<image_soft_token>``), and the processor itself writes each image's token sequence (its ``image_inputs``
are ``vlft.processor_image_inputs``); ``token_type_ids`` (1 on image tokens) must reach the model in
training, or image tokens silently attend causally instead of bidirectionally.

transformers 5.2x module tree: ``model.vision_tower`` (SigLIP: ``encoder.layers[i].self_attn.{q,k,v,out}_proj``,
``mlp.fc1/fc2``), ``model.multi_modal_projector`` (``mm_input_projection_weight`` is a bare Parameter, not
an nn.Linear; ``mm_soft_emb_norm``; an AvgPool2d), ``model.language_model.layers[i]`` (Gemma3DecoderLayer:
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``; sliding/global layers), ``lm_head``.

Imports inside functions: torch, tokenizers and transformers load only when the tiny model is built or a
run builds its dummy image; ``vlft plugins`` loads this module just to list it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from vlft import (
    Chat,
    ModelFamily,
    Packing,
    Sharding,
    Targets,
    Tiny,
    Towers,
    VisionWarmup,
    hookimpl,
    processor_image_inputs,
)

VLFT_PLUGIN_API = 3  # the plugin API this module is written for (docs/plugin-api-changes.md)

NAME = "gemma3"
TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

RECIPE = {
    "version": 2,
    "family": NAME,
    "seed": 1234,
    "vocab_size": 512,  # 2: the projector initialised (not zeros)
    # 32 px images, patch 8 -> 4x4 patches, pooled to mm_tokens_per_image = 4 (2x2)
    "image_size": 32,
    "mm_tokens_per_image": 4,
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=64,
        max_position_embeddings=4096,
    ),
    "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8),
    "initializer_range": 0.1,
}


DEFAULT_CORPUS = [
    "user",
    "model",
    "What colour is the product?",
    "What defect does the product have?",
    "The product is red and has a scratch.",
    "The product is blue and has no defect.",
    "the a an is are what which where how many colour defect product image answer question yes no",
]


def _tokenizer(r, corpus=None):
    """A byte-level BPE tokenizer trained offline on ``corpus``, with Gemma 3's special tokens as single tokens."""
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
    tok.train_from_iterator(list(corpus or DEFAULT_CORPUS) * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=r["text"]["max_position_embeddings"],
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )


def build_tiny(path: Path, recipe: dict | None = None, corpus=None) -> None:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    r = recipe or RECIPE
    tok = _tokenizer(r, corpus)
    ids = tok.convert_tokens_to_ids
    ip = Gemma3ImageProcessor(size={"height": r["image_size"], "width": r["image_size"]})
    processor = Gemma3Processor(
        image_processor=ip, tokenizer=tok, image_seq_length=r["mm_tokens_per_image"], chat_template=TEMPLATE
    )
    config = Gemma3Config(
        text_config=dict(
            r["text"],
            vocab_size=len(tok),
            initializer_range=r["initializer_range"],
            bos_token_id=ids("<bos>"),
            eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
            pad_token_id=ids("<pad>"),
        ),
        vision_config=dict(r["vision"], image_size=r["image_size"]),
        mm_tokens_per_image=r["mm_tokens_per_image"],
        image_token_id=ids("<image_soft_token>"),
        boi_token_id=ids("<start_of_image>"),
        eoi_token_id=ids("<end_of_image>"),
    )
    torch.manual_seed(r["seed"])
    model = Gemma3ForConditionalGeneration(config)
    # transformers initialises the projector's input projection to zeros (a real checkpoint overwrites it);
    # left so, the tiny model's image features are all zero and nothing trains the vision tower
    projector = model.model.multi_modal_projector
    with torch.no_grad():
        projector.mm_input_projection_weight.normal_(0.0, r["initializer_range"])
    model.generation_config.eos_token_id = ids("<end_of_turn>")  # a reply ends there, not at <eos>
    model.generation_config.pad_token_id = ids("<pad>")
    model.generation_config.do_sample = False
    _save_atomically(Path(path), model, processor, r)


def _save_atomically(path: Path, model, processor, recipe: dict) -> None:
    """save_pretrained into a temporary folder beside ``path``, then rename it into place (vlft's cache rule:
    a half-written model folder never exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "vlft_recipe.json").write_text(json.dumps(recipe, indent=2))
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished first; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def vision_dummy(model, modality: str):
    """The smallest input SigLIP takes: one blank image at its fixed size, run through ``get_image_features``
    on a process whose micro-batch has no image (vlft.models.vision), so DDP and FSDP see every process use
    the tower at every step. Gemma 3 has no video tower."""
    import torch

    if modality != "image":
        return None
    inner = next(
        (
            m
            for m in model.modules()
            if hasattr(m, "get_image_features") and hasattr(m, "vision_tower") and hasattr(m, "get_input_embeddings")
        ),
        None,
    )
    if inner is None:
        return None
    vc = inner.vision_tower.config
    pixels = torch.zeros(1, int(vc.num_channels), int(vc.image_size), int(vc.image_size))
    return VisionWarmup(inner, "get_image_features", {"pixel_values": pixels})


def image_grids(processor, sizes, max_pixels):
    """Each image's grid for the memory plan: Gemma3Processor resizes every image to its one square size and
    pools it to ``image_seq_length`` tokens, so every image is (1, s, s) with s x s = that count (pooled patches,
    one per token: the processor does not know the tower's patch size; ``trace_vision`` reads it from the
    tower)."""
    import math

    side = math.isqrt(int(processor.image_seq_length))
    return [(1, side, side) for _ in sizes]


def trace_vision(tower, grids, dtype, run_block):
    """SigLIP's encoder layers on the meta device, for the memory plan: one sequence of (image_size /
    patch_size)^2 patches per image (the tower's own numbers), then the post-layernorm. The projector (an
    average pool and one projection) lives outside the tower and is not traced."""
    import torch

    vc = tower.config
    patches = (int(vc.image_size) // int(vc.patch_size)) ** 2
    hidden = torch.empty(len(grids), patches, int(vc.hidden_size), device="meta", dtype=dtype)
    for layer in tower.encoder.layers:
        hidden = run_block(layer, lambda m=layer, h=hidden: m(h, attention_mask=None), hidden)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return run_block(tower.post_layernorm, lambda h=hidden: tower.post_layernorm(h))


def token_type_ids(input_ids, image_token_id: int):
    """What Gemma3Processor returns and the model needs in training: 1 on image tokens, else 0."""
    return (input_ids == image_token_id).long()


FAMILY = ModelFamily(
    name=NAME,
    model_types=("gemma3",),
    description="Gemma 3 (4B/12B/27B): SigLIP + Gemma 3, fixed 256 tokens per image (third-party example)",
    towers=Towers(
        vision="model.vision_tower",
        vision_blocks="model.vision_tower.encoder.layers",
        vision_mergers=("model.multi_modal_projector",),
        decoder_layers="model.language_model.layers",
        lm_head="lm_head",
    ),
    targets=Targets(
        vision_attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"),
        vision_mlp=("mlp.fc1", "mlp.fc2"),
        text_attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
        text_mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        default="both",
    ),
    # load_processor None: AutoProcessor
    chat=Chat(processor_class="Gemma3Processor", reply_end_token="<end_of_turn>", box_coordinates="absolute"),
    # Gemma3Processor writes <start_of_image><image_soft_token>*N<end_of_image> itself, and returns
    # token_type_ids (1 on image tokens: they attend both ways) beside the pixels. Without pan-and-scan every
    # image is resized to the processor's square size: no size cap for --max-pixels to set. The plan counts each
    # image's pooled patches and traces the SigLIP layers (image_grids, trace_vision).
    image_inputs=processor_image_inputs(
        {"pixel_values": "concat", "token_type_ids": "sequence"}, image_grids=image_grids, trace=trace_vision
    ),
    # no video_inputs: Gemma 3 has no video tower; no positions: plain 1-D positions
    packing=Packing(
        refusal="its token_type_ids make image tokens attend both ways, and vlft has not checked "
        "that Gemma 3 keeps that bidirectional attention inside each packed sample"
    ),
    sharding=Sharding(("Gemma3DecoderLayer", "SiglipEncoderLayer")),
    vision_dummy=vision_dummy,
    tiny=Tiny(build_tiny, RECIPE),
)


@hookimpl
def vlft_model_families():
    """`vlft plugins` lists it; `--model embedded:gemma3` finds its tiny model here."""
    return [FAMILY]
