"""The vision tower on every process at every step: a dummy image (or video) whose output counts 0.

Under DDP or FSDP every process must run the same parameters, and under FSDP gather the same blocks in the
same order, at every step. A micro-batch without an image (text-only records beside image records) would skip
the vision tower on that process only: DDP then finds parameters that were not used in producing the loss,
FSDP's collectives no longer match (gloo: "Received data size doesn't match expected size"; NCCL and HCCL:
a hang). So a training forward without the pixels of a modality the run uses feeds a tiny dummy through the
tower and adds its output times 0 to the input embeddings: the same parameters get (zero) gradients and the
loss is unchanged (``x + 0.0 == x``).

The one family-specific piece is ``vision_warmup_inputs``: where the tower is and what a dummy input for it
looks like (Qwen2-VL / Qwen2.5-VL here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the model's forward arguments that carry each modality's pixels
PIXEL_KEYS = {"image": "pixel_values", "video": "pixel_values_videos"}


@dataclass
class VisionWarmup:
    """How to run one modality's tower on a dummy input: the module holding ``get_image_features`` /
    ``get_video_features`` and that method's keyword arguments (on the host, moved per call)."""

    module: torch.nn.Module
    method: str
    inputs: dict


def _inner(model) -> torch.nn.Module | None:
    """The transformers module that embeds the tokens and runs the towers (Qwen2_5_VLModel), under PEFT/DDP."""
    found = None
    for module in model.modules():
        if hasattr(module, "get_image_features") and hasattr(module, "get_input_embeddings") and \
                getattr(getattr(module, "config", None), "vision_config", None) is not None:
            found = module  # the innermost such module (the ForConditionalGeneration delegates to it)
    return found


def vision_warmup_inputs(model, modality: str) -> VisionWarmup | None:
    """Qwen2-VL / Qwen2.5-VL: the smallest input the vision tower takes, one frame of one merged patch
    (``spatial_merge_size`` x ``spatial_merge_size`` patches of zeros); images and videos share the tower.
    None for a model without a vision tower of this kind."""
    inner = _inner(model)
    if inner is None:
        return None
    vc = inner.config.vision_config
    merge = int(vc.spatial_merge_size)
    dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    pixels = torch.zeros(merge * merge, dim)
    grid = torch.tensor([[1, merge, merge]])
    if modality == "image":
        return VisionWarmup(inner, "get_image_features", {"pixel_values": pixels, "image_grid_thw": grid})
    return VisionWarmup(inner, "get_video_features", {"pixel_values_videos": pixels, "video_grid_thw": grid})


def _tensor_sum(out) -> torch.Tensor:
    """The sum of every floating tensor in a tower's output (an output object, tuple, list or tensor)."""
    if torch.is_tensor(out):
        return out.float().sum() if out.is_floating_point() else torch.zeros((), device=out.device)
    if isinstance(out, dict):
        values = list(out.values())
    elif isinstance(out, (list, tuple)):
        values = list(out)
    else:
        return torch.zeros(())
    sums = [_tensor_sum(v).reshape(()).to(torch.float32) for v in values if v is not None]
    sums = [x.to(sums[0].device) for x in sums]
    return torch.stack(sums).sum() if sums else torch.zeros(())


def install_vision_warmup(model, modalities: set[str]) -> list:
    """Make every training forward of ``model`` run the vision tower for each of ``modalities`` (those the
    run's data holds): a forward without that modality's pixels gets a dummy through the tower, its output
    times 0 added to the input embeddings. Returns the hook handles (empty where the model has no such
    tower). Only training forwards (``module.training`` and gradients on): evaluation is left as it is."""
    warmups = {m: w for m in sorted(modalities) if (w := vision_warmup_inputs(model, m)) is not None}
    if not warmups:
        return []
    inner = next(iter(warmups.values())).module

    def pre_forward(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("inputs_embeds") is not None:
            return None
        if kwargs.get("mm_encoder_outputs"):
            return None
        missing = [w for m, w in warmups.items() if kwargs.get(PIXEL_KEYS[m]) is None]
        if not missing:
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            return None
        embeds = module.get_input_embeddings()(input_ids)
        for w in missing:
            dummy = {k: v.to(input_ids.device) for k, v in w.inputs.items()}
            out = getattr(module, w.method)(**dummy)
            embeds = embeds + (_tensor_sum(out) * 0).to(embeds.dtype)  # exactly 0: the loss is unchanged
        kwargs = {**kwargs, "inputs_embeds": embeds}
        if args:
            args = ()
        kwargs.setdefault("input_ids", input_ids)
        return args, kwargs

    return [inner.register_forward_pre_hook(pre_forward, with_kwargs=True)]
