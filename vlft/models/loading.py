"""Loading the base model and processor, the same way for the embedded default and a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    GenerationConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from vlft.errors import ConfigError
from vlft.models.bundled import bundled_config, bundled_names, is_bundled
from vlft.models.embedded import CHAT_TEMPLATE, embedded_model_dir

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def resolve_model_path(model: str | None) -> str:
    """The embedded default when ``model`` is None; a local directory; a bundled config name
    (``qwen2.5-vl-7b``: weightless, for planning); or a hub id, if reachable."""
    if model is None:

        return str(embedded_model_dir())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model}: no config.json there; point --model at a Qwen2.5-VL model directory")
        return str(path.resolve())
    if (bundled := bundled_config(model)) is not None and not path.exists():
        return str(bundled)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ConfigError(f"--model {model}: directory not found (bundled configs for planning: "
                          f"{', '.join(bundled_names())})")
    return model  # a hub id: transformers resolves it (its cache, or the network where there is one)


def load_model_config(path: str):

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
    """The model's processor; for a bundled config, its image processor with the embedded tokenizer as a
    stand-in (the real tokenizer is not bundled, so text lengths are approximate; image tokens are exact)."""

    if is_bundled(path):


        tokenizer = AutoProcessor.from_pretrained(embedded_model_dir()).tokenizer
        return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(path), tokenizer=tokenizer,
                                   video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)

    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot load the processor (tokenizer, image processor) from {path}: {e}") from None


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weight_format(path: str, trust_pickle: bool) -> None:
    """Refuse a model folder whose only weights are pickled: unpickling a file can run code from it."""
    folder = Path(path)
    if trust_pickle or not folder.is_dir():
        return
    files = [f for f in folder.iterdir() if f.is_file()]
    if any(f.suffix == ".safetensors" for f in files):
        return
    pickled = sorted(f.name for f in files if f.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ConfigError(
            f"{path} holds pickled weights ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}) and no "
            f".safetensors; loading a pickle can run code stored in it. Convert the weights to safetensors "
            f"(model.save_pretrained(dir) in a trusted session), or pass --trust-pickle if you trust the file.")


def load_model(path: str, attention, precision, device=None, trust_pickle: bool = False):
    """The base model with the backend's attention per tower and parameter dtype, on ``device``.

    Without ``trust_pickle`` only safetensors are read (transformers' ``use_safetensors=True``); with it,
    transformers still unpickles with ``weights_only=True`` (its default), which allows tensors only.
    """

    check_weight_format(path, trust_pickle)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=getattr(torch, precision.param_dtype),
        attn_implementation=attention.as_attn_implementation(),
        use_safetensors=None if trust_pickle else True,
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


def empty_model(path: str, attention, precision):
    """The base model as ``load_model`` builds it, on the 'meta' device: its structure without reading a
    weight. Under ``--shard fsdp`` every process but rank 0 starts from this and receives its share of the
    weights from rank 0 (``sharding.receive_from_rank0``)."""

    config = load_model_config(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            config, dtype=getattr(torch, precision.param_dtype), attn_implementation=attention.as_attn_implementation())
    try:  # from_pretrained reads it too: generation (EOS ids) must stop where rank 0's does
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return model.eval()
