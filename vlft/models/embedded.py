"""The embedded default model: a small Qwen2.5-VL that needs no download.

It is a real ``Qwen2_5_VLForConditionalGeneration`` with a real byte-level
BPE tokenizer, Qwen2.5-VL's chat template and ``Qwen2VLImageProcessor``,
written once to a cache folder and then loaded with ``from_pretrained``, the
same path a real checkpoint takes.

Initialisation (each choice measured on the embedded product-inspection task
with LoRA r=32 at lr 2e-4):

- with the usual std-0.02 weights everywhere the logits stay so small that the
  loss barely moves (it stalled at 1.6 after 300 steps, exact match 0%);
- token embeddings (tied to the output head) get unit-norm rows, so logits
  span about +-sqrt(hidden) once a hidden state aligns with a token;
- text layers use std 0.1, so an adapter's update moves the residual stream
  visibly (0.02: stalled; 0.2: noisier and worse);
- the vision tower and merger keep std 0.02, which leaves them close to the
  identity and lets the pixels' colour and shape reach the text model (0.1
  there cost about 10 points of defect accuracy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from vlft.data import demo as demo_data

EMBEDDED_NAME = "embedded"


SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]


# Qwen2.5-VL's own chat template (as shipped with Qwen/Qwen2.5-VL-*-Instruct).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The embedded recipe; its hash names the cache folder, so a change rebuilds it.
RECIPE = {
    "version": 4,
    "seed": 1234,
    "vocab_size": 512,
    "text": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}),
    "vision": dict(depth=8, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                   fullatt_block_indexes=[3, 7]),
    # 112x112 images: 8x8 patches of 14 px, merged 2x2 into 16 tokens.
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "embedding_row_norm": 1.0,
    "initializer_range": 0.1,
    "vision_initializer_range": 0.02,
}


def recipe_hash(recipe: dict = RECIPE) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("VLFT_CACHE", Path.home() / ".cache" / "vlft"))


def embedded_model_dir() -> Path:
    """The embedded model's folder, written on first use."""
    path = cache_root() / f"embedded-qwen2_5_vl-{recipe_hash()}"
    if not (path / "config.json").exists():
        build_embedded_model(path)
    return path


def _tokenizer_corpus() -> list[str]:

    lines = ["You are a helpful assistant.", "system", "user", "assistant"]
    lines += list(demo_data.QUESTIONS)
    for colour in demo_data.COLOURS:
        for defect in demo_data.DEFECTS:
            lines.append(demo_data.answer_for(colour, defect))
    # a little general English, so other prompts are not byte soup
    lines.append("the a an is are what which where how many colour color defect product image picture "
                 "answer question describe damage object shape size left right top bottom yes no")
    return lines * 4


def build_tokenizer(vocab_size: int):

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=RECIPE["text"]["max_position_embeddings"],
    )


def build_embedded_model(path: Path, recipe: dict = RECIPE) -> None:
    """Build, initialise and save the embedded model and processor at ``path``."""

    tokenizer = build_tokenizer(recipe["vocab_size"])
    ids = tokenizer.convert_tokens_to_ids
    image_processor = Qwen2VLImageProcessor(
        min_pixels=recipe["min_pixels"], max_pixels=recipe["max_pixels"],
        patch_size=recipe["vision"]["patch_size"], merge_size=recipe["vision"]["spatial_merge_size"],
        temporal_patch_size=recipe["vision"]["temporal_patch_size"],
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=recipe["min_pixels"], max_pixels=recipe["max_pixels"],
        patch_size=recipe["vision"]["patch_size"], merge_size=recipe["vision"]["spatial_merge_size"],
        temporal_patch_size=recipe["vision"]["temporal_patch_size"],
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    config = Qwen2_5_VLConfig(
        text_config=dict(
            recipe["text"], vocab_size=len(tokenizer), bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(recipe["vision"]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    config.text_config.initializer_range = recipe["initializer_range"]
    config.vision_config.initializer_range = recipe["initializer_range"]
    config.initializer_range = recipe["initializer_range"]
    torch.manual_seed(recipe["seed"])
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for module in model.model.visual.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)):
                module.weight.normal_(0.0, recipe["vision_initializer_range"])
        emb = model.get_input_embeddings().weight
        emb.normal_()
        emb.mul_(recipe["embedding_row_norm"] / emb.norm(dim=-1, keepdim=True))
    model.generation_config.eos_token_id = ids("<|im_end|>")
    model.generation_config.pad_token_id = ids("<|endoftext|>")
    model.generation_config.do_sample = False

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "vlft_recipe.json").write_text(json.dumps(recipe, indent=2))
        try:
            os.replace(tmp, path)
        except OSError:
            # another process finished first; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def embedded_family_dir(family) -> Path:
    """``--model embedded:<family>``: the family's tiny random model, built offline on first use with the demo
    task's tokenizer corpus (short answers in tokens) and cached like the default, under a name hashed from
    the family's recipe and the corpus (a change rebuilds it). The default above stays as it is."""
    from vlft.errors import (
        ConfigError,  # only this helper raises; the module stays import-light
    )

    if family.build_tiny is None:
        raise ConfigError(f"--model embedded:{family.name}: the {family.name} family offers no tiny embedded model")
    corpus = _tokenizer_corpus()[: len(_tokenizer_corpus()) // 4]
    digest = hashlib.sha256(json.dumps([family.tiny_recipe, corpus], sort_keys=True, default=str).encode())
    path = cache_root() / f"embedded-{family.name}-{digest.hexdigest()[:12]}"
    if not (path / "config.json").exists():
        family.build_tiny(path, corpus=corpus)
    return path
