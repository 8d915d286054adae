"""The generic family: read from a checkpoint whose ``model_type`` no family plugin owns, where transformers maps
it to ``AutoModelForImageTextToText`` (``vlft_family_readers``).

What a built-in family declares by hand is read from the checkpoint instead:

- the module tree, built on the meta device from the config (no weights read): the text model (a module named
  ``language_model`` or ``text_model``) and its decoder layers (its longest ModuleList), the vision tower
  (``vision_tower``, ``visual``, ``vision_model``, ...) and its blocks (its longest ModuleList), the projector
  (``multi_modal_projector``, ``mm_projector``, ``connector``, ...; ``--train-merger`` trains it), the head;
- the targets: every nn.Linear of a decoder layer under an attention module (a step of its path holding
  "attn" or "attention") or an MLP ("mlp", "feed_forward", "ffn"), likewise in the vision blocks; fused or
  listed experts and routers are left out (a MoE checkpoint trains its attention and shared MLP only);
- the processor (``AutoProcessor``; the tokenizer's chat template where the processor has none): its image
  placeholder (``processor.image_token``), which the processor expands itself (tiles, row breaks, boundaries:
  they all lie in the prompt pieces, out of the loss), the model inputs it returns for an image (each kept:
  per-token ones laid end to end, pixel tensors padded to the batch's largest, the rest joined; each token's
  modality, ``mm_token_type_ids``, asked for where the model's forward reads it), and, from a
  probe conversation, the token that closes an assistant reply and whether the template marks replies with
  ``{% generation %}``.

Labels: the core trains the spans the template marks with ``{% generation %}``, else renders each turn's prefix
with the checkpoint's template and trains the assistant pieces; this family then checks every sample token for
token: the pieces' ids laid end to end must equal the ids of the whole render through the processor, or the
sample is refused (a template whose turn boundary splits a token would otherwise train the wrong positions).

Video, where the processor has a video processor and ``video_token`` and the model a video path (its
``get_video_features``, or the image input the processor folds the frames into, as InternVL's does): a probe clip
gives the inputs a batch joins; clips go through the processor as the frames vlft sampled (``vlft.clip_arguments``),
labels and the warm-up as for images. Otherwise video records are refused, and the description says why.

Packing (generic_packing.py): decided from the checkpoint (the text model takes ``position_ids``, 1-D positions,
attention through transformers' attention interface, full-attention layers only, no per-token mask input), refused
with the first reason otherwise; before step 1 a probe on the loaded text model compares two token runs packed
and alone. ``--max-pixels``, the memory plan's vision count and its trace (generic_vision.py): a processor that
gives a 64x64 and a 512x512 image the same image tokens resizes to a fixed size, and the cap changes nothing (the
description says so); one whose count grows keeps the image's size, and each image is scaled down to the budget
before it; the plan counts each image's tokens from the processor and traces the tower's forward on the meta
device where it runs there ("untraced" with the reason otherwise).

A checkpoint it cannot read is refused with a ConfigError naming what it could not find.

Imports inside functions: torch and transformers load only when a checkpoint is read.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import replace
from typing import Any

from vlft import Chat, FamilyReader, ModelFamily, Targets, Towers, VideoInputs, widened

from . import generic_packing, generic_vision

NAME = "generic"
TEXT_NAMES = ("language_model", "text_model")
VISION_NAMES = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder", "image_tower", "vision")
PROJECTOR_NAMES = (
    "multi_modal_projector",
    "mm_projector",
    "connector",
    "projector",
    "vision_projector",
    "merger",
    "mlp1",
    "visual_projection",
)
BLOCK_LISTS = ("layers", "layer", "blocks", "h")
ATTENTION_STEPS = ("attn", "attention")
MLP_STEPS = ("mlp", "feed_forward", "ffn")
PROBE_SIZE = (64, 64)  # the blank image of the probe conversation and of the vision warm-up
# a second probe image, large and wide: inputs a processor returns only for some images (local crops of a large or
# elongated one, as Step-3.7's) are kept too
WIDE_PROBE_SIZE = (1024, 256)
PROBE_REPLY = "probe reply"
GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")

_READ: dict[tuple, ModelFamily] = {}  # (folder, model_type) -> its family: read once per process


def _refuse(model_type: str, what: str):
    from vlft import ConfigError

    return ConfigError(f"the {NAME} family cannot read this '{model_type}' checkpoint: {what}")


# --- the module tree --------------------------------------------------------------------------------------------


def _meta_model(model_config):
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(model_config)


def _named(modules: dict, names: tuple[str, ...], outside: str = "") -> str:
    """The shortest module path whose last step is one of ``names`` (earlier names first), not under ``outside``."""
    for name in names:
        found = [
            p
            for p in modules
            if p.rsplit(".", 1)[-1] == name and not (outside and (p == outside or p.startswith(outside + ".")))
        ]
        if found:
            return min(found, key=lambda p: (p.count("."), len(p)))
    return ""


def _longest_list(modules: dict, under: str) -> str:
    """The ModuleList of blocks under ``under``: the longest one named like a block list (the shallowest on ties)."""
    import torch

    lists = [
        (len(m), -p.count("."), p)
        for p, m in modules.items()
        if p.startswith(under + ".")
        and isinstance(m, torch.nn.ModuleList)
        and len(m)
        and p.rsplit(".", 1)[-1] in BLOCK_LISTS
    ]
    return max(lists)[2] if lists else ""


def _linear_names(blocks) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(attention, MLP) nn.Linear paths relative to a block, over every block (hybrid layers differ); experts
    and routers left out."""
    import torch

    attention: list[str] = []
    mlp: list[str] = []
    for block in blocks:
        for rel, m in block.named_modules():
            if not isinstance(m, torch.nn.Linear) or "expert" in rel or rel.endswith((".gate", "router")):
                continue
            steps = rel.split(".")[:-1]
            if any(s in step for step in steps for s in ATTENTION_STEPS):
                attention.append(rel)
            elif any(s in step for step in steps for s in MLP_STEPS):
                mlp.append(rel)
    return tuple(dict.fromkeys(attention)), tuple(dict.fromkeys(mlp))


def _towers(model, model_type: str) -> tuple[Towers, Targets, dict]:
    """Towers and targets from the module tree, and what was found (for the description)."""
    modules = dict(model.named_modules())
    text = _named(modules, TEXT_NAMES)
    if not text:
        raise _refuse(model_type, f"no text model (a module named {' or '.join(TEXT_NAMES)}) in {_top(model)}")
    layers = _longest_list(modules, text)
    if not layers:
        raise _refuse(model_type, f"no decoder layers (a ModuleList named {'/'.join(BLOCK_LISTS)}) under {text}")
    vision = _named(modules, VISION_NAMES, outside=text)
    if not vision:
        raise _refuse(model_type, f"no vision tower (a module named {', '.join(VISION_NAMES)}) in {_top(model)}")
    blocks = _longest_list(modules, vision)
    if not blocks:
        raise _refuse(model_type, f"no vision blocks (a ModuleList named {'/'.join(BLOCK_LISTS)}) under {vision}")
    head = _named(modules, ("lm_head",))  # the top one, else the text model's own (a wrapped causal LM)
    if not head:
        raise _refuse(model_type, f"no output head 'lm_head' in {_top(model)}")
    projector = _named(modules, PROJECTOR_NAMES, outside=text)
    text_attention, text_mlp = _linear_names(modules[layers])
    if not text_attention:
        raise _refuse(model_type, f"no attention nn.Linear modules in the decoder layers {layers}")
    vision_attention, vision_mlp = _linear_names(modules[blocks])
    towers = Towers(
        vision=vision,
        vision_blocks=blocks,
        vision_mergers=(projector,) if projector else (),
        decoder_layers=layers,
        lm_head=head,
    )
    targets = Targets(
        vision_attention=vision_attention,
        vision_mlp=vision_mlp,
        text_attention=text_attention,
        text_mlp=text_mlp,
        default="both",
    )
    found = {
        "vision": f"{vision} ({len(modules[blocks])} blocks in {blocks})",
        "projector": projector or "none found (--train-merger has none to train)",
        "text": f"{layers} ({len(modules[layers])} layers)",
        "targets": f"text {', '.join(text_attention + text_mlp)}; vision {', '.join(vision_attention + vision_mlp)}",
    }
    return towers, targets, found


def _top(model) -> str:
    return f"{type(model).__name__} (top modules: {', '.join(n for n, _ in model.named_children())})"


# --- the processor ----------------------------------------------------------------------------------------------


def load_processor(path: str, token_types: bool = False):
    """AutoProcessor, given the tokenizer's chat template where the processor itself has none (older
    checkpoints keep it in tokenizer_config.json only); with ``token_types``, asked for each token's modality
    (``mm_token_type_ids``: a model whose forward takes them computes its 3-D rope from them, and processors
    that do not default to returning them return them only when asked)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    template = getattr(getattr(processor, "tokenizer", None), "chat_template", None)
    if getattr(processor, "chat_template", None) is None and template:
        processor.chat_template = template
    if token_types and hasattr(processor, "return_mm_token_type_ids"):
        processor.return_mm_token_type_ids = True
    return processor


def _takes_token_types(model) -> bool:
    """Whether the model's forward reads each token's modality (``mm_token_type_ids``)."""
    return "mm_token_type_ids" in inspect.signature(model.forward).parameters


def _probe_messages(reply: bool) -> list[dict]:
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the product."}]}
    assistant = {"role": "assistant", "content": [{"type": "text", "text": PROBE_REPLY}]}
    return [user, assistant] if reply else [user]


def _reply_end(processor, full: str) -> str:
    """The first special token the template writes after a reply (the probe's): where a reply ends."""
    tokenizer = processor.tokenizer
    at = full.rfind(PROBE_REPLY)
    after = full[at + len(PROBE_REPLY) :] if at >= 0 else ""
    specials = {str(t) for t in tokenizer.all_special_tokens} | {
        str(t.content) for t in tokenizer.added_tokens_decoder.values() if t.special
    }
    hits = [(after.find(t), -len(t), t) for t in specials if t and t in after]
    return min(hits)[2] if hits else ""


def _join(value, length: int, two=None) -> str:
    """How a batch joins one processor output: per token, padded pixels, joined as it is, or along its last dim
    (``two``, the output for two images, still one row whose last dim grew: NaViT-packed patches)."""
    if value.dim() == 2 and value.shape[0] == 1 and value.shape[1] == length:
        return "sequence"
    if two is not None and value.dim() >= 3 and value.shape[0] == two.shape[0] == 1 and two.shape[-1] > value.shape[-1]:
        return "concat_last"
    # 2-D too: a per-image row whose width differs by image (tiles per image) pads like the pixels
    return "concat_padded" if value.dim() >= 2 else "concat"


def _two_image_probe(processor, prompt: str) -> dict:
    """The probe twice over, with two images: it tells the inputs that hold every image in one row (their first dim
    stays 1) from those that stack; empty where the processor takes one image per conversation only."""
    from PIL import Image

    image = Image.new("RGB", PROBE_SIZE)
    try:
        return processor(text=[prompt + prompt], images=[[image, image]], return_tensors="pt")
    except Exception:  # noqa: BLE001 - one image per conversation only: the one-image shapes decide
        return {}


def _read_processor(path: str, model_type: str, load=load_processor) -> tuple[Any, dict, dict]:
    """The processor's conventions from a probe conversation (one blank image, one reply; the prompt again with
    the wide probe image): (processor, {model input: how a batch joins it}, the image inputs for the vision
    warm-up), and what was found."""
    from PIL import Image

    try:
        processor = load(path)
    except Exception as e:  # noqa: BLE001 - any loader failure is the checkpoint's missing part
        raise _refuse(model_type, f"its processor does not load from {path} ({type(e).__name__}: {e})") from None
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise _refuse(model_type, f"its processor ({type(processor).__name__}) has no tokenizer and image processor")
    token = getattr(processor, "image_token", None)
    if not token:
        raise _refuse(model_type, f"its processor ({type(processor).__name__}) names no image_token")
    template = processor.chat_template
    if not isinstance(template, str) or not template:
        raise _refuse(
            model_type,
            "it has no chat template (chat_template.jinja, or chat_template in processor_config.json or "
            "tokenizer_config.json); add the model's template there",
        )
    try:
        prompt = processor.apply_chat_template(_probe_messages(False), tokenize=False, add_generation_prompt=True)
        full = processor.apply_chat_template(_probe_messages(True), tokenize=False)
        out = processor(text=[prompt], images=[[Image.new("RGB", PROBE_SIZE)]], return_tensors="pt")
    except Exception as e:  # noqa: BLE001 - the template or the processor failing on a plain conversation
        raise _refuse(
            model_type, f"its processor cannot encode a one-image conversation ({type(e).__name__}: {e})"
        ) from None
    if token not in prompt:
        raise _refuse(model_type, f"its chat template writes no image placeholder {token!r} for an image part")
    joins = _joins(out, _two_image_probe(processor, prompt))
    joins.update({k: v for k, v in _wide_probe_joins(processor, prompt).items() if k not in joins})
    pixels = "pixel_values" if "pixel_values" in joins else next((k for k in joins if k.startswith("pixel")), "")
    if not pixels:
        raise _refuse(model_type, f"its processor returns no pixel input for an image (it returns {sorted(out)})")
    end = _reply_end(processor, full)
    extra = [t for t in _image_token_strings(processor) if t != token]
    found = {
        "image token": token + (f" (expanded with {', '.join(extra)})" if extra else ""),
        "template": "{% generation %} markers (their spans train)"
        if GENERATION_MARKER.search(template)
        else "no generation markers (each turn's rendered prefix, checked token for token)",
        "reply end": end or "none after a reply (the reply trains to the next turn)",
        "inputs": ", ".join(f"{k} ({v})" for k, v in joins.items()),
    }
    warmup = {k: widened(v) for k, v in out.items() if joins.get(k, "sequence") != "sequence"}
    conv = {"joins": joins, "pixels": pixels, "end": end, "warmup": warmup, "probe_ids": out["input_ids"]}
    return processor, conv, found


def _joins(out, two=None) -> dict:
    """{model input: how a batch joins it} for one processor output (``two``: the same prompt's output with two
    images, where the processor takes them)."""
    import torch

    length = int(out["input_ids"].shape[-1])
    two = two or {}
    return {
        k: _join(v, length, two.get(k))
        for k, v in out.items()
        if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)
    }


def _wide_probe_joins(processor, prompt: str) -> dict:
    """The joins of the prompt with the wide probe image: the inputs the processor returns for such an image
    only; none where the processor fails on it (the records' own images show what it does with them)."""
    from PIL import Image

    try:
        return _joins(processor(text=[prompt], images=[[Image.new("RGB", WIDE_PROBE_SIZE)]], return_tensors="pt"))
    except Exception:  # noqa: BLE001 - a processor that cannot take this image: only the first probe's inputs
        return {}


def _image_token_strings(processor) -> list[str]:
    ids = getattr(processor, "image_token_ids", None)
    if not isinstance(ids, (list, tuple)):
        return []
    return [str(processor.tokenizer.convert_ids_to_tokens(int(i))) for i in ids if i is not None]


# --- image inputs: the processor writes the image tokens; every sample checked token for token ----------------


def _image_inputs(base):
    """``base`` (generic_vision's: the processor's inputs, the size cap, the vision count) with every sample
    checked token for token against the whole render."""

    def prepare(processor, media, max_pixels=None):
        inner = base.prepare(processor, media, max_pixels)
        return inner, replace(media, images=list(inner[0]))  # the whole render checked on the images as capped

    def write(processor, texts: list[str], prepared):
        inner, media = prepared
        written = base.write(processor, texts, inner)
        _check_whole(processor, texts, media, [i for ids in written.ids for i in ids])
        return written

    return replace(base, prepare=prepare, write=write)


def _check_whole(processor, texts: list[str], media, ids: list[int]) -> None:
    """The pieces' ids laid end to end equal the whole render's, or the sample is refused: the labels follow
    the pieces, so a turn boundary inside a token would train the wrong positions."""
    from PIL import Image

    from vlft import DataError, clip_arguments

    images = media.images if media.images is not None else [Image.new("RGB", s) for s in media.sizes]
    whole = processor(
        text=["".join(texts)], images=[images] if images else None, return_tensors="pt", **clip_arguments(media.videos)
    )
    expected = whole["input_ids"][0].tolist()
    if expected != ids:
        at = next((i for i, (a, b) in enumerate(zip(expected, ids)) if a != b), min(len(expected), len(ids)))
        raise DataError(
            f"{media.where}: the {NAME} family: the conversation's turns tokenized one by one differ from the "
            f"whole render at token {at} ({len(ids)} against {len(expected)} tokens): the chat template's turn "
            "boundaries split a token, so the assistant-only labels would be misplaced"
        )


def vision_dummy(model, modality: str, warmup: dict | None = None, video_warmup: dict | None = None, probe_ids=None):
    """The probe's blank image through the innermost ``get_image_features`` (the inputs it names), so a batch
    without an image runs the tower too; for video the probe's blank clip through ``get_video_features``, where
    the model has one (a model whose processor folds frames into the image input runs the image warm-up)."""
    from vlft import VisionWarmup

    method, inputs = ("get_image_features", warmup) if modality == "image" else ("get_video_features", video_warmup)
    if modality not in ("image", "video") or not inputs:
        return None
    inner = None
    for module in model.modules():
        if hasattr(module, method) and hasattr(module, "get_input_embeddings"):
            inner = module  # the innermost (the ForConditionalGeneration delegates to it)
    if inner is None:
        return None
    names = inspect.signature(getattr(inner, method)).parameters
    inputs = {k: v for k, v in inputs.items() if k in names}
    if modality == "image" and probe_ids is not None:
        _check_features(model, inner, inputs, probe_ids)
    return VisionWarmup(inner, method, inputs)


# --- video: through the processor's video processor, where it has one and the model a video path ---------------


def _read_video(processor, model, image_joins: dict) -> tuple[Any, dict, str]:
    """(VideoInputs or None, {"joins": the clip's model inputs, "warmup": its inputs for the tower warm-up}, what
    was found or why video is refused). A probe clip of two blank frames goes through the checkpoint's template
    and processor: the video path is the model's ``get_video_features``, or the image input where the processor
    folds the frames into it (InternVL's ``pixel_values``); the pixels input must be one the model's forward
    takes."""
    import torch

    from vlft import clip_arguments

    token = getattr(processor, "video_token", None)
    if getattr(processor, "video_processor", None) is None or not token:
        return None, {}, f"none (its processor ({type(processor).__name__}) has no video processor and video_token)"
    user = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe the clip."}]}
    try:
        prompt = processor.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        clip = torch.zeros((2, 3, *PROBE_SIZE), dtype=torch.uint8)
        out = processor(text=[prompt], return_tensors="pt", **clip_arguments([(clip, 2.0)]))
    except Exception as e:  # noqa: BLE001 - the template or the video processor failing on a plain clip
        return None, {}, f"none (its processor cannot encode a one-clip conversation: {type(e).__name__}: {e})"
    if token not in prompt:
        return None, {}, f"none (its chat template writes no video placeholder {token!r} for a video part)"
    joins = _joins(out)
    pixels = "pixel_values_videos" if "pixel_values_videos" in joins else next((k for k in joins if "pixel" in k), "")
    takes = inspect.signature(model.forward).parameters
    if not pixels or pixels not in takes:
        return None, {}, f"none (the model's forward takes no video pixels input; the processor returns {sorted(out)})"
    folded = pixels in image_joins
    if not folded and not any(hasattr(m, "get_video_features") for m in model.modules()):
        return None, {}, f"none (the processor returns {pixels}, but the model has no get_video_features)"
    warmup = {} if folded else {k: widened(v) for k, v in out.items() if joins.get(k, "sequence") != "sequence"}
    how = f"{pixels}, the frames as images" if folded else f"{pixels} through get_video_features"
    found = f"{token} ({type(processor.video_processor).__name__}: {how}; frames sampled by --video-fps/-max-frames)"
    return VideoInputs(pixels=pixels), {"joins": joins, "warmup": warmup}, found


def _feature_rows(out) -> int:
    """Feature rows ``get_image_features`` gave: a tensor, a list of them, or an output whose pooler_output holds
    them (transformers 5); 0 where it cannot be told."""
    import torch

    if not torch.is_tensor(out) and not isinstance(out, (list, tuple)):
        out = getattr(out, "pooler_output", None)
    if torch.is_tensor(out):
        return out.numel() // out.shape[-1] if out.dim() else 0
    if isinstance(out, (list, tuple)):
        return sum(_feature_rows(x) for x in out)
    return 0


def _check_features(model, inner, inputs: dict, probe_ids) -> None:
    """The probe image's placeholder tokens as the processor writes them against the features the loaded tower
    gives for it: a checkpoint whose processor and model configs disagree (an image size, a token count) is
    refused before step 1, naming both counts, instead of failing in the first forward with an image. Checked
    in a single process only (a sharded tower's direct call would gather out of step), and only where both
    counts can be told."""
    import torch

    from vlft import ConfigError

    config = getattr(model, "config", None)
    ids = [getattr(config, k, None) for k in ("image_token_id", "image_token_index")]
    token_id = next((i for i in ids if isinstance(i, int) and not isinstance(i, bool)), None)
    if token_id is None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    tokens = int((probe_ids == token_id).sum())
    param = next(inner.parameters())
    moved = {
        k: v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device) for k, v in inputs.items()
    }
    try:
        with torch.no_grad():
            features = _feature_rows(inner.get_image_features(**moved))
    except Exception:  # noqa: BLE001 - not measurable this way: the first forward will tell
        return
    if tokens and features and tokens != features:
        raise ConfigError(
            f"the {NAME} family: this checkpoint's processor writes {tokens} image tokens for a "
            f"{PROBE_SIZE[0]}x{PROBE_SIZE[1]} image but its vision tower gives {features} features for it: the "
            "processor's and the model's configs disagree (image size, patch or merge size, tokens per image); "
            "fix the one that differs from the model as trained"
        )


# --- the reader -------------------------------------------------------------------------------------------------


def _maps_to_image_text_to_text(model_type: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def read(model_config, path: str | None) -> ModelFamily | None:
    """The family of a checkpoint of a ``model_type`` transformers maps to AutoModelForImageTextToText (None for
    any other), read once per folder."""
    from functools import partial

    model_type = str(getattr(model_config, "model_type", "") or "")
    if not _maps_to_image_text_to_text(model_type):
        return None
    key = (str(path), model_type)
    if key in _READ:
        return _READ[key]
    try:
        model = _meta_model(model_config)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build a model from
        raise _refuse(model_type, f"transformers cannot build its model ({type(e).__name__}: {e})") from None
    if getattr(model_config, "is_encoder_decoder", False):  # its prompt goes to an encoder, not the decoder's input
        raise _refuse(model_type, "it is an encoder-decoder model; the family trains decoder-only text models")
    towers, targets, found = _towers(model, model_type)
    processor_class, chat, image_inputs, video_inputs, dummy = "", Chat(), None, None, None
    if path is not None:
        load = partial(load_processor, token_types=_takes_token_types(model))
        processor, conv, seen = _read_processor(path, model_type, load)
        found.update(seen)
        video_inputs, video, found["video"] = _read_video(processor, model, conv["joins"])
        processor_class = type(processor).__name__
        chat = Chat(processor_class=processor_class, load_processor=load, reply_end_token=conv["end"])
        base, seen = generic_vision.image_inputs(
            processor, model, towers, {**conv["joins"], **video.get("joins", {})}, conv["pixels"]
        )
        found.update(seen)
        image_inputs = _image_inputs(base)
        dummy = partial(
            vision_dummy, warmup=conv["warmup"], video_warmup=video.get("warmup"), probe_ids=conv["probe_ids"]
        )
    description = f"{NAME} family, read from the checkpoint: " + "; ".join(f"{k} {v}" for k, v in found.items())
    family = ModelFamily(
        name=NAME,
        model_types=(model_type,),
        description=description,
        towers=towers,
        targets=targets,
        chat=chat,
        image_inputs=image_inputs,
        video_inputs=video_inputs,
        packing=generic_packing.packing(
            model, towers.decoder_layers, image_inputs.batch_inputs if image_inputs else {}
        ),
        vision_dummy=dummy,
    )
    _READ[key] = family
    return family


READER = FamilyReader(
    name=NAME,
    description="any model_type transformers maps to AutoModelForImageTextToText: towers, targets, image token "
    "and chat template read from the checkpoint",
    read=read,
)
