"""Loading the base model and processor, the same way for the embedded default and a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    GenerationConfig,
)
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from vlft.errors import ConfigError
from vlft.models.bundled import bundled_config, bundled_names, is_bundled
from vlft.models.embedded import embedded_family_dir, embedded_model_dir
from vlft.models.families import (
    EMBEDDED_PREFIX,
    family_load_kwargs,
    family_named,
    resolve_family,
)

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def resolve_model_path(model: str | None, registry) -> str:
    """The embedded default when ``model`` is None (or ``embedded``); a family's tiny embedded model for
    ``embedded:<family>``; a local directory; a bundled config name (``qwen3-vl-8b``: weightless, for
    planning); or a hub id, if reachable."""
    if model is None or model == EMBEDDED_PREFIX.rstrip(":"):
        return str(embedded_model_dir(registry))
    if model.startswith(EMBEDDED_PREFIX):
        return str(embedded_family_dir(family_named(registry, model[len(EMBEDDED_PREFIX) :])))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"--model {model}: no config.json there; point --model at a model directory "
                "(config.json, weights, processor files)"
            )
        return str(path.resolve())
    if (bundled := bundled_config(model, registry)) is not None and not path.exists():
        return str(bundled)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ConfigError(
            f"--model {model}: directory not found (bundled configs for planning: "
            f"{', '.join(bundled_names(registry))}; tiny offline models: embedded:<family>, see "
            "`vlft plugins`)"
        )
    return model  # a hub id: transformers resolves it (its cache, or the network where there is one)


def read_model_config(path: str):
    """The checkpoint's config, read with transformers (no family check)."""
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - report any loading failure plainly
        raise ConfigError(f"cannot read the model config at {path}: {e}") from None


def load_model_config(path: str, registry):
    """The checkpoint's config, refused unless an installed model family owns its ``model_type``."""
    config = read_model_config(path)
    resolve_family(registry, config, where=str(path), path=path)
    return config


def model_config_and_family(path: str, registry):
    """(config, ModelFamily) of a checkpoint: the family asked for once, here."""
    config = read_model_config(path)
    return config, resolve_family(registry, config, where=str(path), path=path)


def load_processor(path: str, family, registry):
    """The model's processor (``family``'s loader, else AutoProcessor); for a bundled config of ``registry``'s
    plugins, the family's processor from the folder's preprocessor configs with the embedded tokenizer as a
    stand-in (the real tokenizer is not bundled, so text lengths are approximate; image tokens are exact)."""
    if is_bundled(path, registry):
        if family.chat.bundled_processor is None:
            raise ConfigError(f"{path}: the {family.name} family cannot build a processor for a bundled config")
        # the embedded default's tokenizer, whatever the family: the family's own tiny tokenizer would be
        # closer (Qwen3's added tokens) but means building its tiny model on a dry run (issue 30)
        tokenizer = AutoProcessor.from_pretrained(embedded_model_dir(registry)).tokenizer
        return family.call("bundled_processor", family.chat.bundled_processor, path, tokenizer)

    try:
        return (family.chat.load_processor or AutoProcessor.from_pretrained)(path)
    except Exception as e:  # noqa: BLE001 - a processor's loader raises many classes; each becomes a ConfigError
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
            f"(model.save_pretrained(dir) in a trusted session), or pass --trust-pickle if you trust the file."
        )


def load_model(path: str, attention, precision, device=None, trust_pickle: bool = False, keep_float=(), *, family):
    """The base model with the backend's attention per tower and parameter dtype, on ``device``; the
    family's ``load_kwargs`` on top (MoE families: the experts implementation the dtype allows).

    Without ``trust_pickle`` only safetensors are read (transformers' ``use_safetensors=True``); with it,
    transformers still unpickles with ``weights_only=True`` (its default), which allows tensors only.
    ``precision.quantization`` "nf4": linear weights quantized to 4-bit NF4 while loading, on ``device``
    (bitsandbytes through transformers), except the modules in ``keep_float``.
    """

    check_weight_format(path, trust_pickle)
    extra = {}
    if precision.quantization == "nf4":
        extra = dict(
            quantization_config=four_bit_config(precision, keep_float),
            device_map={"": str(device) if device is not None else "cpu"},
        )
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            path,
            dtype=getattr(torch, precision.param_dtype),
            attn_implementation=attention.as_attn_implementation(),
            use_safetensors=None if trust_pickle else True,
            # no hub kernels: transformers 5.25 turns them on by default, fetches their code from the hub (none
            # here, nor on an offline cluster) and re-kernelizes at every train()/eval(); the backend's kernel
            # patches (--kernels) are the run's kernels, each in the plan
            use_kernels=False,
            **extra,
            **family_load_kwargs(family, precision.param_dtype),
        )
    except ImportError as e:
        if not extra:
            raise
        raise ConfigError(f"--param-dtype nf4 needs bitsandbytes: {e}; pip install 'vlft[qlora]'") from None
    if device is not None and not extra:
        model.to(device)
    return model


def dequantized(model):
    """A model loaded with 4-bit base weights, back to plain fp32 ``nn.Linear``s: each weight as the 4-bit
    model computed with it (bitsandbytes dequantizes to bf16, the load dtype), then widened, which is exact.
    The quantization config goes with it, so ``save_pretrained`` writes a plain model."""
    return model.dequantize(dtype=torch.float32).float()


def four_bit_config(precision, keep_float=()):
    """transformers' quantization config for NF4 base weights: bf16 compute, optional double quantization."""
    from transformers import (
        BitsAndBytesConfig,  # only for nf4 runs (its import looks for bitsandbytes)
    )

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=precision.double_quant,
        llm_int8_skip_modules=list(keep_float) or None,
    )


def tower_attention(model) -> dict[str, str | None]:
    """The attention implementation each tower actually uses, read back from the loaded model."""
    cfg = model.config
    return {
        "vision": getattr(cfg.vision_config, "_attn_implementation", None),
        "text": getattr(cfg.text_config, "_attn_implementation", None),
    }


def empty_model(path: str, attention, precision, *, family):
    """The base model as ``load_model`` builds it, on the 'meta' device: its structure without reading a
    weight. Under ``--shard fsdp`` every process but rank 0 starts from this and receives its share of the
    weights from rank 0 (``sharding.receive_from_rank0``)."""

    config = read_model_config(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            config,
            dtype=getattr(torch, precision.param_dtype),
            attn_implementation=attention.as_attn_implementation(),
            **family_load_kwargs(family, precision.param_dtype),
        )
    try:  # from_pretrained reads it too: generation (EOS ids) must stop where rank 0's does
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return model.eval()


class SharesUnreadable(Exception):
    """Why each process cannot read only its own shares of a checkpoint (rank 0 then reads it whole)."""


def checkpoint_names(path: str, model) -> dict[str, str]:
    """For per-process loading under ``--shard fsdp``: each tensor of the checkpoint at ``path`` under the name
    it has in ``model``'s state dict (the transformers model's: a PEFT wrapper's ``base_layer`` included), as
    ``{model name: checkpoint name}``.

    The checkpoint's names go through the renamings transformers applies when it loads (its conversion mapping:
    Qwen2.5-VL's ``model.layers.*`` becomes ``model.language_model.layers.*``). Raises ``SharesUnreadable``
    with the reason where a process cannot read its share on its own: no safetensors files, a tensor
    transformers converts while loading (fused experts: one model tensor from several), or a weight the
    checkpoint lacks (transformers would initialise it)."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise SharesUnreadable(f"{path} is not a folder of .safetensors files")
    stored: list[str] = []
    for file in files:  # the headers only
        with safe_open(str(file), framework="pt") as f:
            stored += list(f.keys())
    tf = model.get_base_model() if hasattr(model, "get_base_model") else model
    plain = {_without_adapter_layers(k): k for k in tf.state_dict()}
    present = dict.fromkeys(plain, True)
    mapping = get_model_conversion_mapping(tf)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    names: dict[str, str] = {}
    for key in stored:  # as transformers' convert_and_load_state_dict_in_model renames them
        renamed, converted = rename_source_key(key, renamings, converters, tf.base_model_prefix, present)
        if renamed not in plain and key in plain:
            renamed, converted = rename_source_key(key, [], [], tf.base_model_prefix, present)
        if converted is not None:
            raise SharesUnreadable(f"transformers converts {key} while loading ({converted}), not only renames it")
        if renamed in plain:  # others transformers ignores too (it warns of unexpected keys)
            names[plain[renamed]] = key
    tied = set(getattr(tf, "all_tied_weights_keys", None) or {})
    params = {n for n, p in tf.named_parameters(remove_duplicate=False) if not p.requires_grad}
    missing = sorted(params - set(names) - {plain[k] for k in tied if k in plain})
    if missing:
        raise SharesUnreadable(f"the checkpoint lacks {missing[0]} (transformers would initialise it)")
    return names


def _without_adapter_layers(name: str) -> str:
    """A state-dict name as the model had it before a PEFT method wrapped the layer (``q_proj.base_layer.weight``
    -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def with_stand_in_weights(model):
    """``model`` (built on 'meta') with each parameter a stand-in on the host: its shape and dtype, every element
    one shared NaN (no memory), ties kept. A method adapts it as it would the loaded model: its adapter is
    initialised on the host with the loaded model's seeds, where on 'meta' it would be lost; an initialisation
    that reads the base weights (DoRA's magnitudes) reads NaN, which ``kept_values`` finds."""
    swap_parameters(model, lambda p: torch.full((), float("nan"), dtype=p.dtype).expand(p.shape))
    return model


def swap_parameters(model, make) -> None:
    """Every parameter replaced by ``make(parameter)`` (its ``requires_grad`` kept), each shared one once, so
    that tied parameters stay tied."""
    new: dict[int, tuple] = {}  # id -> (the old parameter, kept alive so that no other takes its id; the new)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = (p, torch.nn.Parameter(make(p), requires_grad=p.requires_grad))
                module._parameters[name] = new[id(p)][1]
