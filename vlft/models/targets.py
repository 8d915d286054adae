"""Which modules an adapter goes on: shared by every method.

Vision blocks are ``...visual.blocks.<i>...`` and text decoder layers are
``...layers.<i>...`` outside the visual tower (the Qwen2-VL / Qwen2.5-VL
layout in transformers). Only linear layers are targets; the Conv3d patch
embedding never is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from vlft.errors import ConfigError

VISION_BLOCK = re.compile(r"(?:^|\.)visual\.blocks\.(\d+)\.(.+)$")


TEXT_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


@dataclass
class TargetPlan:
    """The adapted module names, and what was chosen."""

    modules: list[str]
    towers: str
    vision_blocks: list[int]
    vision_depth: int
    text_layers: int


def _is_linear(module) -> bool:

    return isinstance(module, torch.nn.Linear)


def select_targets(model, defaults, targets: str, vision_last_n: int) -> TargetPlan:
    """Full module names to adapt for ``targets`` ("vision", "text", "both" or "auto")."""
    towers = defaults.default_targets if targets == "auto" else targets
    vision: dict[int, list[str]] = {}
    text: list[str] = []
    text_layers = set()
    for name, module in model.named_modules():
        if not _is_linear(module) or "patch_embed" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if m := VISION_BLOCK.search(name):
            if leaf in defaults.vision_modules:
                vision.setdefault(int(m.group(1)), []).append(name)
        elif "visual" not in name and (m := TEXT_LAYER.search(name)):
            text_layers.add(int(m.group(1)))
            if leaf in defaults.text_modules:
                text.append(name)
    depth = max(vision) + 1 if vision else 0
    chosen_blocks = sorted(vision)[-vision_last_n:] if vision_last_n else []
    modules: list[str] = []
    if towers in ("vision", "both"):
        modules += [n for b in chosen_blocks for n in vision[b]]
    if towers in ("text", "both"):
        modules += text
    if not modules:
        raise ConfigError(
            f"no modules to adapt for --targets {towers} with --vision-last-n {vision_last_n}: the model has "
            f"{depth} vision blocks with {'/'.join(defaults.vision_modules) or 'no'} layers and "
            f"{len(text)} text layers named {'/'.join(defaults.text_modules) or '(none)'}"
        )
    return TargetPlan(modules, towers, chosen_blocks if towers != "text" else [], depth, len(text_layers))
