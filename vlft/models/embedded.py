"""The embedded models: a model family's tiny random model, built offline on first use and cached.

``--model embedded:<family>`` is that family's tiny model; the embedded default (``vlft run`` with no
``--model``, or ``--model embedded``) is the tiny model of the family a plugin names as the default
(``vlft_default_model_family``). The recipe (sizes, initialisation, tokenizer, chat template) belongs to
the family plugin; the core adds only the tokenizer corpus, the demo task's text, so that the answers are
short in tokens. Each folder is written once, then loaded with ``from_pretrained``, the same path a real
checkpoint takes.

Importing this module loads no torch and no transformers: the family's builder imports them when it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from vlft.data import demo as demo_data
from vlft.errors import ConfigError


def cache_root() -> Path:
    return Path(os.environ.get("VLFT_CACHE", Path.home() / ".cache" / "vlft"))


def tokenizer_corpus() -> list[str]:
    """The text a tiny model's tokenizer is trained on: the demo task's prompts and answers, and a little
    general English so that other prompts are not byte soup. (A builder repeats it four times.)"""
    lines = ["You are a helpful assistant.", "system", "user", "assistant"]
    lines += list(demo_data.QUESTIONS)
    for colour in demo_data.COLOURS:
        for defect in demo_data.DEFECTS:
            lines.append(demo_data.answer_for(colour, defect))
    lines.append(
        "the a an is are what which where how many colour color defect product image picture "
        "answer question describe damage object shape size left right top bottom yes no"
    )
    return lines


def default_family(registry):
    """The family whose tiny model is the embedded default: the one a plugin names (first answer wins)."""
    from vlft.models.families import (
        family_named,  # the family lookup, only when the default is asked for
    )

    name = registry.hook.vlft_default_model_family()
    if name is None:
        raise ConfigError(
            "no installed plugin names a default model family (vlft_default_model_family), so "
            "there is no embedded default model: pass --model DIR or --model embedded:<family> "
            "(see `vlft plugins`)"
        )
    return family_named(registry, name)


def embedded_model_dir(registry) -> Path:
    """The embedded default's folder: the default family's tiny model, written on first use."""
    return embedded_family_dir(default_family(registry))


def embedded_family_dir(family) -> Path:
    """``--model embedded:<family>``: the family's tiny random model, built offline on first use with the demo
    task's tokenizer corpus and cached under a name hashed from the family's recipe and the corpus (a change
    rebuilds it)."""
    if family.tiny is None:
        raise ConfigError(f"--model embedded:{family.name}: the {family.name} family offers no tiny embedded model")
    corpus = tokenizer_corpus()
    digest = hashlib.sha256(json.dumps([family.tiny.recipe, corpus], sort_keys=True, default=str).encode())
    path = cache_root() / f"embedded-{family.name}-{digest.hexdigest()[:12]}"
    if not (path / "config.json").exists():
        family.tiny.build(path, corpus=corpus)
    return path
