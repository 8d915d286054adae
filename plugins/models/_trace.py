"""The Qwen vision towers traced for vlft's memory plan (``ModelFamily.trace_vision``).

Runs every vision block (and the mergers) once on the meta device, as the tower's own forward does:
Qwen2.5-VL with its window attention (full attention on ``fullatt_block_indexes``), Qwen2-VL, Qwen3-VL and
Qwen3.5 with full attention per image, Qwen3-VL's deepstack mergers after their blocks. Moved here from
vlft/planning/trace.py unchanged for Qwen2.5-VL.

Imports inside functions: torch and transformers load only when a memory plan traces a tower, not when the
family is registered.
"""

from __future__ import annotations


def _seqlens(tower, grid):
    """(full-attention, window-attention or None) cumulative sequence lengths for ``grid``."""
    import torch

    per_image = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    cu = torch.nn.functional.pad(per_image.cumsum(0, dtype=torch.int32), (1, 0))
    if not hasattr(tower, "fullatt_block_indexes"):
        return cu, None
    try:  # transformers >= 5.2x: a shared helper
        from transformers.vision_utils import get_vision_window_index

        _, cu_window = get_vision_window_index(
            grid,
            spatial_merge_size=tower.spatial_merge_size,
            window_size=tower.window_size,
            patch_size=tower.patch_size,
        )
    except ImportError:  # earlier 5.x: a method of the tower
        _, cu_window = tower.get_window_index(grid)
    cu_window = torch.unique_consecutive(torch.as_tensor(cu_window, dtype=torch.int32))
    return cu, cu_window


def trace_qwen_vision(tower, grids, dtype, run_block):
    """Image features of the traced tower; ``run_block(module, fn, block_input=None)`` wraps each block
    (with its input) and merger."""
    import torch

    grid = torch.tensor(grids)
    patches = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    cu, cu_window = _seqlens(tower, grid)
    # the blocks' width: Qwen2-VL calls it embed_dim (its hidden_size is the merger's output, the text width)
    width = getattr(tower.config, "embed_dim", None) or tower.config.hidden_size
    hidden = torch.empty(patches, width, device="meta", dtype=dtype)
    pos = torch.zeros(patches, 2, dtype=torch.long, device="meta")
    pe = tower.rotary_pos_emb(hidden, pos)
    full = set(getattr(tower, "fullatt_block_indexes", range(len(tower.blocks))))
    deepstack = list(getattr(tower, "deepstack_visual_indexes", []) or [])
    for i, block in enumerate(tower.blocks):
        seqlens = cu if (cu_window is None or i in full) else cu_window
        hidden = run_block(
            block, lambda b=block, h=hidden, s=seqlens: b(h, cu_seqlens=s, position_embeddings=pe), hidden
        )
        if i in deepstack:
            merger = tower.deepstack_merger_list[deepstack.index(i)]
            run_block(merger, lambda m=merger, h=hidden: m(h))
    return run_block(tower.merger, lambda h=hidden: tower.merger(h))
