"""Packed rows attended sample by sample: the ``segments`` packing path for sdpa and eager text attention.

transformers keeps packed samples apart on sdpa and eager with one block-diagonal causal mask over the whole
row, so attention costs the square of the row (four samples of 500 tokens: 16x the work of one sample, 4x the
work of padding them). Here the row is cut where its text position row restarts (the same boundaries
transformers reads for flash-attention's cu_seqlens) and each sample attends causally to itself alone, through
the underlying implementation (transformers' ``sdpa_attention_forward``, or the model's own
``eager_attention_forward`` with a causal mask of the sample's size): the cost is the samples' squares, as
padding pays without padding's waste.

Two names are registered with transformers' attention interface, ``vlft_segments_sdpa`` and
``vlft_segments_eager``, with mask functions of the same names. A batch with an ``attention_mask`` (padded
validation, generation with its cache) is handed to the underlying implementation unchanged, mask included,
so the model computes exactly what it computes under ``sdpa``/``eager``; a batch without one (a packed row)
builds no mask at all and is attended per segment.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

PREFIX = "vlft_segments_"
UNDERLYING = ("sdpa", "eager")


def segments_name(text_attention: str) -> str:
    """The registered implementation that runs ``text_attention`` ("sdpa", "eager") per packed sample."""
    if text_attention not in UNDERLYING:
        raise ValueError(f"packed segments run on {' or '.join(UNDERLYING)}, not {text_attention!r}")
    return PREFIX + text_attention


def with_segments(attention, packing):
    """The attention policy a model is loaded with: the text tower's implementation swapped for its
    per-segment twin where the run packs on the segments path; ``attention`` itself otherwise."""
    if packing is None or not packing.enabled or packing.path != "segments":
        return attention
    return replace(attention, text=segments_name(attention.text))


class _Bounds:
    """The samples of the last position tensor seen: every attention layer of one forward gets the same
    tensor, so the boundaries (a host read) are found once per forward, not once per layer."""

    def __init__(self):
        self.positions: torch.Tensor | None = None
        self.rows: list[list[tuple[int, int]]] = []
        self.masks: dict = {}

    def of(self, positions: torch.Tensor) -> list[list[tuple[int, int]]]:
        if positions is not self.positions:
            self.positions, self.rows, self.masks = positions, sample_bounds(positions), {}
        return self.rows

    def causal(self, length: int, dtype: torch.dtype, device) -> torch.Tensor:
        """eager's additive causal mask for one sample of ``length`` tokens, built once per forward."""
        key = (length, dtype, device)
        if key not in self.masks:
            full = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=device)
            self.masks[key] = torch.triu(full, diagonal=1)[None, None]
        return self.masks[key]


_BOUNDS = _Bounds()


def sample_bounds(positions: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, end)`` of each sample: a sample starts wherever the text position does not
    follow its predecessor by one (as ``masking_utils.find_packed_sequence_indices`` reads it)."""
    rows, length = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    starts = starts.nonzero().tolist()  # one host read for the whole batch
    bounds: list[list[int]] = [[] for _ in range(rows)]
    for row, col in starts:
        bounds[row].append(col)
    return [[(s, e) for s, e in zip(b, b[1:] + [length])] for b in bounds]


def eager_attention(module):
    """The model's own eager attention (each transformers model module defines ``eager_attention_forward``)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def _underlying(name: str, module):
    return sdpa_attention_forward if name == "sdpa" else eager_attention(module)


def _attention(name: str):
    def attend(module, query, key, value, attention_mask, position_ids=None, **kwargs):
        run = _underlying(name, module)
        if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
            return run(module, query, key, value, attention_mask, **kwargs)
        if position_ids.dim() == 3:  # [4, B, L]: the text row first
            position_ids = position_ids[0]
        kwargs.pop("is_causal", None)
        rows = []
        for b, samples in enumerate(_BOUNDS.of(position_ids)):
            parts = []
            for s, e in samples:
                q, k, v = query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e]
                if name == "sdpa":
                    out, _ = run(module, q, k, v, None, is_causal=True, **kwargs)
                else:
                    out, _ = run(module, q, k, v, _BOUNDS.causal(e - s, query.dtype, query.device), **kwargs)
                parts.append(out)
            rows.append(torch.cat(parts, dim=1))
        return torch.cat(rows, dim=0), None

    attend.__name__ = f"{PREFIX}{name}_attention"
    return attend


def _mask(name: str):
    underlying = AttentionMaskInterface._global_mapping[name]

    def mask(*args, attention_mask=None, **kwargs):
        # no padding mask: a packed row, attended per segment (no [L, L] mask is built); otherwise the
        # underlying mask, so padded batches and generation compute as under the plain implementation
        if attention_mask is None:
            return None
        return underlying(*args, attention_mask=attention_mask, **kwargs)

    return mask


def register() -> None:
    """Make the ``vlft_segments_*`` names known to transformers (idempotent; every process that loads a model)."""
    for name in UNDERLYING:
        AttentionInterface.register(PREFIX + name, _attention(name))
        ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX + name, _mask(name))


register()
