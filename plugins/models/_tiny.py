"""Shared machinery for the tiny embedded models: tokenizer, initialisation, atomic save, cache.

The approach is the Qwen2.5-VL embedded default's (qwen2_vl.py), generalised per family:

- a real byte-level BPE tokenizer trained offline on a small corpus, with the family's special tokens;
- the family's real chat template (the official one, stored in ``templates/``);
- the family's real processor classes, configured with the family's patch/merge sizes;
- a real ``*ForConditionalGeneration`` built from the family's config class with seeded weights,
  initialised as the embedded default was measured to learn fast (unit-norm embedding rows, text std 0.1,
  vision std 0.02);
- written to a temporary folder with ``save_pretrained`` and renamed into place, so a half-written
  cache never exists; loaded back with ``AutoProcessor`` / ``AutoModelForImageTextToText``.

Imports inside functions: torch, tokenizers and transformers load only when a tiny model or a processor
is built or loaded; the plugin registers, and plans offline, without them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

TEMPLATES = Path(__file__).parent / "templates"

BASE_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen3 / Qwen3-VL / Qwen3.5 tokenizers also carry these as added (non-special) tokens.
QWEN3_EXTRA_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

DEFAULT_CORPUS = [
    "You are a helpful assistant.",
    "system",
    "user",
    "assistant",
    "What colour is the product?",
    "What defect does the product have?",
    "Describe the product.",
    "The product is red and has a scratch.",
    "The product is blue and has no defect.",
    "The product is green and has a dent.",
    "The product is yellow and has a crack.",
    "the a an is are what which where how many colour color defect product image picture video frame "
    "answer question describe damage object shape size left right top bottom yes no seconds",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 . , : ; ( ) [ ] { } < > ' \" ? !",
]


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("VLFT_CACHE", Path.home() / ".cache" / "vlft"))


def token_ids(tokenizer) -> Callable[[str], int]:
    """The tokenizer's id of one token (convert_tokens_to_ids returns a list only when given one)."""
    return lambda token: cast(int, tokenizer.convert_tokens_to_ids(token))


def build_tokenizer(
    vocab_size: int,
    special_tokens: list[str],
    extra_tokens: Sequence[str] = (),
    corpus: list[str] | None = None,
    eos: str = "<|im_end|>",
    pad: str = "<|endoftext|>",
    max_length: int = 4096,
):
    """A byte-level BPE tokenizer trained on ``corpus``; special and extra tokens are single tokens."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus or DEFAULT_CORPUS) * 4, trainer)
    if extra_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, model_max_length=max_length)


def initialise(
    model, seed: int, vision_std: float, embedding_row_norm: float, vision_attr: str = "visual", reseed: bool = True
) -> None:
    """The embedded default's measured init (qwen2_vl.py says why): vision Linear/Conv weights std
    ``vision_std``; unit-norm embedding rows (the rest keeps the config's initializer_range, set by the
    caller). ``reseed``: seed the generator again first (else it runs on from the model's construction)."""
    import torch

    if reseed:
        torch.manual_seed(seed)
    with torch.no_grad():
        visual = getattr(model.model, vision_attr)
        for module in visual.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)):
                module.weight.normal_(0.0, vision_std)
        emb = model.get_input_embeddings().weight
        emb.normal_()
        emb.mul_(embedding_row_norm / emb.norm(dim=-1, keepdim=True))


def qwen3_config_kwargs(recipe: dict, tokenizer, **text_extra) -> dict:
    """The keyword arguments a Qwen3-generation config class (Qwen3-VL, its MoE, Qwen3.5) takes for a tiny
    model: the recipe's towers with the tokenizer's special-token ids, tied embeddings."""
    ids = token_ids(tokenizer)
    return dict(
        text_config=dict(
            recipe["text"],
            vocab_size=len(tokenizer),
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            initializer_range=recipe["initializer_range"],
            **text_extra,
        ),
        vision_config=dict(recipe["vision"], initializer_range=recipe["initializer_range"]),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def finish_generation_config(model, tokenizer) -> None:
    ids = token_ids(tokenizer)
    model.generation_config.eos_token_id = ids(tokenizer.eos_token)
    model.generation_config.pad_token_id = ids(tokenizer.pad_token)
    model.generation_config.do_sample = False


def save_atomically(path: Path, model, processor, recipe: dict) -> None:
    """save_pretrained into a temp folder beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "vlft_recipe.json").write_text(json.dumps(recipe, indent=2, default=str))
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished first; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cached_dir(family_name: str, recipe: dict, build) -> Path:
    """The family's tiny model folder in the vlft cache, built on first use."""
    path = cache_root() / f"embedded-{family_name}-{recipe_hash(recipe)}"
    if not (path / "config.json").exists():
        build(path)
    return path
