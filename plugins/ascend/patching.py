"""Turning SDPA (or flash) attention back to eager where the NPU policy chose eager."""

from __future__ import annotations

from vlft import AttentionPolicy


def patch_attention(model, policy: AttentionPolicy, family=None) -> list[str]:
    """Switch every config of ``model`` still set to SDPA (or flash) to eager where ``policy`` chose eager.

    Attention layers read ``config._attn_implementation`` at each forward, so
    this reroutes them. A config is the vision tower's when it is the model's
    ``vision_config`` or belongs to a module under the family's vision side
    (``towers.vision`` and any merger outside it): the family says where the
    tower is, whatever its name. Returns one line per patched config.
    """
    roots = [r for r in (family.towers.vision, *family.towers.vision_mergers) if r] if family else []
    top = getattr(model, "config", None)
    vision_cfg = getattr(top, "vision_config", None)
    configs: dict[int, tuple[str, object]] = {}
    if top is not None:
        configs[id(top)] = ("model", top)
    for name, module in model.named_modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in configs:
            configs[id(cfg)] = (name, cfg)
    patched = []
    for name, cfg in configs.values():
        in_vision = any(name == r or name.startswith(r + ".") for r in roots)
        tower = "vision" if cfg is vision_cfg or in_vision else "text"
        want = policy.vision if tower == "vision" else policy.text
        current = getattr(cfg, "_attn_implementation", None)
        if want != "eager" or current in (None, "eager"):
            continue
        if isinstance(getattr(type(cfg), "_attn_implementation", None), property):
            cfg._attn_implementation = {"": "eager"}  # pyright: ignore[reportAttributeAccessIssue]  # a config; transformers' setter: this config only, not its sub-configs
        else:
            cfg._attn_implementation = "eager"  # pyright: ignore[reportAttributeAccessIssue]  # a transformers config
        patched.append(f"{name} ({tower}): {current} attention -> eager")
    return patched
