"""The vision tower at every training step: a dummy image (or video) whose output counts 0.

Under DDP or FSDP every process must run the same parameters, and under FSDP gather the same blocks in the
same order, at every step. A micro-batch without an image (text-only records beside image records) would skip
the vision tower on that process only: DDP then finds parameters that were not used in producing the loss,
FSDP's collectives no longer match (gloo: "Received data size doesn't match expected size"; NCCL and HCCL:
a hang). So a training forward without the pixels of a modality the run uses feeds a tiny dummy through the
tower, and its output times 0 is added to the input embeddings: the same parameters get (zero) gradients,
in the same order as real pixels give them, and the loss is unchanged (``x + 0.0 == x``). The model's inputs
are left as they are (no ``inputs_embeds`` in place of ``input_ids``, which Qwen3-VL refuses beside them and
would read stale rope deltas without them).

One process does the same: a text-only step then gives the vision adapters zero gradients (AdamW moves them
by its momentum) rather than none (AdamW would skip them), so 1 process and N train alike on mixed data.

The one family-specific piece is the family's ``vision_dummy``: where the tower is and what the smallest
input it takes looks like (``ModelFamily.vision_dummy``, answered by the model-family plugin).
"""

from __future__ import annotations

import torch


def pixel_keys(family) -> dict[str, str]:
    """The model's forward argument that carries each modality's pixels, as the family declares it
    (``ImageInputs.pixels``, ``VideoInputs.pixels``)."""
    out = {}
    if family.image_inputs is not None:
        out["image"] = family.image_inputs.pixels
    if family.video_inputs is not None:
        out["video"] = family.video_inputs.pixels
    return out


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


def _plus(out, zero: torch.Tensor):
    """``out`` (an output object, tuple or tensor) with ``zero`` added to its first floating tensor."""
    if torch.is_tensor(out):
        return out + zero.to(out.dtype) if out.is_floating_point() else out
    if isinstance(out, dict):  # transformers' ModelOutput: setting a key sets the attribute too
        for key, value in out.items():
            if torch.is_tensor(value) and value.is_floating_point():
                out[key] = value + zero.to(value.dtype)
                return out
        return out
    if isinstance(out, tuple) and out:
        return (_plus(out[0], zero), *out[1:])
    return out


def _prefill(kwargs: dict) -> bool:
    """A forward that is not a decoding step: no cache, or an empty one."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0


def _warmups(model, modalities: set[str], family) -> dict:
    """The warm-up of each pixels input the run's modalities use, by input name. A family whose processor folds a
    clip's frames into the image input (SmolVLM2, InternVL: ``VideoInputs.pixels`` is ``ImageInputs.pixels``)
    runs one warm-up for both, the image one: a process whose batch has only a clip has those pixels, and one
    whose batch has only text must still run the tower when the data holds clips and no image."""
    keys = pixel_keys(family)
    out = {}
    for modality in sorted(modalities):
        if modality not in keys or keys[modality] in out:
            continue
        source = "image" if keys[modality] == keys.get("image") else modality
        warmup = family.vision_dummy(model, source)
        if warmup is not None:
            out[keys[modality]] = warmup
    return out


def install_vision_warmup(model, modalities: set[str], family, sharded: bool = False) -> list:
    """Make every training forward of ``model`` run the vision tower for each of ``modalities`` (those the
    run's data holds): a forward without that modality's pixels gets a dummy through the tower, its output
    times 0 added to the input embeddings. Returns the hook handles (empty where the model has no such
    tower). Training forwards (``module.training`` and gradients on); ``sharded`` (FSDP, where every forward
    gathers the blocks it runs), evaluation's too: the validation loss and generation's first pass (a
    process whose share has no image beside one whose share has), not its decoding steps, which run no
    tower on any process."""
    if family is None or family.vision_dummy is None:
        return []
    warmups = _warmups(model, modalities, family)
    if not warmups:
        return []
    inner = next(iter(warmups.values())).module
    pending: list[torch.Tensor] = []  # the zero of the forward under way, added to its output

    def pre_forward(module, args, kwargs):
        pending.clear()
        training = module.training and torch.is_grad_enabled()
        if not (training or (sharded and _prefill(kwargs))) or kwargs.get("mm_encoder_outputs"):
            return None
        missing = [w for key, w in warmups.items() if kwargs.get(key) is None]
        if not missing:
            return None
        device = next(module.parameters()).device
        zero = torch.zeros((), device=device)
        for w in missing:
            dummy = {k: v.to(device) for k, v in w.inputs.items()}
            zero = zero + (_tensor_sum(getattr(module, w.method)(**dummy)) * 0).to(device)  # exactly 0
        pending.append(zero)
        return None

    def on_embeddings(module, args, out):
        return _plus(out, pending.pop()) if pending else None

    def post_forward(module, args, kwargs, out):
        # the embeddings did not run (the caller passed inputs_embeds): the zero joins the output instead
        return _plus(out, pending.pop()) if pending else None

    # added to the input embeddings, the zero makes the decoder depend on the tower as real pixels do, so
    # backward reaches the tower after the decoder on every process, in the same order (FSDP's reductions
    # must match: added to the output instead, a process without images reduced the tower's gradients early)
    return [
        inner.register_forward_pre_hook(pre_forward, with_kwargs=True),
        inner.get_input_embeddings().register_forward_hook(on_embeddings),
        inner.register_forward_hook(post_forward, with_kwargs=True),
    ]
