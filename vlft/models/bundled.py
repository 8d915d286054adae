"""Bundled public configs (``--model qwen3-vl-8b``): plan a real checkpoint offline, on a weightless model.

The configs are the model-family plugins' (``vlft_bundled_model_configs``); this module only finds them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vlft.errors import ConfigError
from vlft.models.families import bundled_configs


def _key(name: str) -> str:
    """``Owner/Name-Instruct`` and ``name`` alike: lower case, no owner, no ``-instruct``."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    return re.sub(r"-instruct$", "", key)


def bundled_config(name: str, registry) -> Path | None:
    """The bundled config folder for a name like ``qwen3-vl-8b`` or ``Owner/Name-8B-Instruct``."""
    if name.count("/") > 1:
        return None
    configs = bundled_configs(registry)
    path = configs.get(_key(name))
    return Path(path) if path is not None and (Path(path) / "config.json").is_file() else None


def bundled_names(registry) -> list[str]:
    def key(n):
        m = re.match(r"(.*?)-(\d+(?:\.\d+)?)b", n)
        return (m.group(1), float(m.group(2))) if m else (n, 0.0)

    return sorted(bundled_configs(registry), key=key)


def bundled_by_family(registry, families) -> dict[str, list[str]]:
    """{family name: its bundled config names}: a config belongs to the family of ``families`` that owns the
    ``model_type`` in its config.json (one source: the ``vlft_bundled_model_configs`` hook)."""
    out: dict[str, list[str]] = {f.name: [] for f in families}
    configs = bundled_configs(registry)
    for name in bundled_names(registry):
        try:
            model_type = json.loads((Path(configs[name]) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            continue
        owner = next((f for f in families if f.owns(model_type)), None)
        if owner is not None:
            out[owner.name].append(name)
    return out


def is_bundled(path: str, registry) -> bool:
    here = Path(path).resolve()
    return any(Path(p).resolve() == here for p in bundled_configs(registry).values())


def require_weights(path: str, asked: str | None, registry) -> None:
    """A real run needs weights; a bundled config has none: say where to put them."""
    if not is_bundled(path, registry):
        return
    name = Path(path).name
    hub_file = Path(path) / "hub_id.txt"  # the checkpoint the config is from, where the plugin says
    hub = hub_file.read_text().strip() if hub_file.is_file() else f"<the {name} checkpoint>"
    local = hub.rsplit("/", 1)[-1] if hub_file.is_file() else name
    raise ConfigError(
        f"--model {asked}: vlft ships only the config of {name} (enough for --dry-run and the memory plan), "
        f"not its weights. Download them on a machine with internet, e.g. `huggingface-cli download {hub} "
        f"--local-dir /models/{local}`, and pass --model /models/{local}"
    )
