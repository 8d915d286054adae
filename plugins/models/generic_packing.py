"""Packing for the generic family (generic.py), decided from the checkpoint, never from a list of model types.

A packed row keeps its samples apart where two things hold, both read here:

- at plan time, from the module tree built on the meta device and the processor's probe: the text model's
  forward takes ``position_ids`` (the text row restarting at each sample is what tells the attention where
  samples start); its positions are 1-D (no module with a rope index or rope deltas, no ``mrope_section`` in
  the config: 3-D positions need a family's ``Positions``); its attention goes through transformers' attention
  interface (``_supports_attention_backend``: where vlft's per-sample twin or flash-attention's varlen path
  plugs in); every decoder layer is full attention (``layer_types``: a convolution, linear-attention or state-
  space layer carries state along the row, a sliding window is not cut per sample); and the processor returns
  no per-token input the model may read into its attention mask (``token_type_ids``: the packed row is
  attended causally sample by sample). The first that fails is the refusal, with the reason;
- before step 1, on the loaded model (``probe``): two short token runs through the text model, packed in one
  row and each alone; their hidden states must agree to the dtype's rounding, or the run stops with the numbers.

Imports inside functions: torch loads only when a checkpoint is read or a run probes.
"""

from __future__ import annotations

import inspect
from functools import partial

from vlft import Packing

FULL_ATTENTION = "full_attention"
PROBE_RUNS = (7, 5)  # token counts of the probe's two runs: short, unequal, not multiples of 8
MASK_INPUTS = ("token_type_ids", "mm_token_type_ids")  # per-token inputs a model may turn into attention masks
# the probe's bound on |packed - alone| against the largest activation: two float32 forwards of other row
# lengths differ by a few ulps (1e-7), 16-bit ones by their 8/11-bit mantissas; a run attending across the
# boundary moves it by O(1), LFM2's short convolution carrying state across it by 3e-4 on a random tiny model
PROBE_RTOL = {"float64": 1e-9, "float32": 1e-5}
PROBE_RTOL_16 = 3e-2


def packing(model, decoder_layers: str, joins: dict) -> Packing:
    """The generic family's packing: refused with the first reason the checkpoint gives, else allowed with the
    start-up probe on the text model that holds ``decoder_layers``."""
    text_path = decoder_layers.rsplit(".", 1)[0]
    refusal = _refusal(model, model.get_submodule(text_path), joins)
    return Packing(refusal=refusal) if refusal else Packing(probe=partial(probe, text_path))


def _refusal(model, text, joins: dict) -> str:
    if "position_ids" not in inspect.signature(text.forward).parameters:
        return f"its text model ({type(text).__name__}) takes no position_ids, where packed samples' bounds are read"
    three_d = _three_d_positions(model)
    if three_d:
        return f"its positions are not 1-D ({three_d}); a family plugin can declare them (vlft.Positions)"
    if not getattr(type(text), "_supports_attention_backend", False):
        return (
            f"its text model ({type(text).__name__}) does not run its attention through transformers' attention "
            "interface, where vlft's per-sample attention (or flash-attention's varlen path) plugs in"
        )
    layers = _layer_types(getattr(text, "config", None) or model.config.get_text_config())
    if layers:
        return layers
    masks = [k for k, how in joins.items() if how == "sequence" and k in MASK_INPUTS]
    if masks:
        return (
            f"its processor returns {', '.join(masks)} per token, which the model reads into its attention mask; "
            "a packed row is attended causally sample by sample"
        )
    return ""


def _three_d_positions(model) -> str:
    """Where the checkpoint shows positions of more than one row: a rope index, rope deltas, mRoPE sections."""
    for module in model.modules():
        for attr in ("get_rope_index", "compute_3d_position_ids"):
            if hasattr(module, attr):
                return f"{type(module).__name__}.{attr}"
        if "rope_deltas" in vars(module):
            return f"{type(module).__name__} keeps rope_deltas"
    found = _config_keys(model.config.to_dict(), ("mrope_section", "mrope_interleaved"))
    return f"{found} in its config" if found else ""


def _config_keys(tree, keys: tuple[str, ...]) -> str:
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k in keys and v:
                return k
            found = _config_keys(v, keys)
            if found:
                return found
    return ""


def _layer_types(config) -> str:
    """Why the decoder layers cannot pack, or '': a layer other than full attention, or a sliding window."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        other = sorted({str(t) for t in types} - {FULL_ATTENTION})
        if other:
            return (
                f"its decoder layers include {', '.join(other)} (layer_types): a layer other than full attention "
                "carries state along the row, or attends a window the per-sample attention does not cut"
            )
        return ""
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(config, "use_sliding_window", True) is not False:
        return f"its text attention has a sliding window ({window} tokens) the per-sample attention does not cut"
    return ""


def probe(text_path: str, model) -> str:
    """Two token runs through the loaded text model (its attention, dtype and device as the run loaded them),
    packed in one row (the positions restarting) and each alone: '' where their hidden states agree to
    ``PROBE_RTOL``, else the numbers. Called in eval mode without gradients (``Packing.probe``)."""
    import torch

    text = model.get_submodule(text_path)
    weight = text.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(0)
    runs = [torch.randint(0, weight.shape[0], (n,), generator=generator) for n in PROBE_RUNS]

    def hidden(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = text(
            input_ids=ids[None].to(weight.device), position_ids=positions[None].to(weight.device), use_cache=False
        )
        return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0].double()

    try:
        alone = torch.cat([hidden(r, torch.arange(len(r))) for r in runs])
        packed = hidden(torch.cat(runs), torch.cat([torch.arange(len(r)) for r in runs]))
    except Exception as e:  # noqa: BLE001 - a text model that cannot take a packed row is this answer
        return f"a forward of token ids and position_ids alone fails in its text model ({type(e).__name__}: {e})"
    diff, scale = float((packed - alone).abs().max()), float(alone.abs().max())
    rtol = PROBE_RTOL.get(str(weight.dtype).removeprefix("torch."), PROBE_RTOL_16)
    if not diff <= rtol * scale:
        lengths = " and ".join(map(str, PROBE_RUNS))
        return (
            f"two token runs ({lengths} tokens) packed in one row give hidden states {diff:.3g} away from the runs "
            f"alone (largest {scale:.3g}, bound {rtol:g} of it)"
        )
    return ""
