"""Which modules an adapter goes on: shared by every method.

*Which* modules is the model family's answer (``ModelFamily``: the vision blocks and decoder layers by
path, and the linear modules inside each, per part: attention, linear attention, MLP); the method keeps
its hyper-parameters and what ``--targets auto`` means. Only ``nn.Linear`` modules are targets. Fused
expert weights (mixture-of-experts families) are listed separately, for PEFT's ``target_parameters``,
and only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlft.errors import ConfigError
from vlft.models.families import select_target_modules, target_names


@dataclass
class TargetPlan:
    """The adapted module names, and what was chosen."""

    modules: list[str]
    towers: str
    vision_blocks: list[int]
    vision_depth: int
    text_layers: int
    parameters: list[str] = field(default_factory=list)  # fused expert weights (target_parameters)


def select_targets(model, defaults, targets: str, vision_last_n: int, family, experts: bool = False) -> TargetPlan:
    """Full module names to adapt for ``targets`` ("vision", "text", "both" or "auto")."""
    towers = defaults.default_targets if targets == "auto" else targets
    ft = select_target_modules(
        model, family, towers, vision_last_n, experts=experts, leaves=method_leaves(defaults, family)
    )
    if not ft.modules and not ft.parameters:
        raise ConfigError(
            f"no modules to adapt for --targets {towers} with --vision-last-n {vision_last_n}: the {family.name} "
            f"model has {ft.vision_depth} vision blocks with {'/'.join(target_names(family, 'vision')) or 'no'} layers "
            f"and {ft.text_layers} text layers with {'/'.join(target_names(family, 'text')) or '(none)'}"
        )
    return TargetPlan(ft.modules, towers, ft.vision_blocks, ft.vision_depth, ft.text_layers, ft.parameters)


def method_leaves(defaults, family) -> dict[str, tuple[str, ...]]:
    """A method's own module choice per tower (``AdapterDefaults.text_modules``/``vision_modules``, leaf
    names), where it names a module the family's default targets leave out (IA3's ``down_proj``): a method
    that asks for the family's attention projections, or for nothing, gets the family's full default set
    (which knows, say, a hybrid model's linear-attention projections)."""
    out = {}
    for tower, names, default in (
        ("text", defaults.text_modules, target_names(family, "text")),
        ("vision", defaults.vision_modules, target_names(family, "vision")),
    ):
        family_leaves = {rel.rsplit(".", 1)[-1] for rel in default}
        if names and not set(names) <= family_leaves:
            out[tower] = tuple(names)
    return out
