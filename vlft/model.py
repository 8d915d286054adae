"""Loading the base model and processor, the same way for the embedded default and a real checkpoint."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


def resolve_model_path(model: str | None) -> str:
    """The embedded default when ``model`` is None; otherwise a local directory (or a hub id, if reachable)."""
    if model is None:
        from .embedded import embedded_model_dir

        return str(embedded_model_dir())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model}: no config.json there; point --model at a Qwen2.5-VL model directory")
        return str(path.resolve())
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ConfigError(f"--model {model}: directory not found")
    return model  # a hub id: transformers resolves it (its cache, or the network where there is one)


def load_model_config(path: str):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - report any loading failure plainly
        raise ConfigError(f"cannot read the model config at {path}: {e}") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{path} is a '{config.model_type}' model; vlft supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def load_processor(path: str):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot load the processor (tokenizer, image processor) from {path}: {e}") from None


def load_model(path: str, attention, precision, device=None):
    """The base model with the backend's attention per tower and parameter dtype, on ``device``."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=getattr(torch, precision.param_dtype),
        attn_implementation=attention.as_attn_implementation(),
    )
    if device is not None:
        model.to(device)
    return model


def tower_attention(model) -> dict[str, str]:
    """The attention implementation each tower actually uses, read back from the loaded model."""
    cfg = model.config
    return {
        "vision": getattr(cfg.vision_config, "_attn_implementation", None),
        "text": getattr(cfg.text_config, "_attn_implementation", None),
    }
