"""The CUDA backend's kernel patches (``vlft_kernel_patches``): each faster path, its condition and reason.

- ``linear-patch-embed``: the vision patch embedding's ``Conv3d`` (kernel == stride, so each patch is one
  dot product per output channel) as a matmul over the same weights. The convolution is pathologically slow
  on some GPU / cuDNN pairs: an equal Linear was 11-18x faster (sglang-omni #132), and transformers #45750
  reports orders of magnitude on Blackwell in bf16; torch 2.9.x also has a Conv3d regression (pytorch
  #166122). On by default wherever the family names its patch embedding.
- no flash-attention patch: the backend's own attention policy already loads both towers with flash-attention 2
  wherever flash-attn imports and the GPU is 8.0 or newer (transformers #37363 measured FA2 varlen at 0.22 s
  against SDPA's 1.88 s for one 1000x2530 image on an A100), so such a patch could never change a run.
- ``liger-*``: Liger's RMSNorm, SwiGLU and (m)RoPE kernels (``pip install 'vlft[liger]'``), off by default;
  fused linear cross-entropy is its own patch (it lowered quality on Qwen2.5-VL-3B while the loss looked
  normal, Liger #827).

Imports inside functions: nothing here imports torch or a vendor package (liger_kernel) at module import, since
the plan offers these patches on machines without a GPU too; conditions are probed inside the hook.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

from vlft import KernelPatch

DEVICE_TEST = (
    "tests/hardware/test_kernels_on_device.py::test_cuda_kernel_patches_take_effect_and_match_the_unpatched_model"
)
# Liger names its entry points after transformers' model_type (apply_liger_kernel_to_qwen2_5_vl); which parts
# a model has that such a kernel may replace is the family's to say (``kernels.targets``), not a table here
LIGER_ENTRY = "apply_liger_kernel_to_{model_type}"
LIGER_PARTS = (  # (patch name, the liger switch, the family's kernels.targets role, what it replaces, why)
    (
        "liger-rms-norm",
        "rms_norm",
        "rms_norm",
        "RMSNorm (text decoder)",
        "Liger's fused Triton RMSNorm: fewer kernel launches and less activation memory",
    ),
    ("liger-swiglu", "swiglu", "gated_mlp", "gated MLP activation (text decoder)", "Liger's fused SiLU-multiply"),
    ("liger-rope", "rope", "rotary", "multimodal rotary embedding (text decoder)", "Liger's fused mRoPE"),
)


# -- the Linear patch embedding ---------------------------------------------------------------------------


def conv3d_as_linear_reason(conv) -> str | None:
    """None where ``conv`` is a Conv3d whose kernel equals its stride (no padding, dilation or groups), so it
    is a reshape + matmul; else why not."""
    import torch

    if not isinstance(conv, torch.nn.Conv3d):
        return f"{type(conv).__name__} is not a Conv3d"
    if tuple(conv.kernel_size) != tuple(conv.stride):
        return f"kernel {tuple(conv.kernel_size)} != stride {tuple(conv.stride)}"
    if any(conv.padding) if isinstance(conv.padding, tuple) else conv.padding != "valid":
        return f"padding {conv.padding}"
    if tuple(conv.dilation) != (1, 1, 1) or conv.groups != 1:
        return f"dilation {conv.dilation}, groups {conv.groups}"
    return None


def _linear_patch_embed_class():
    import torch

    class LinearPatchEmbed(torch.nn.Module):
        """A ``Conv3d`` with kernel == stride computed as a matmul. It holds the convolution's own ``weight``
        (shape [out, in, t, h, w]) and ``bias`` Parameters, not copies: the state dict, the optimizer and any
        adapter see the same tensors under the same names, and the matmul reads a view of the weight."""

        def __init__(self, conv: torch.nn.Conv3d):
            super().__init__()
            self.weight = conv.weight
            self.bias = conv.bias
            self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
            self.kernel_size = tuple(conv.kernel_size)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # x: [N, in, t, h, w], one patch per row (the patch embedding reshapes to exactly this)
            n = x.shape[0]
            out = torch.nn.functional.linear(x.reshape(n, -1), self.weight.view(self.out_channels, -1), self.bias)
            return out.view(n, self.out_channels, 1, 1, 1)  # the Conv3d's output shape

        def extra_repr(self) -> str:
            return f"{self.in_channels}, {self.out_channels}, kernel_size=stride={self.kernel_size} (as a matmul)"

    return LinearPatchEmbed


_CLASS = None


def linear_patch_embed(conv):
    """The ``LinearPatchEmbed`` equal to ``conv`` (sharing its Parameters)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _linear_patch_embed_class()
    return _CLASS(conv)


def resolve(model, path: str):
    """The submodule at dotted ``path`` (``model.visual.patch_embed``) of the base model, or None."""
    module = model
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def apply_linear_patch_embed(model, path: str) -> str:
    embed = resolve(model, path)
    if embed is None or not hasattr(embed, "proj"):
        raise RuntimeError(f"linear-patch-embed: the model has no {path}.proj")
    why_not = conv3d_as_linear_reason(embed.proj)
    if why_not:
        raise RuntimeError(f"linear-patch-embed: {path}.proj cannot become a matmul ({why_not})")
    conv = embed.proj
    embed.proj = linear_patch_embed(conv)
    return (
        f"{path}.proj Conv3d{tuple(conv.kernel_size)} -> matmul over the same weight "
        f"[{conv.out_channels}, {conv.weight[0].numel()}] (a view, no copy)"
    )


# -- the offers ------------------------------------------------------------------------------------------


def _patch_embed(family) -> KernelPatch:
    path = family.kernels.vision_stem if family else ""
    return KernelPatch(
        name="linear-patch-embed",
        replaces="Conv3d patch embedding (kernel == stride)",
        backend="cuda",
        why="an equal Linear was 11-18x faster than cuDNN's Conv3d (sglang-omni #132); orders of magnitude on "
        "Blackwell bf16 (transformers #45750)",
        condition="the model family names its patch embedding, a Conv3d with kernel == stride",
        available=bool(path),
        reason=(
            f"{family.name}: {path}.proj is a Conv3d with kernel == stride (checked again when applied)"
            if path
            else f"model family {family.name if family else '(none)'} names no patch embedding"
        ),
        apply=(lambda model: apply_linear_patch_embed(model, path)) if path else None,
        check="tests/test_kernels.py::test_linear_patch_embed_equals_conv3d_forward_and_backward",
    )


def _liger_status(model_config, family) -> tuple[bool, str, str | None]:
    model_type = getattr(model_config, "model_type", None)
    if importlib.util.find_spec("liger_kernel") is None:
        return False, "liger_kernel is not installed (pip install 'vlft[liger]')", None
    if not (family and family.kernels.targets):
        return (
            False,
            (
                f"model family {family.name if family else '(none)'} names no fused-op kernel targets "
                "(kernels.targets), so Liger's patches are not offered for it"
            ),
            None,
        )
    fn = LIGER_ENTRY.format(model_type=model_type)
    try:
        import liger_kernel.transformers as lt  # pyright: ignore[reportMissingImports]  # the liger extra, opt-in

        if not hasattr(lt, fn):
            return False, f"this liger_kernel has no {fn}", None
    except Exception as e:  # noqa: BLE001 - a broken install declines, it does not crash the plan
        return False, f"importing liger_kernel failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})", None
    return True, f"liger_kernel {_version('liger_kernel')} ({fn})", fn


def _version(dist: str) -> str:
    try:
        return version(dist.replace("_", "-"))
    except PackageNotFoundError:
        return "?"


def _apply_liger(fn: str, switch: str):
    def apply(model) -> str:
        import liger_kernel.transformers as lt  # pyright: ignore[reportMissingImports]  # the liger extra, opt-in

        flags = {
            "rope": False,
            "rms_norm": False,
            "swiglu": False,
            "cross_entropy": False,
            "fused_linear_cross_entropy": False,
            switch: True,
        }
        getattr(lt, fn)(model=model, **flags)
        return f"liger {fn}({switch}=True)"

    return apply


def _liger_part(family, role: str, ok: bool, why: str) -> tuple[bool, str]:
    """A part is offered where Liger has the model and the family names what the part replaces."""
    if ok and not (family.kernels.targets or {}).get(role):
        return False, f"model family {family.name} names no '{role}' kernel target"
    return ok, (why + "; opt-in until measured on this task") if ok else why


def _liger(model_config, family) -> list[KernelPatch]:
    ok, why, fn = _liger_status(model_config, family)
    patches = []
    for name, switch, role, replaces, reason in LIGER_PARTS:
        part_ok, part_why = _liger_part(family, role, ok, why)
        patches.append(
            KernelPatch(
                name=name,
                replaces=replaces,
                backend="cuda",
                why=reason,
                condition=f"liger_kernel installed (the vlft[liger] extra) with {LIGER_ENTRY}, and the model family "
                f"names its '{role}' kernel target",
                available=part_ok,
                default=False,
                reason=part_why,
                apply=_apply_liger(fn, switch) if part_ok and fn is not None else None,
                check=DEVICE_TEST,
            )
        )
    flce_why = (
        why
        if not ok
        else (
            "vlft computes the loss from the logits (token_loss_sum over the label tokens), so Liger's fused "
            "forward, which fuses the head with the loss only when the model is given labels, would change nothing"
        )
    )
    patches.append(
        KernelPatch(
            name="liger-fused-linear-cross-entropy",
            replaces="lm_head + cross-entropy",
            backend="cuda",
            why="no full logits tensor; but it lowered downstream quality on Qwen2.5-VL-3B while the loss looked "
            "normal (Liger #827): opt-in and measured only",
            condition="liger_kernel installed and a loss path that hands the model its labels",
            available=False,
            default=False,
            reason=flce_why,
        )
    )
    return patches


def kernel_patches(config, model_config, family) -> list[KernelPatch]:
    return [_patch_embed(family), *_liger(model_config, family)]
