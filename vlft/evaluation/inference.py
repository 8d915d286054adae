"""What ``vlft predict``, ``eval`` and ``export`` share: finding an adapter, and loading it on its base model
with the same backend, precision and attention policies as ``vlft run``.

``--adapter`` is a run folder (``plan.json`` + ``adapter/``) or a bare adapter folder
(``adapter_config.json``); ``--model`` is the base (or a merged model when no adapter is given).
The method comes from the run's plan, or from the adapter's PEFT type; loading and merging go
through the method's hooks, so a method plugin that is not PEFT works the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlft.config import build_config
from vlft.data.encoding import SampleEncoder
from vlft.errors import ConfigError, VlftError
from vlft.models.adapter_folders import AdapterSource, locate_adapter
from vlft.models.bundled import require_weights
from vlft.models.loading import (
    dequantized,
    load_model,
    load_processor,
    model_config_and_family,
    resolve_model_path,
)
from vlft.planning.kernels import apply_kernels
from vlft.planning.memory import four_bit_skip
from vlft.planning.plan import RunPlan, choose_backend, require_available, resolve_policies
from vlft.registry import Registry


@dataclass
class Loaded:
    """A model ready for inference, with everything needed to encode inputs and report what ran."""

    model: Any  # a transformers model, or the PEFT model that wraps it
    processor: Any  # the checkpoint's transformers processor
    encoder: SampleEncoder
    device: torch.device
    autocast_dtype: torch.dtype | None
    plan: RunPlan  # backend, precision, attention as resolved
    model_path: str
    source: AdapterSource | None


def _base_model_path(source: AdapterSource | None, model: str | None, registry) -> str:

    if model is not None or source is None:
        return resolve_model_path(model, registry)
    base = source.base_model
    if base and Path(base).is_dir():
        return resolve_model_path(base, registry)
    if base and not base.startswith((".", "/", "~")) and base.count("/") == 1:
        return base  # a hub id
    where = source.run_dir or source.adapter_dir
    raise ConfigError(
        f"--adapter {where}: its base model {base!r} is not on this machine; pass --model with the base model's folder"
    )


@dataclass(frozen=True)
class LoadOptions:
    """How ``load_for_inference`` loads: the policies' options as ``vlft run`` takes them (``max_pixels`` None: as
    the adapter's run encoded its images). ``on_device=False`` keeps the model on the CPU (export merges there,
    in fp32). ``param_dtype`` "nf4" loads the base in 4-bit as the run trained it (double quantization as it
    did, or ``double_quant``); with ``dequantize`` those weights come back as plain fp32 linears before the
    adapter goes on (what export merges into)."""

    backend: str = "auto"
    precision: str = "auto"
    param_dtype: str = "auto"
    attn: str | None = None
    max_pixels: int | None = None
    on_device: bool = True
    double_quant: bool = False
    dequantize: bool = False


def load_for_inference(
    registry: Registry, adapter: str | AdapterSource | None, model: str | None, options: LoadOptions = LoadOptions()
) -> Loaded:
    """Resolve the policies as ``vlft run`` does, load the base (or merged) model and the adapter on it.

    ``adapter``: a run or adapter folder, or the ``AdapterSource`` the caller located already.
    """
    backend, precision, param_dtype, attn = options.backend, options.precision, options.param_dtype, options.attn
    max_pixels, double_quant = options.max_pixels, options.double_quant

    source = adapter if isinstance(adapter, AdapterSource) or adapter is None else locate_adapter(registry, adapter)
    model_path = _base_model_path(source, model, registry)
    run_cfg = source.run_config if source else {}
    if max_pixels is None:
        max_pixels = run_cfg.get("max_pixels")  # encode images as the adapter saw them in training
    if param_dtype == "nf4" and not double_quant:
        double_quant = bool(run_cfg.get("double_quant"))  # quantized as the run was
    config = build_config(
        {},
        {
            k: v
            for k, v in dict(
                backend=backend,
                precision=precision,
                param_dtype=param_dtype,
                double_quant=double_quant or None,
                attn=attn,
                max_pixels=max_pixels,
                method=source.method if source else None,
                model=model_path,
            ).items()
            if v is not None
        },
    )
    choice = choose_backend(registry, config.backend)
    require_available(choice)
    name = choice.info.name
    device = torch.device("cpu")
    if options.on_device:
        setup = registry.first("vlft_setup_device", backend=name, config=config)
        for key, value in setup.env.items():
            os.environ.setdefault(key, value)
        device = setup.device
    model_config, family = model_config_and_family(model_path, registry)
    plan = resolve_policies(registry, config, model_path, model_config, choice, family=family)
    require_weights(model_path, model, registry)
    processor = load_processor(model_path, family, registry)
    quantized = plan.precision.quantization is not None  # 4-bit weights are made on their device, while loading
    net = load_model(
        model_path,
        plan.attention,
        plan.precision,
        device=device if quantized else None,
        family=family,
        keep_float=four_bit_skip(family),
    )
    if options.dequantize and quantized:
        net = dequantized(net)
    registry.hook.vlft_patch_model(backend=name, model=net, config=config, attention=plan.attention, family=family)
    apply_kernels(plan.kernels, net)
    if source is not None:
        try:
            net = registry.first(
                "vlft_load_adapter", method=source.method, model=net, path=str(source.adapter_dir), trainable=False
            )
        except VlftError:
            raise
        except Exception as e:  # noqa: BLE001 - a mismatched base shows up as a shape or key error in loading
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise ConfigError(
                f"--adapter {source.adapter_dir}: it does not fit the model at {model_path} "
                f"({e.__class__.__name__}: {first[:300]}). It was trained on {source.base_model}; "
                "pass that model with --model"
            ) from None
    net.to(device)  # pyright: ignore[reportArgumentType]  # transformers' to() overloads misread a model
    net.eval()
    autocast = getattr(torch, plan.precision.autocast_dtype) if plan.precision.autocast_dtype else None
    encoder = SampleEncoder(processor, max_pixels=config.max_pixels, family=family)
    return Loaded(net, processor, encoder, device, autocast, plan, model_path, source)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a failure leaves nothing half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
