"""Bundled public configs (``--model qwen2.5-vl-7b``): plan a real checkpoint offline, on a weightless model.
"""

from __future__ import annotations

import re
from pathlib import Path

from vlft.errors import ConfigError

# Public configs of models whose weights are not on this disk: plans (dry runs) without a download.
BUNDLED_CONFIGS = Path(__file__).parent / "configs"


def bundled_config(name: str) -> Path | None:
    """The bundled config folder for a name like ``qwen2.5-vl-7b`` or ``Qwen/Qwen2.5-VL-7B-Instruct``."""
    m = re.fullmatch(r"(?:qwen/)?qwen2\.5-vl-(\d+b)(?:-instruct)?", name.strip().lower())
    if not m:
        return None
    path = BUNDLED_CONFIGS / f"qwen2.5-vl-{m.group(1)}"
    return path if (path / "config.json").is_file() else None


def bundled_names() -> list[str]:
    return sorted((p.name for p in BUNDLED_CONFIGS.iterdir() if (p / "config.json").is_file()),
                  key=lambda n: int(re.sub(r"\D", "", n.split("-")[-1]) or 0))


def is_bundled(path: str) -> bool:
    return Path(path).resolve().parent == BUNDLED_CONFIGS.resolve()


def require_weights(path: str, asked: str | None) -> None:
    """A real run needs weights; a bundled config has none: say where to put them."""
    if not is_bundled(path):
        return
    name = Path(path).name
    hub = "Qwen/" + name.replace("qwen2.5-vl", "Qwen2.5-VL").replace("b", "B") + "-Instruct"
    raise ConfigError(
        f"--model {asked}: vlft ships only the config of {name} (enough for --dry-run and the memory plan), "
        f"not its weights. Download them on a machine with internet, e.g. `huggingface-cli download {hub} "
        f"--local-dir /models/{hub.split('/')[1]}`, and pass --model /models/{hub.split('/')[1]}"
    )
