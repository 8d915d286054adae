"""What a method plugin answers: the adapter methods it offers and each one's hyper-parameters and targets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlft.contracts import contract


@contract
@dataclass(frozen=True)
class MethodInfo:
    """What ``vlft_methods()`` answers: one entry per adapter method a plugin offers."""

    name: str
    description: str


@contract
@dataclass
class AdapterDefaults:
    """A method's hyper-parameters and where it adapts by default.

    ``text_modules`` and ``vision_modules`` are the leaf names of the linear
    layers to adapt inside text decoder layers and vision blocks; the shared
    target selection turns them into full module names.
    """

    method: str
    lr: float
    hyperparameters: dict[str, Any]
    text_modules: tuple[str, ...] = ()
    vision_modules: tuple[str, ...] = ()
    default_targets: str = "both"  # what ``--targets auto`` means for this method
    # the method also adapts a mixture-of-experts family's fused expert weights (ModelFamily.experts.parameters):
    # the core then passes them to vlft_apply_adapter as ``target_parameters`` (routers stay frozen)
    target_experts: bool = False
    help: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
