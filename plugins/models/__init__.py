"""vlft_models: the built-in model-family plugins (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense and MoE, Qwen3.5
dense and MoE, SmolVLM / SmolVLM2 and Idefics3, LLaVA-OneVision, GLM-4.1V and GLM-4.6V, Gemma 4, PaliGemma; InternVL,
LLaVA-NeXT(-Video), Mistral 3, Llama 4 and MiniCPM-V 4.6 declared on the generic family), and the generic family read from any other image-text-to-text checkpoint (generic.py), registered as entry point ``models = "vlft_models"`` in group "vlft" (package-dir
``vlft_models = "plugins/models"``). NOTES.md has the facts and traps per family.

Importing this package imports neither torch nor transformers.

Imports inside functions: the family modules, each building its dataclasses at import, load when a family
is first asked for, not when the plugin registers (every `vlft` command registers it).
"""

from __future__ import annotations

from pathlib import Path

from vlft import ModelFamily, hookimpl

CONFIGS = Path(__file__).parent / "configs"
DEFAULT_FAMILY = "qwen2.5-vl"


def _families() -> tuple[ModelFamily, ...]:
    from . import (
        declared,
        gemma4,
        glm4v,
        llama4,
        llava_onevision,
        minicpmv,
        paligemma,
        qwen2_vl,
        qwen3_5,
        qwen3_vl,
        qwen3_vl_moe,
        smolvlm,
    )

    return (
        *qwen2_vl.FAMILIES,
        qwen3_vl.FAMILY,
        qwen3_vl_moe.FAMILY,
        *qwen3_5.FAMILIES,
        *smolvlm.FAMILIES,
        llava_onevision.FAMILY,
        *glm4v.FAMILIES,
        gemma4.FAMILY,
        *declared.FAMILIES,
        llama4.FAMILY,
        minicpmv.FAMILY,
        paligemma.FAMILY,
    )


def families() -> tuple[ModelFamily, ...]:
    return _families()


def family_for(model_type: str) -> ModelFamily | None:
    return next((f for f in _families() if f.owns(model_type)), None)


def family_named(name: str) -> ModelFamily | None:
    return next((f for f in _families() if f.name == name), None)


def bundled_config_dir(name: str) -> Path | None:
    """configs/<name>/ for a bundled planning config such as 'qwen3-vl-8b'."""
    path = CONFIGS / name
    return path if (path / "config.json").is_file() else None


# --- hook implementations (specs: vlft/hookspecs.py) ---------------------------------------------------------


@hookimpl
def vlft_model_families():
    """All families this plugin offers (for `vlft plugins` and the unknown-model_type error)."""
    return list(_families())


@hookimpl
def vlft_family_readers():
    """The generic family, read from any checkpoint transformers maps to AutoModelForImageTextToText that no
    family here (or in another plugin) owns."""
    from .generic import READER

    return [READER]


@hookimpl
def vlft_default_model_family():
    """The embedded default (`vlft run` with no --model) is Qwen2.5-VL's tiny model, the one `make run`'s
    figures (exact match 0% -> 98%) were measured on."""
    return DEFAULT_FAMILY


@hookimpl
def vlft_bundled_model_configs():
    """{name: folder} of weightless planning configs this plugin ships."""
    return {p.name: p for p in sorted(CONFIGS.iterdir()) if (p / "config.json").is_file()} if CONFIGS.is_dir() else {}
