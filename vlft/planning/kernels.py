"""Kernel patches: the backends' offers (``vlft_kernel_patches``) chosen once, at plan time, by ``--kernels``.

The core knows no kernel: a backend declares each ``KernelPatch`` (what it replaces, why, its condition
and whether that holds here), and this module decides which are taken and why the others are not. The
choice is plain data in the plan (``plan.kernels``); the chosen patches' ``apply`` run once on the loaded
base model, and the training step calls nothing of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vlft.config import RunConfig, parse_attn, parse_kernels
from vlft.contracts.backend import KernelPatch
from vlft.errors import ConfigError
from vlft.models.patching import pin_patch
from vlft.policies import AttentionPolicy


@dataclass
class KernelChoice:
    """The kernels of a run: those chosen and those declined, each with the reason."""

    asked: str = "auto"
    chosen: list[KernelPatch] = field(default_factory=list)
    declined: list[tuple[KernelPatch, str]] = field(default_factory=list)

    def describe(self) -> dict:
        return {
            "asked": self.asked,
            "chosen": [dict(k.describe(), because=k.reason) for k in self.chosen],
            "declined": [dict(k.describe(), because=why) for k, why in self.declined],
        }


def choose_kernels(offered: list[KernelPatch], config: RunConfig) -> KernelChoice:
    """Take the offered patches ``--kernels`` asks for.

    ``auto``: every available patch that is on by default; ``none``: no patch; ``NAME,...``: exactly those
    (``auto,NAME`` adds an opt-in one). A named patch that is not offered, or whose condition does not hold
    here, is an error saying why; a patch needing an attention implementation for a tower ``--attn`` sets
    otherwise is declined (the user's ``--attn`` wins).
    """
    mode, names = parse_kernels(config.kernels)
    by_name: dict[str, KernelPatch] = {}
    for k in offered:
        if k.name in by_name:
            raise ConfigError(f"two plugins offer the kernel patch '{k.name}' ({by_name[k.name].backend}, {k.backend})")
        by_name[k.name] = k
    unknown = sorted(names - set(by_name))
    if unknown:
        raise ConfigError(
            f"--kernels {config.kernels}: no kernel patch named {', '.join(unknown)} for this backend "
            f"and model; offered: {', '.join(by_name) or 'none'}"
        )
    for name in sorted(names):
        if not by_name[name].available:
            raise ConfigError(f"--kernels {config.kernels}: {name} cannot be used here: {by_name[name].reason}")
    asked_attn = parse_attn(config.attn) or {}
    choice = KernelChoice(asked=config.kernels)
    for k in offered:
        if mode == "none":
            choice.declined.append((k, "--kernels none"))
            continue
        if k.name not in names:
            if mode == "named":
                choice.declined.append((k, f"not named in --kernels {config.kernels}"))
                continue
            if not k.available:
                choice.declined.append((k, k.reason))
                continue
            if not k.default:
                choice.declined.append((k, f"off by default ({k.reason}); --kernels auto,{k.name} takes it"))
                continue
        clash = [t for t, impl in k.attention.items() if t in asked_attn and asked_attn[t] != impl]
        if clash:
            choice.declined.append((k, f"--attn {config.attn} sets the {' and '.join(clash)} tower(s) otherwise"))
            continue
        choice.chosen.append(k)
    return choice


def with_kernel_attention(policy: AttentionPolicy, choice: KernelChoice) -> AttentionPolicy:
    """The attention policy with the chosen patches' per-tower implementations (``--attn`` already won in
    ``choose_kernels``); unchanged when no chosen patch needs one."""
    towers = {"vision": policy.vision, "text": policy.text}
    changed = []
    for k in choice.chosen:
        for tower, impl in k.attention.items():
            if towers.get(tower) != impl:
                towers[tower] = impl
                changed.append(f"{tower}={impl} by kernel {k.name}")
    if not changed:
        return policy
    return dataclasses.replace(
        policy,
        vision=towers["vision"],
        text=towers["text"],
        reason=f"{policy.reason}; {', '.join(changed)}" if policy.reason else ", ".join(changed),
    )


def apply_kernels(choice: KernelChoice | None, model) -> list[str]:
    """Run each chosen patch's ``apply`` on the loaded base model, pinning the forwards it binds and the modules
    it puts in place (``models.patching``: so ``train()``/``eval()`` cannot undo them, and the loop can see
    them run); one line per patch, for the plan."""
    lines = []
    for k in choice.chosen if choice else []:
        if k.apply is None:
            continue
        line, pinned = pin_patch(model, k.name, k.apply)
        line = f"kernel {k.name}: {line}" if line else f"kernel {k.name}"
        lines.append(
            line + (f" [{pinned} module(s) pinned, checked at step 1 and after each evaluation]" if pinned else "")
        )
    return lines


def format_kernels(desc: dict | None) -> list[str]:
    """The plan's kernel lines: chosen first, then declined, each with its reason."""
    if not desc:
        return []
    chosen, declined = desc["chosen"], desc["declined"]
    lines = [f"kernels      --kernels {desc['asked']}: {len(chosen)} chosen, {len(declined)} declined"]
    lines += [f"  + {k['name']}: replaces {k['replaces']} ({k['because']})" for k in chosen]
    lines += [f"  - {k['name']}: {k['because']}" for k in declined]
    return lines
