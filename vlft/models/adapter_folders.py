"""Where an adapter is: a run folder (``plan.json`` + ``adapter/``) or a bare adapter folder
(``adapter_config.json``), with the method and base model that trained it. ``vlft predict``/``eval``/``export``
(``--adapter``) and ``vlft run --init-adapter`` find adapters here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from vlft.errors import ConfigError
from vlft.registry import Registry


@dataclass
class AdapterSource:
    """Where an adapter is and what was trained: its folder, the run around it (if any), method and base."""

    adapter_dir: Path
    run_dir: Path | None
    method: str
    base_model: str | None  # the base the run trained on (a path on the machine that trained it)
    run_config: dict = field(default_factory=dict)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read {what} ({e.__class__.__name__}: {e})") from None


def locate_adapter(registry: Registry, path: str | os.PathLike, flag: str = "--adapter") -> AdapterSource:
    """A run folder or an adapter folder -> ``AdapterSource``; anything else is one clear error (naming ``flag``)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(
            f"{flag} {path}: no such folder; give a run folder (from `vlft run`) "
            "or an adapter folder (holding adapter_config.json)"
        )
    if (p / "adapter_config.json").is_file():
        adapter_dir = p
        run_dir = p.parent if (p.parent / "plan.json").is_file() else None
    elif (p / "adapter" / "adapter_config.json").is_file():
        adapter_dir, run_dir = p / "adapter", p
    else:
        hint = (
            "it holds plan.json but no adapter/ (the run did not finish; its checkpoints/ hold adapters)"
            if (p / "plan.json").is_file()
            else "it holds neither adapter/adapter_config.json nor adapter_config.json"
        )
        raise ConfigError(f"{flag} {path}: not a run folder or an adapter folder: {hint}")
    adapter_config = _read_json(adapter_dir / "adapter_config.json", "the adapter config")
    method, base, run_config = None, adapter_config.get("base_model_name_or_path"), {}
    if run_dir is not None:
        plan = _read_json(run_dir / "plan.json", "the run's plan")
        method = plan.get("method", {}).get("name")
        base = plan.get("model") or base
        if (run_dir / "config.json").is_file():
            run_config = _read_json(run_dir / "config.json", "the run's config")
    if method is None:  # a bare PEFT folder: its PEFT type names the method (LORA -> lora)
        peft_type = str(adapter_config.get("peft_type", "")).lower()
        method = peft_type if peft_type in registry.methods else None
        if method is None:
            raise ConfigError(
                f"{flag} {path}: adapter type {adapter_config.get('peft_type')!r} is not a method "
                f"of any installed plugin ({', '.join(sorted(registry.methods))}); "
                "give the run folder instead, whose plan.json names the method"
            )
    registry.method(method)  # an unknown method is an error naming the valid ones
    return AdapterSource(adapter_dir, run_dir, method, base, run_config)
