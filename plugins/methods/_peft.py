"""What every PEFT-based method shares: options, saving, loading, merging.

Imports inside functions: peft (and with it transformers and torch) load only when an adapter is applied,
loaded or merged; `vlft plugins` imports every method plugin just to list it.
"""

from __future__ import annotations

import dataclasses
import warnings
from contextlib import contextmanager
from typing import Any

from vlft import ConfigError, hookimpl


def options_from(cls, overrides: dict[str, Any], method: str):
    """Build a method's options dataclass, naming any unknown or ill-typed key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(
            f"method {method}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}"
        )
    values = {}
    for key, value in overrides.items():
        default = fields[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"method {method}: option {key} expects true/false, got {value!r}")
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"method {method}: option {key} expects a number, got {value!r}")
            value = type(default)(value)
        values[key] = value
    return cls(**values)


def modules_to_save(model, config, family) -> list[str] | None:
    """The merger(s) to train in full under ``--train-merger`` (PEFT ``modules_to_save``), else None: the
    modules the run's family names as its mergers (``vision_mergers``). A ModuleList (Qwen3-VL's deepstack
    mergers) is indexed, never called, so its members are listed instead of the list."""
    if not getattr(config, "train_merger", False):
        return None
    import torch  # a run that adapts has loaded torch already

    names = []
    for path in family.towers.vision_mergers:
        module = model
        for step in path.split("."):
            if not hasattr(module, step):
                raise ConfigError(
                    f"--train-merger: the {family.name} family names the merger {path}, which "
                    f"{type(model).__name__} lacks (no '{step}')"
                )
            module = getattr(module, step)
        names += [f"{path}.{i}" for i in range(len(module))] if isinstance(module, torch.nn.ModuleList) else [path]
    return names or None


def help_of(cls) -> dict[str, str]:
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def io_hooks(name: str):
    """The save, load and merge hook implementations for the PEFT method ``name``."""

    @hookimpl
    def vlft_save_adapter(method, model, path):
        if method != name:
            return None
        # adapter_config.json + adapter_model.safetensors, loadable by plain PeftModel.from_pretrained
        model.save_pretrained(str(path), safe_serialization=True)
        return True

    @hookimpl
    def vlft_load_adapter(method, model, path, trainable):
        if method != name:
            return None
        from peft import PeftModel

        with quiet_wrapping():
            return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)

    @hookimpl
    def vlft_merge_adapter(method, model):
        if method != name:
            return None
        return model.merge_and_unload()

    return vlft_save_adapter, vlft_load_adapter, vlft_merge_adapter


@contextmanager
def quiet_wrapping():
    """PEFT still asks transformers' deprecated ``is_gradient_checkpointing`` while it wraps a model: a warning
    about library internals the user can do nothing about, silenced for the wrapping only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
