"""What trains, and at which learning rate: the merger trained in full, and one AdamW group per tower.

Towers come from the model family: the merger(s) are ``family.towers.vision_mergers``, the vision tower is
``family.towers.vision`` (less the mergers under it), the text side is everything else. ``--lr-vision``
and ``--lr-merger`` are absolute learning rates (as ms-swift's ``vit_lr``/``aligner_lr`` and the
official Qwen scripts' ``vision_tower_lr``/``mm_projector_lr``), each defaulting to ``--lr``; the
schedule (warm-up, cosine) scales every group by the same factor.
"""

from __future__ import annotations

from vlft.errors import ConfigError

GROUPS = ("text", "vision", "merger")


def _clean(name: str) -> str:
    """A parameter's name without PEFT's wrapping, so it starts with the family's paths."""
    for wrap in ("base_model.model.",):
        if name.startswith(wrap):
            name = name[len(wrap) :]
    return name.replace(".modules_to_save.default", "").replace(".original_module", "")


def tower_of(name: str, family) -> str:
    """'merger', 'vision' or 'text' for a parameter name of the (PEFT-wrapped) model."""
    name = _clean(name)
    if any(name == m or name.startswith(m + ".") for m in family.towers.vision_mergers if m):
        return "merger"
    if family.towers.vision and name.startswith(family.towers.vision + "."):
        return "vision"
    return "text"


def learning_rates(lr: float, config) -> dict[str, float]:
    """The absolute learning rate of each group: ``--lr-vision``/``--lr-merger`` or the run's ``lr``."""
    return {
        "text": lr,
        "vision": config.lr_vision if config.lr_vision is not None else lr,
        "merger": config.lr_merger if config.lr_merger is not None else lr,
    }


def trainable_groups(model, family) -> dict[str, list]:
    """Trainable (name, parameter) pairs per group, groups without any left out."""
    out: dict[str, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out.setdefault(tower_of(name, family), []).append((name, p))
    return {g: out[g] for g in GROUPS if g in out}


def describe_groups(model, family, lr: float, config) -> dict[str, dict]:
    """For the plan: each group's learning rate and trainable parameter count."""
    lrs = learning_rates(lr, config)
    return {
        g: {"lr": lrs[g], "parameters": sum(p.numel() for _, p in ps)}
        for g, ps in trainable_groups(model, family).items()
    }


def optimizer_groups(model, family, lr: float, config) -> list[dict]:
    """AdamW parameter groups: ``{"name", "params", "lr"}`` per tower that has trainable parameters."""
    lrs = learning_rates(lr, config)
    return [
        {"name": g, "params": [p for _, p in ps], "lr": lrs[g]} for g, ps in trainable_groups(model, family).items()
    ]


def check_merger_trained(model, family, method: str) -> int:
    """After ``--train-merger``: the number of merger parameters in full training; a method that did not
    train them (ignoring ``config.train_merger``) is an error rather than a silent no-op."""
    names = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and ".modules_to_save." in n and tower_of(n, family) == "merger"
    ]
    if not names:
        raise ConfigError(
            f"--train-merger: method {method} did not make the merger trainable (its plugin ignores "
            "config.train_merger; PEFT methods pass the family's vision_mergers as modules_to_save)"
        )
    chosen = set(names)
    return sum(p.numel() for n, p in model.named_parameters() if n in chosen)
