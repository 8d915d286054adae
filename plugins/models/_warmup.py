"""The smallest input a Qwen vision tower takes, for ``ModelFamily.vision_dummy``: the core runs it on every
process at every step (one process too), so a text-only batch still uses the tower's parameters
(``vlft.models.vision``).

Imports inside functions: torch loads only when a run builds the dummy input, not when the family is
registered.
"""

from __future__ import annotations

from vlft import VisionWarmup


def _inner(model):
    """The transformers module that embeds the tokens and runs the towers (e.g. Qwen2_5_VLModel), under PEFT/DDP."""
    found = None
    for module in model.modules():
        if (
            hasattr(module, "get_image_features")
            and hasattr(module, "visual")
            and hasattr(module, "get_input_embeddings")
        ):
            found = module  # the innermost such module (the ForConditionalGeneration delegates to it)
    return found


def qwen_vision_dummy(model, modality: str) -> VisionWarmup | None:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5: the smallest input the vision tower takes, one frame of one merged patch
    (``spatial_merge_size`` x ``spatial_merge_size`` patches of zeros); images and videos share the tower.
    None for a model without a vision tower of this kind."""
    inner = _inner(model)
    if inner is None:
        return None
    import torch

    vc = inner.visual.config
    merge = int(vc.spatial_merge_size)
    dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    pixels = torch.zeros(merge * merge, dim)
    grid = torch.tensor([[1, merge, merge]])
    if modality == "image":
        return VisionWarmup(inner, "get_image_features", {"pixel_values": pixels, "image_grid_thw": grid})
    return VisionWarmup(inner, "get_video_features", {"pixel_values_videos": pixels, "video_grid_thw": grid})
