"""What every PEFT-based method shares: options, saving, loading, merging."""

from __future__ import annotations

import dataclasses
from typing import Any

from vlft.errors import ConfigError


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


def help_of(cls) -> dict[str, str]:
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def save(model, path) -> None:
    # writes adapter_config.json + adapter_model.safetensors
    model.save_pretrained(str(path), safe_serialization=True)


def load(model, path, trainable: bool):
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)


def merge(model):
    return model.merge_and_unload()
