"""Rows that share their records' images: the model's inputs for a batch whose rows come in groups over the
same records (a preference batch: the chosen rows, then the rejected rows), with the images given once.

Where the model takes precomputed vision features (transformers 5's ``mm_encoder_outputs``), the vision
tower runs once per record and its features are repeated for every group of rows: one vision pass feeds the
chosen and the rejected sequence. Otherwise the images themselves are repeated (processed once on the host,
encoded once per row on the device). A vision output holding more than per-image features (anything the
repetition below does not know) takes the second way, so no feature is dropped.
"""

from __future__ import annotations

import inspect

import torch

from vlft.contracts.objective import SHARED
from vlft.data.batching import HOST_KEYS, LOSS_KEYS
from vlft.models.families import base_model

# fields of a vision output the language model does not read (the tower's unmerged states)
UNREAD = ("last_hidden_state", "hidden_states", "attentions")


def unwrapped(model):
    """The model inside a DistributedDataParallel wrapper, or the model itself."""
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model


def takes_vision_features(model) -> bool:
    """The model's forward accepts precomputed vision features (``mm_encoder_outputs``)."""
    return "mm_encoder_outputs" in inspect.signature(base_model(unwrapped(model)).forward).parameters


def row_inputs(model, batch: dict, groups: int, share_features: bool = True) -> dict:
    """The model's keyword arguments for ``batch`` (on the device): its rows, and its ``shared`` inputs (the
    records' images, given once) for ``groups`` groups of rows. ``share_features``: run the vision tower once
    and repeat its features, where the model takes them (see the module docstring)."""
    inputs = {k: v for k, v in batch.items() if k not in (SHARED, *LOSS_KEYS, *HOST_KEYS)}
    shared = dict(batch.get(SHARED) or {})
    features = _features(model, shared, groups) if share_features and shared and takes_vision_features(model) else None
    if features is not None:
        for key, _ in features.values():
            shared.pop(key)
        inputs["mm_encoder_outputs"] = {m: output for m, (_, output) in features.items()}
    return {**inputs, **{k: torch.cat([v] * groups) for k, v in shared.items()}, "use_cache": False}


def _features(model, shared: dict, groups: int) -> dict | None:
    """{modality: (its pixels' input name, its vision output, repeated for ``groups`` groups of rows)}, or None
    where an output holds what the repetition does not know. A modality's pixels are the first argument of the
    model's ``get_<modality>_features`` (pixel_values, or the video pixels): the model says, no name is guessed."""
    base = base_model(unwrapped(model))
    out = {}
    for modality in ("image", "video"):
        method = getattr(base, f"get_{modality}_features", None)
        accepted = inspect.signature(method).parameters if method is not None else {}
        key = next(iter(accepted), None)
        if method is None or key is None or key not in shared:
            continue
        output = method(**{k: v for k, v in shared.items() if k in accepted}, return_dict=True)
        repeated = _repeated(output, groups)
        if repeated is None:
            return None
        out[modality] = (key, repeated)
    return out or None


def _repeated(output, groups: int):
    """``output`` with each per-item tuple (the features of each image) repeated ``groups`` times, and each list
    of such tuples (features per layer) likewise; None where a field is neither (nor one the model skips)."""
    for key in list(output.keys()):
        value = output[key]
        if isinstance(value, tuple) and all(torch.is_tensor(v) for v in value):
            output[key] = value * groups
        elif isinstance(value, list) and all(isinstance(v, tuple) for v in value):
            output[key] = [v * groups for v in value]
        elif key in UNREAD:
            output[key] = None
        else:
            return None
    return output
