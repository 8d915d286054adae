"""Kernel patches that stay applied, and the evidence that a step ran them.

A backend's kernel patch (``KernelPatch.apply``) rewrites the loaded model: it binds a faster ``forward`` on
module instances (torch_npu's fused RMSNorm, Liger's) or puts a new module in place (a Conv3d patch
embedding as a Linear). An instance-bound forward does not last: transformers 5.25's ``train()`` and
``eval()`` re-kernelize every layer marked for hub kernels (``kernels``' ``kernelize``), which pops any
``forward`` bound on the instance; the next step would run the unpatched layer while the plan lists the
patch as applied.

``pin_patch`` runs a patch and then pins what it changed: each module whose instance forward the patch
bound, and each module it put in place, gets a class of its own, a subclass of the same name whose
``forward`` is the patched one and which ``kernelize`` skips (``kernel_condition``). A ``forward`` bound on the
instance after that (by anything) shows up as one shadowing the pinned one. The pinned forward counts its
calls, so the training loop can check, at its first step and at the first step after each evaluation, that
every applied patch ran (``PatchWatch``), and name the one that did not.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlft.errors import VlftError

KERNEL = "_vlft_kernel"  # class attribute of a pinned class: the kernel patch's name
CALLS = "_vlft_calls"  # class attribute of a pinned class: its call counter (a one-item list, shared by reference)
FORWARD = "_vlft_forward"  # instance attribute: the patched forward the pinned class calls


def _pinned_class(cls: type, kernel: str) -> type:
    """A subclass of ``cls`` with the same name whose forward calls the instance's patched forward and counts it."""
    counter = [0]

    def forward(self, *args, **kwargs):
        counter[0] += 1
        return getattr(self, FORWARD)(*args, **kwargs)

    namespace = {
        "forward": forward,
        KERNEL: kernel,
        CALLS: counter,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        # kernels' kernelize skips a layer whose condition says no (the pin is ours, not a hub kernel)
        "kernel_condition": staticmethod(lambda module: False),
    }
    return type(cls.__name__, (cls,), namespace)


def pin_forward(module, forward: Callable, kernel: str, classes: dict | None = None) -> None:
    """Make ``forward`` (a callable taking the forward's arguments, usually bound to ``module``) the forward
    of ``module`` in a way ``train()``/``eval()`` cannot undo, counted under ``kernel``. ``classes`` shares
    one pinned class per original class among the modules of one patch."""
    classes = {} if classes is None else classes
    cls = type(module)
    if getattr(cls, KERNEL, None) is not None:  # pinned before (a second patch on the same module)
        cls = cls.__mro__[1]
    if (cls, kernel) not in classes:
        classes[(cls, kernel)] = _pinned_class(cls, kernel)
    module.__dict__.pop("forward", None)
    object.__setattr__(module, FORWARD, forward)
    module.__class__ = classes[(cls, kernel)]


def pin_patch(model, kernel: str, apply: Callable[[Any], str]) -> tuple[str, int]:
    """Run ``apply(model)`` and pin each forward it bound on an instance and each module it put in place (the
    topmost of a new subtree); (its line, the modules pinned)."""
    # the modules themselves are held, so none replaced by the patch frees an id a new module could take
    before = {id(m): (m, m.__dict__.get("forward")) for m in model.modules()}
    line = apply(model)
    classes: dict = {}
    pinned = 0
    for name, module in model.named_modules():
        bound = module.__dict__.get("forward")
        if id(module) in before:
            if bound is None or bound is before[id(module)][1]:
                continue
            pin_forward(module, bound, kernel, classes)
        else:
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            if id(parent) not in before and parent is not model:
                continue  # inside a new module pinned already
            pin_forward(module, bound or types.MethodType(type(module).forward, module), kernel, classes)
        pinned += 1
    return line, pinned


@dataclass
class PatchState:
    """What the modules pinned for one kernel patch look like now: how often their forwards ran (all of them
    together) and the modules where something else now runs instead (a forward bound over the pinned one, or
    the pinned class gone)."""

    calls: int = 0
    modules: int = 0
    shadowed: list[str] = field(default_factory=list)


def patch_states(model, kernels: set[str] | None = None) -> dict[str, PatchState]:
    """Every pinned kernel patch found in ``model`` (or those in ``kernels``, found or not), by name."""
    states: dict[str, PatchState] = {k: PatchState() for k in (kernels or ())}
    counters: dict[str, dict[int, list]] = {}
    for name, module in model.named_modules():
        kernel = getattr(type(module), KERNEL, None)
        if kernel is None:
            continue
        state = states.setdefault(kernel, PatchState())
        state.modules += 1
        counter = getattr(type(module), CALLS)
        counters.setdefault(kernel, {})[id(counter)] = counter
        if "forward" in module.__dict__:
            state.shadowed.append(name)
    for kernel, found in counters.items():
        states[kernel].calls = sum(c[0] for c in found.values())
    return states


class PatchWatch:
    """The applied kernel patches, checked at the steps the loop names: each must have run in that step.

    ``before_step()`` notes the counters; ``after_step(step, where)`` raises naming every patch whose pinned
    forwards did not run in the step or were shadowed. Nothing is read at the other steps."""

    def __init__(self, model):
        self.model = model
        self.expected = {k: s.modules for k, s in patch_states(model).items()}
        self.counts: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.expected)

    def before_step(self) -> None:
        self.counts = {k: s.calls for k, s in patch_states(self.model, set(self.expected)).items()}

    def after_step(self, step: int, where: str) -> None:
        now = patch_states(self.model, set(self.expected))
        problems = []
        for kernel, modules in sorted(self.expected.items()):
            state = now[kernel]
            ran = state.calls - self.counts.get(kernel, 0)
            if state.modules < modules:
                problems.append(
                    f"{kernel}: {modules - state.modules} of its {modules} patched module(s) are no longer patched"
                )
            elif state.shadowed:
                problems.append(
                    f"{kernel}: a forward was bound over it on {len(state.shadowed)} of its {modules} "
                    f"module(s) (e.g. {state.shadowed[0]})"
                )
            elif ran == 0:
                problems.append(f"{kernel}: its forward ran 0 times in the step ({modules} module(s) patched)")
        if problems:
            raise KernelPatchLost(
                f"step {step} ({where}) did not run kernel patch(es) the plan lists as applied: "
                + "; ".join(problems)
                + ". Something replaced them after set-up; the run stops rather than "
                "train with other kernels than its plan says. Run with --kernels none (or without that patch) "
                "and report it."
            )


class KernelPatchLost(VlftError):
    """A kernel patch the plan lists as applied did not run in a step the loop checked."""
