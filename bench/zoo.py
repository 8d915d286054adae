"""The zoo: every model type transformers maps to ``AutoModelForImageTextToText``, built tiny offline and run
through vlft (issue 42, item 4). A script, not part of the suite (tests/test_zoo.py runs a handful).

For each model type:

1. build a tiny checkpoint as a user's would be written, by plain transformers: the config class's defaults
   shrunk (``shrink``: hidden sizes, 1-2 layers, heads, experts, image and patch sizes, the vocabulary to the
   tiny tokenizer's), the model from that config (seeded random init), the processor class transformers maps
   the type to, built from its image processor (the class defaults, sized down) and a tiny BPE tokenizer whose
   special tokens include every token the processor's module names, and a ChatML-style chat template writing
   the processor's image token for an image part; the processor's restatements of the tower (tile side,
   tokens per tile or image, CLS token, any-resolution grids) derived from the shrunk config, and where a
   type's model reads what no generic rule finds, a small per-type table says it (``TOKEN_IDS``,
   ``IMAGE_PROCESSOR``, ``CONFIG``: each entry with its why); ``save_pretrained`` into a folder. What cannot be built
   here (a missing package, a config or processor that needs parts the builder cannot give) is recorded as
   "not built" with the reason;
2. run ``vlft run`` for 2 steps on tiny mixed data (text-only and image records), then ``vlft predict`` and
   ``vlft export`` on its output, in one interpreter through click (``tests/helpers.cli_invoke``); classify:
   trains (all three pass) / refused (vlft's ConfigError or DataError, its first line) / fails (an exception:
   its type, message and where).

Isolation: a worker process takes the types one after another (imports paid once); the parent restarts it
past a type that hangs (``--per-type`` seconds) or kills the interpreter. Results are appended to
``<work>/results.jsonl`` as each type ends, so a run cut short (``--budget``) resumes where it stopped.

    python bench/zoo.py --work /tmp/zoo [--only llava,mistral3] [--budget 280] [--fresh]
    python bench/zoo.py --work /tmp/zoo --table docs/zoo.md     # the table from the results so far
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
# sizes shrunk wherever a (sub-)config has them, to at most this value
SHRINK = dict(
    TEXT,
    embed_dim=64,
    depth=2,
    num_heads=4,
    num_layers=2,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    d_model=64,
    d_ff=128,
    d_kv=16,
    ffn_dim=128,
    hidden_dim=128,
    mlp_dim=128,
    out_hidden_size=64,
    projection_dim=64,
    text_hidden_size=64,
    vision_hidden_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    num_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,  # DeepSeek-style routing groups: the few experts left make one group
    topk_group=1,
    mm_tokens_per_image=4,  # pooled from the tiny tower's 4 x 4 patches
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_query_tokens=4,
    vision_num_layers=2,
    max_window_layers=2,
    hidden_size_per_layer_input=16,
    adapter_out_dim=64,  # Dots3-Note: must equal the text hidden size
)
HIDDEN_TIED = ("adapter_in_dim", "adapter_input_size")  # Dots3-Note's vision and audio adapters' input widths
MROPE_DEFAULT = re.compile(
    r"""mrope_section["']?\s*,\s*\[(\d+),\s*(\d+),\s*(\d+)\]"""
)  # .get("mrope_section", [a, b, c])
MAX_PARAMETERS = 120_000_000
SEQUENCE_COUNTS = ("image_seq_length", "num_image_tokens", "image_seq_len", "num_image_token", "image_tokens")
LOCK_HOLD = 200  # seconds: the machine's rule is a command holds the shared CPU lock under 5 minutes
IMAGE_SIDE_PATCHES = 4  # the tiny vision tower sees images of this many patches a side
LAYER_LIST_KEYS = ("layer_types", "mlp_layer_types", "layers_block_type", "attn_type_list", "moe_layer_freq")
TOKEN_LITERAL = re.compile(r"""["']((?:<[^"'\s{}%]{1,40}>)|(?:\[[A-Z_/]{2,30}\])|(?:\|[A-Z_]{2,30}\|))["']""")
TOKEN_IN_FSTRING = re.compile(r"""(?:f["']|\})(<[A-Za-z_]{2,30}>)(?:\{|["'])""")  # f"<IMG_START>{..." ...}<IMG_GRID>"
TOKEN_ATTRIBUTE = re.compile(r"tokenizer\.(\w+_token)\b")
# an attribute read as optional (Gemma 4 checks its audio boundary tokens on every call, whatever the inputs)
OPTIONAL_TOKEN_ATTRIBUTE = re.compile(r"""getattr\((?:self\.)?tokenizer, ["'](\w+_token)["'], None\)""")
BASE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<s>", "</s>", "<pad>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE_TOKEN{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _auto(module: str, name: str) -> dict:
    """One of transformers' auto mappings by model type (``transformers.models.auto.<module>.<name>``)."""
    return getattr(importlib.import_module(f"transformers.models.auto.{module}"), name)


class NotBuilt(Exception):
    """The builder cannot make this type here (a missing package, parts it cannot give)."""


# --- the config shrinker ---------------------------------------------------------------------------------------


def shrink(d: dict, vocab: int, text: bool) -> dict:
    """A config dict with its sizes at most the tiny ones, recursively through its sub-configs; lists that go
    per layer cut to the new layer count; the text config's vocabulary the tokenizer's."""
    out = dict(d)
    layers_before = d.get("num_hidden_layers")
    for key, small in SHRINK.items():
        if isinstance(out.get(key), int) and not isinstance(out.get(key), bool) and out[key] > small:
            out[key] = small
    if isinstance(out.get("num_key_value_heads"), int) and isinstance(out.get("num_attention_heads"), int):
        equal = d.get("num_key_value_heads") == d.get("num_attention_heads")  # MHA stays MHA (some configs insist)
        out["num_key_value_heads"] = out["num_attention_heads"] if equal else min(2, out["num_attention_heads"])
    for key in HIDDEN_TIED:  # sizes a config insists equal its hidden size follow the shrunk one
        if isinstance(out.get(key), int) and d.get(key) == d.get("hidden_size"):
            out[key] = out["hidden_size"]
    if isinstance(out.get("per_layer_config"), dict):  # per-layer overrides keyed by layer index
        n = out.get("num_hidden_layers", 2)
        out["per_layer_config"] = {k: v for k, v in out["per_layer_config"].items() if int(k) < n}
    if (
        "head_dim" in out
        and isinstance(out.get("hidden_size"), int)
        and isinstance(out.get("num_attention_heads"), int)
    ):
        out["head_dim"] = max(out["hidden_size"] // out["num_attention_heads"], 8)
        if "qk_rope_head_dim" in out and d.get("head_dim") == d["qk_rope_head_dim"]:  # MLA: head_dim is the rotary part
            out["head_dim"] = out["qk_rope_head_dim"]
    for key in list(out):
        value = out[key]
        per_layer = isinstance(value, list) and layers_before and len(value) == layers_before
        if (per_layer and key != "architectures") or (key in LAYER_LIST_KEYS and isinstance(value, list)):
            out[key] = _kept_layers(value, out.get("num_hidden_layers", 2))
    _shrink_image(out)
    _shrink_rope(out)
    for key in ("vision_feature_layer", "vision_feature_layers"):  # layer indexes into the shrunk tower
        if key in out:
            out[key] = _layer_index(out[key])
    if isinstance(out.get("global_attn_indexes"), (list, tuple)):  # SAM's global layers, within the shrunk ones
        out["global_attn_indexes"] = sorted(
            {min(i, out.get("num_hidden_layers", 2) - 1) for i in out["global_attn_indexes"]}
        )
    if text and isinstance(out.get("vocab_size"), int):
        out["vocab_size"] = vocab
    if text and isinstance(out.get("vocab_size_per_layer_input"), int):  # Gemma 3n/4's per-layer embedding rows
        out["vocab_size_per_layer_input"] = vocab
    for key, value in out.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = shrink(value, vocab, text=text and _is_text_key(key))
    return out


def _default_mrope(d: dict, sections: list[int]) -> None:
    """A 3-D rope whose sections the config leaves to the model's default (sized for the full head): given
    sections summing to the tiny head_dim / 2, in every (sub-)config with rope parameters."""
    rope = d.get("rope_parameters")
    # a rope table by layer type (Cohere Compass: empty, or as CONFIG fills it) holds its sections per entry
    flat = isinstance(rope, dict) and bool(rope) and not any(isinstance(v, dict) for v in rope.values())
    if flat and isinstance(rope, dict) and "mrope_section" not in rope and isinstance(d.get("hidden_size"), int):
        d["rope_parameters"] = dict(rope, mrope_section=list(sections))
        _shrink_rope(d)
    for value in d.values():
        if isinstance(value, dict):
            _default_mrope(value, sections)


# where a type's model reads a token other than the processor's ``image_token`` (the ids the builder gives it)
TOKEN_IDS = {  # a value naming a tokenizer attribute stands for its token
    **{  # Gemma 3's processor calls <boi> its image token; the model fills the soft tokens between <boi> and <eoi>
        t: {"image_token_index": "image_token", "image_token_id": "image_token"}
        for t in ("gemma3", "shieldgemma2", "t5gemma2")
    },
    "ovis2": {  # the processor expands <image> to atoms between indicators; the model fills atoms, embeds indicators
        "image_token_id": "<IMG_ATOM>",
        "visual_indicator_token_ids": ["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"],
    },
    # Llama 4's processor expands <|image|> to tiles of <|patch|> around one <|image|>; the model fills the patches
    "llama4": {
        "image_token_index": "<|patch|>",
        "boi_token_index": "<|image_start|>",
        "eoi_token_index": "<|image_end|>",
    },
}


def _type_token_ids(model_type: str, d: dict, tokenizer) -> dict:
    """``d`` with the TOKEN_IDS of its type set wherever in its tree the config has them."""

    def ids(token):
        if isinstance(token, list):
            return [ids(t) for t in token]
        return tokenizer.convert_tokens_to_ids(getattr(tokenizer, token, None) or token)

    given = TOKEN_IDS.get(model_type, {})
    out = {k: ids(given[k]) if k in given else v for k, v in d.items()}
    return {k: _type_token_ids(model_type, v, tokenizer) if isinstance(v, dict) else v for k, v in out.items()}


def _mrope_sections(config_class, d: dict) -> list[int] | None:
    """A 3-D rope's default sections where the model reads them (its config's or modeling module's source names
    them, or a sub-config's: GLM-4.6V's text model is GLM-4.1V's; PaddleOCR-VL's modeling code holds the default):
    the list the source writes after the name (ERNIE 4.5 VL's equal height and width), else Qwen2-VL's; None
    where no source names them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def types(x: dict):
        for value in x.values():
            if isinstance(value, dict):
                if isinstance(value.get("model_type"), str):
                    yield value["model_type"]
                yield from types(value)

    modules = {config_class.__module__}
    modules.update(CONFIG_MAPPING[t].__module__ for t in types(d) if t in CONFIG_MAPPING)
    for name in list(modules):
        modules.add(name.replace(".configuration_", ".modeling_"))
    sources = []
    for name in sorted(modules):
        try:
            sources.append(inspect.getsource(importlib.import_module(name)))
        except Exception:  # noqa: BLE001 - no such module, or one needing a package not here: not read
            continue
    if not any("mrope_section" in source for source in sources):
        return None
    written = next((m for m in map(MROPE_DEFAULT.search, sources) if m), None)
    return [int(x) for x in written.groups()] if written else [16, 24, 24]


def _layer_index(value):
    """A vision layer index (or a list of them) moved into the shrunk tower's layers, the list's length kept
    (VipLLaVA's projector takes one block per listed layer)."""
    n = SHRINK["num_hidden_layers"]
    if isinstance(value, list):
        return [_layer_index(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return max(value, -n) if value < 0 else min(value, n - 1)
    return value


def _kept_layers(value: list, n: int) -> list:
    """A per-layer list cut to ``n`` entries keeping one of each kind first (a hybrid model keeps a full
    attention layer beside its linear ones: generation needs one)."""
    kinds = list(dict.fromkeys(v for v in value if isinstance(v, str)))
    if len(kinds) < 2 or len(kinds) > n:
        return value[:n]
    return kinds + [value[0]] * (n - len(kinds))


def _shrink_rope(out: dict) -> None:
    """A 3-D rope's sections rescaled to sum to the new head_dim / 2."""
    head = out.get("head_dim") or (
        out["hidden_size"] // out["num_attention_heads"]
        if isinstance(out.get("hidden_size"), int) and isinstance(out.get("num_attention_heads"), int)
        else None
    )
    for key in ("rope_parameters", "rope_scaling"):
        rope = out.get(key)
        if not (isinstance(rope, dict) and isinstance(head, int) and isinstance(rope.get("mrope_section"), list)):
            continue
        partial = rope.get("partial_rotary_factor") or out.get("partial_rotary_factor") or 1.0  # GLM-4.5V: half
        sections, half = rope["mrope_section"], int(head * partial) // 2
        scaled = [max(1, s * half // sum(sections)) for s in sections]
        # the rest to a section no other equals (ERNIE 4.5 VL interleaves its equal height and width sections)
        odd = next((i for i, s in enumerate(sections) if sections.count(s) == 1), 0)
        scaled[odd] += half - sum(scaled)
        out[key] = dict(rope, mrope_section=scaled)


def _is_text_key(key: str) -> bool:
    return key in ("text_config", "language_config", "llm_config", "decoder", "thinker_config")


def _shrink_image(out: dict) -> None:
    patch = out.get("patch_size")
    patch = patch[0] if isinstance(patch, list) and patch else patch
    if isinstance(out.get("image_size"), (int, list)) and isinstance(patch, int) and patch > 0:
        side = patch * IMAGE_SIDE_PATCHES
        out["image_size"] = [side, side] if isinstance(out["image_size"], list) else side


def _vision_side(d: dict) -> int:
    """The tiny vision side: the first image_size found in the (shrunk) config tree, else 32."""
    if isinstance(d.get("image_size"), int):
        return d["image_size"]
    if isinstance(d.get("image_size"), list) and d["image_size"]:
        return int(d["image_size"][0])
    for value in d.values():
        if isinstance(value, dict):
            side = _vision_side(value)
            if side:
                return side
    return 0


# --- the tokenizer, image processor, processor ------------------------------------------------------------------


def _processor_tokens(processor_class) -> tuple[list[str], dict[str, str]]:
    """Token-like strings the processor's module names (added as special tokens), and the tokenizer attributes
    it reads (``tokenizer.image_token`` ...) with a value each: the __init__ default where it has one."""
    module = sys.modules[processor_class.__module__]
    source = inspect.getsource(module)
    literals = list(dict.fromkeys(TOKEN_LITERAL.findall(source) + TOKEN_IN_FSTRING.findall(source)))
    defaults = {
        name: p.default
        for name, p in inspect.signature(processor_class.__init__).parameters.items()
        if isinstance(p.default, str)
    }
    attributes = {}
    for name in dict.fromkeys(TOKEN_ATTRIBUTE.findall(source) + OPTIONAL_TOKEN_ATTRIBUTE.findall(source)):
        if name.startswith("add_") or name in (
            "eos_token",
            "bos_token",
            "pad_token",
            "unk_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ):
            continue
        attributes[name] = defaults.get(name) or f"<{name.removesuffix('_token')}>"
    tokens = literals + [v for v in defaults.values() if TOKEN_LITERAL.fullmatch(repr(v))] + list(attributes.values())
    return list(dict.fromkeys(tokens))[:80], attributes


def _tokenizer(tokens: list[str], attributes: dict[str, str]):
    from transformers import PreTrainedTokenizerFast

    from vlft.plugins import serve_checkout

    serve_checkout()  # vlft_models from this checkout (as the registry will serve it), not an installed copy
    from vlft_models import _tiny  # the tiny families' BPE builder
    from vlft_models.smolvlm import _allow_without_num2words

    _allow_without_num2words()  # SmolVLM's processor wants num2words for video prompts only (as vlft loads it)

    specials = list(dict.fromkeys(BASE_SPECIALS + tokens))
    base = _tiny.build_tokenizer(320 + len(specials), specials, eos=EOS, pad=PAD)
    return PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        eos_token=EOS,
        pad_token=PAD,
        unk_token="<unk>",
        bos_token="<s>",  # processors that write it themselves (prefix-LM prompts) read it
        model_max_length=4096,
        **attributes,
    )


def _as_dict(value) -> dict:
    """A size as a plain dict (transformers 5 keeps it as a SizeDict dataclass), its unset keys left out."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    try:
        return {k: v for k, v in vars(value).items() if v is not None}
    except TypeError:
        return {}


def _sized(d: dict, side: int) -> dict:
    """An image processor ``size`` dict at ``side`` (pixel-count bounds scaled to it)."""
    out = {}
    for key, value in d.items():
        if not isinstance(value, int):
            out[key] = value
        elif "pixels" in key or value > 4096:  # a pixel count, not a side
            out[key] = side * side * (4 if "max" in key or "longest" in key else 1)
        else:
            out[key] = side
    return out


# image processor settings a type's model needs and the class defaults do not give (from the shrunk config)
IMAGE_PROCESSOR = {
    # their patch embedding takes one frame
    **dict.fromkeys(("llava_onevision1_5", "dots3_note"), lambda c: {"temporal_patch_size": 1}),
    "deepseek_vl_hybrid": lambda c: {  # its second (SAM) tower's input side
        "high_res_size": dict.fromkeys(("height", "width"), c["high_res_vision_config"]["image_size"])
    },
    # PaliGemmaProcessor reads its image tokens per image from the image processor (the checkpoints'
    # preprocessor_config.json has image_seq_length: 256 at 224 px), one per SigLIP patch
    "paligemma": lambda c: {
        "image_seq_length": (c["vision_config"]["image_size"] // c["vision_config"]["patch_size"]) ** 2
    },
    # the global view twice the tower's side, local crops of its side (as 728 / 504 px against 14 px patches
    # downsampled 4x); the longest side it takes is a size in pixels, not a count (the rule above would cut it)
    "step3p7": lambda c: {
        "size": dict.fromkeys(("height", "width"), 2 * c["vision_config"]["image_size"]),
        "patch_size": c["vision_config"]["image_size"],
        "max_image_size": 8 * c["vision_config"]["image_size"],
    },
    # the image is cut into squares of one merged patch (the class default is the full tower's 2 x 20 px)
    **dict.fromkeys(
        ("inkling2", "inkling2_loop"), lambda c: {"size": dict.fromkeys(("height", "width"), _merged_patch(c))}
    ),
}
# top-level sizes that restate the shrunk towers' (the shrinker caps them, these derive them)
CONFIG: dict[str, Any] = {
    **{  # the adapter takes the tower's 2 x 2 merged patches: vision hidden * 4
        t: {"out_hidden_size": SHRINK["hidden_size"] * 4, "projector_hidden_size": SHRINK["hidden_size"]}
        for t in ("muse_spark", "muse_glimmer")
    },
    "kimi_k25": {"projection_hidden_size": SHRINK["hidden_size"]},  # the projector normalizes the tower's hidden
    # the SAM neck's last channels are the second encoder's patch embeddings: its hidden size
    "unlimited_ocr": {"vision_config": {"sam_config": {"downsample_channels": [32, SHRINK["hidden_size"]]}}},
    # its text model builds a sliding-window mask whatever its layers are; the class leaves the window to the
    # checkpoint (None)
    "step3p7": {"text_config": {"sliding_window": 64}},
    # its rope is a table by layer type the class leaves empty (the checkpoint fills it): one full-attention entry,
    # its sections (the modeling default 24/20/20) over the tiny head's 8 frequencies
    "cohere_compass": {
        "text_config": {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}
            }
        }
    },
    # the projector's query count is keyed by the tower's patch count at the processor's two sides (490, 980 px,
    # its size_conversion's keys): the keys follow the tiny tower's patch, the counts stay the processor's
    "aria": lambda c: {
        "projector_patch_to_query_dict": {
            (s // c["vision_config"]["patch_size"]) ** 2: q for s, q in ((490, 128), (980, 256))
        }
    },
    # the 0.5 pixel shuffle gives the tower's MLP 4 x hidden channels, and its output feeds the projector
    "llama4": {
        "vision_config": {
            "intermediate_size": SHRINK["hidden_size"] * 4,
            **dict.fromkeys(
                ("projector_input_dim", "projector_output_dim", "vision_output_dim"), SHRINK["hidden_size"]
            ),
        }
    },
}


def _merged_patch(config: dict) -> int:
    """The side of one merged patch of the vision tower: its patch size times its spatial merge size."""
    vision = config.get("vision_config", config)
    return vision["patch_size"] * vision.get("spatial_merge_size", 1)


def _config_table(model_type: str, config: dict) -> dict:
    """The CONFIG entry of ``model_type`` (a dict, or a function of the shrunk config giving one)."""
    entry = CONFIG.get(model_type, {})
    return entry if isinstance(entry, dict) else entry(config)


def _merged(d: dict, over: dict) -> dict:
    """``d`` with ``over``'s values set, nested dicts merged key by key."""
    out = dict(d)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _image_processor(model_type: str, side: int, config: dict):
    import transformers

    names = _mapped(model_type, "image_processing_auto", "IMAGE_PROCESSOR_MAPPING_NAMES") or {}
    name = names.get("pil") or names.get("torchvision")
    if not name:
        raise NotBuilt("transformers maps no image processor to it")
    try:
        cls = getattr(transformers, name)
        default = cls()
    except ImportError as e:
        raise NotBuilt(f"{name} needs a package not installed here ({e})".splitlines()[0]) from None
    sized: dict = {}
    for attr in ("size", "crop_size", "max_image_size"):  # max_image_size: Idefics3's tile, the tower's side
        value = _as_dict(getattr(default, attr, None))
        if value:
            sized[attr] = _sized(value, side)
    for attr in ("min_pixels", "max_pixels"):
        if isinstance(getattr(default, attr, None), int):
            sized[attr] = side * side * (4 if attr == "max_pixels" else 1)
    for attr in ("max_image_tiles", "max_patches", "max_num_patches", "max_crops", "max_image_size"):
        value = getattr(default, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            sized[attr] = 2
    if getattr(default, "image_grid_pinpoints", None):  # any-resolution tiles: the model's grid (``pinpoints``)
        sized["image_grid_pinpoints"] = pinpoints(side)
    # the tower's patch and merge sizes, where the image processor has them too
    shared = _from_config(config, ("patch_size", "merge_size", "temporal_patch_size", "spatial_merge_size"))
    sized.update({k: v for k, v in shared.items() if hasattr(default, k) and isinstance(v, int)})
    sized.update(IMAGE_PROCESSOR[model_type](config) if model_type in IMAGE_PROCESSOR else {})
    processor = cls(**sized)
    return processor


def _mapped(model_type: str, module: str, name: str):
    """The class name(s) an auto mapping gives the type, else those it gives another type mapped to the same
    processor class (transformers maps none to some variants: Qwen3-VL MoE's processor is Qwen3-VL's, and so
    its image processor), else None."""
    mapping = _auto(module, name)
    if mapping.get(model_type):
        return mapping[model_type]
    processors = _auto("processing_auto", "PROCESSOR_MAPPING_NAMES")
    mine = processors.get(model_type)
    return next((mapping[t] for t, p in processors.items() if mine and p == mine and mapping.get(t)), None)


def pinpoints(side: int) -> list[list[int]]:
    """Any-resolution grids (LLaVA-NeXT, OneVision) in tiles of the tower's side: up to 2 x 2 tiles."""
    return [[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]]


def _from_config(d: dict, names) -> dict:
    """The processor's ``names`` found in the config tree (patch size, merge size, image token counts...)."""
    found = {}
    for value in d.values():
        if isinstance(value, dict):
            found.update({k: v for k, v in _from_config(value, names).items() if k not in found})
    found.update({k: v for k, v in d.items() if k in names and not isinstance(v, dict)})
    return found


def _tower_counts(config: dict, side: int) -> dict:
    """Processor arguments that restate the shrunk tower (each read where the processor takes it): the tile side
    (``img_size``), its patches per tile (``num_image_tokens``), and the CLS token a CLIP tower puts before
    them (``num_additional_image_tokens``: the "default" feature strategy drops it, the count must too)."""
    patch = _from_config(config, ("patch_size",)).get("patch_size")
    vision = next((v for k, v in config.items() if k == "vision_config" and isinstance(v, dict)), {})
    out: dict[str, Any] = {"img_size": side}
    pooled = _from_config(config, ("mm_tokens_per_image",)).get("mm_tokens_per_image")
    if isinstance(pooled, int):  # Gemma 3 writes its image sequence once, in __init__ (no calibrating it after)
        out["image_seq_length"] = pooled
    if isinstance(patch, int) and patch > 0:
        out["num_image_tokens"] = (side // patch) ** 2
    if vision.get("model_type") == "clip_vision_model" and config.get("vision_feature_select_strategy") == "default":
        out["num_additional_image_tokens"] = 1
    return out


def _processor(model_type: str, side: int, config: dict):
    import transformers

    name = _auto("processing_auto", "PROCESSOR_MAPPING_NAMES").get(model_type)
    if not name:  # written as such checkpoints ship: a tokenizer (with a template) and no processor
        tokenizer = _tokenizer(["<image>"], {})
        tokenizer.chat_template = TEMPLATE.replace("IMAGE_TOKEN", "<image>")
        return tokenizer
    cls = getattr(transformers, name)
    tokens, attributes = _processor_tokens(cls)
    tokenizer = _tokenizer(tokens, attributes)
    params = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {
        n: tokenizer for n, p in params.items() if n.endswith("tokenizer") and p.default is p.empty
    }
    kwargs["tokenizer"] = tokenizer
    kwargs.update(_from_config(config, [n for n, p in params.items() if n not in ("self", "chat_template")]))
    kwargs.update({k: v for k, v in _tower_counts(config, side).items() if k in params and kwargs.get(k) is None})
    if "image_processor" in params:
        kwargs["image_processor"] = _image_processor(model_type, side, config)
    if "feature_extractor" in params:  # the audio part of omni processors: its class defaults
        extractor = _mapped(model_type, "feature_extraction_auto", "FEATURE_EXTRACTOR_MAPPING_NAMES")
        if isinstance(extractor, dict):
            extractor = extractor.get("pil") or next(iter(extractor.values()), None)
        kwargs["feature_extractor"] = getattr(transformers, extractor)() if extractor else None
    if "video_processor" in params:
        video = _mapped(model_type, "video_processing_auto", "VIDEO_PROCESSOR_MAPPING_NAMES")
        if isinstance(video, dict):  # {backend: class name}
            video = video.get("pil") or video.get("torchvision") or next(iter(video.values()), None)
        try:
            kwargs["video_processor"] = _video_processor(getattr(transformers, video)) if video else None
        except ImportError as e:
            raise NotBuilt(f"{video} needs a package not installed here ({e})".splitlines()[0]) from None
    try:
        processor = cls(**kwargs)
    except ImportError as e:
        raise NotBuilt(f"{name} needs a package not installed here ({e})".splitlines()[0]) from None
    token = getattr(processor, "image_token", None)  # none: the template writes no placeholder (vlft says so)
    processor.chat_template = TEMPLATE.replace("IMAGE_TOKEN", token if isinstance(token, str) else "")
    return processor


def _video_processor(cls):
    """The video processor class's defaults, less timestamps drawn on frames (their font file is a download)."""
    return cls(draw_on_frames=False) if getattr(cls, "draw_on_frames", False) else cls()


# --- the model -------------------------------------------------------------------------------------------------


def _token_ids(d: dict, processor, tokenizer) -> dict:
    """The config's special token ids set to the tiny tokenizer's: ``<x>_token_id``/``_index`` from the
    processor's or tokenizer's ``<x>_token``, and pad/eos/bos."""
    ids = tokenizer.convert_tokens_to_ids
    out = dict(d)
    for key, value in d.items():
        m = re.fullmatch(r"(\w+?)_token_(?:id|index)", key)
        if m is None or isinstance(value, (dict, list)):
            continue
        name = m.group(1)
        if name in ("pad", "eos", "bos"):
            out[key] = ids({"pad": PAD, "eos": EOS, "bos": "<s>"}[name])
            continue
        given = getattr(processor, f"{name}_token_id", None)  # the id the processor expands to (Aya: a patch token)
        token = getattr(processor, f"{name}_token", None) or getattr(tokenizer, f"{name}_token", None)
        if isinstance(given, int) and not isinstance(given, bool) and given != tokenizer.unk_token_id:
            out[key] = given
        elif isinstance(token, str) and ids(token) != tokenizer.unk_token_id:
            out[key] = ids(token)
    for key, value in out.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = _token_ids(value, processor, tokenizer)
    return out


def _with_sub_configs(d: dict, config_class) -> dict:
    """Sub-configs the defaults leave None (a VQ model, a second tower) given their own class defaults; an
    optional vision tower (``SubConfigSpec(optional=True)``: Gemma 4) too, an optional audio one not (the zoo
    runs images)."""
    classes = dict(getattr(config_class, "sub_configs", None) or {})
    classes.update(getattr(config_class, "sub_configs_defaults", None) or {})
    for key, cls in classes.items():
        if d.get(key) is None and not isinstance(cls, type) and "vision" in key:
            cls = getattr(cls, "config_class", None)  # a SubConfigSpec naming its class
        if d.get(key) is None and isinstance(cls, type):
            try:
                d[key] = cls().to_dict()
            except Exception:  # noqa: BLE001 - an abstract or AutoConfig entry: left as the class left it
                pass
    return d


def _features(out) -> int:
    """How many feature rows ``get_image_features`` gave (a tensor, a list of them, or a model output)."""
    import torch

    out = getattr(out, "pooler_output", None) if not torch.is_tensor(out) and hasattr(out, "pooler_output") else out
    if torch.is_tensor(out):
        return out.numel() // out.shape[-1]
    if isinstance(out, (list, tuple)):
        return sum(_features(x) for x in out)
    return 0


def _tile_tokens(processor, config: dict) -> None:
    """A processor writing ``patch_size ** 2`` tokens a tile (Cohere2 Vision: its ``patch_size`` is the tile's
    tokens a side after the pixel shuffle, not the tower's patch): set from the shrunk tower."""
    factor = config.get("downsample_factor")
    image = getattr(processor, "image_processor", None)
    if image is None or type(processor).__name__ != "Cohere2VisionProcessor" or not isinstance(factor, int):
        return
    image.patch_size = processor.patch_size = IMAGE_SIDE_PATCHES // factor


def _calibrate(model, processor) -> None:
    """Where the processor writes a fixed count of image tokens per image or tile (``image_seq_length`` ...),
    that count set to what the shrunk tower gives for a probe image: the builder shrank the tower, not the
    count. Left as it is where the count cannot be measured (the run then shows the mismatch)."""
    import torch
    from PIL import Image

    attr = next((a for a in SEQUENCE_COUNTS if isinstance(getattr(processor, a, None), int)), None)
    token = getattr(processor, "image_token", None)
    token_id = getattr(model.config, "image_token_id", None)  # the token the model fills (Ovis2: not <image>)
    inner = next((m for m in model.modules() if hasattr(m, "get_image_features")), None)
    if attr is None or not isinstance(token, str) or inner is None:
        return
    for _ in range(2):  # the count, then a check of it
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        try:
            out = processor(text=[prompt], images=[[Image.new("RGB", (64, 64))]], return_tensors="pt")
            names = inspect.signature(inner.get_image_features).parameters
            with torch.no_grad():
                features = _features(inner.get_image_features(**{k: v for k, v in out.items() if k in names}))
        except Exception:  # noqa: BLE001 - not measurable: the run shows what happens
            return
        if not isinstance(token_id, int):
            token_id = processor.tokenizer.convert_tokens_to_ids(token)
        tokens = int((out["input_ids"] == token_id).sum())
        if not tokens or not features or tokens == features:
            return
        setattr(processor, attr, max(1, getattr(processor, attr) * features // tokens))


def build(model_type: str, folder: Path) -> str:
    """The tiny checkpoint of ``model_type`` in ``folder``; its model class name."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
        default = _with_sub_configs(config_class().to_dict(), config_class)
    except ImportError as e:
        raise NotBuilt(f"its config needs a package not installed here ({e})".splitlines()[0]) from None
    has_text = any(_is_text_key(k) for k in default)
    small = shrink(default, 0, text=not has_text)
    processor = _processor(model_type, _vision_side(small) or 32, small)
    tokenizer = getattr(processor, "tokenizer", processor)
    small = _token_ids(shrink(default, len(tokenizer), text=not has_text), processor, tokenizer)
    small = _merged(_type_token_ids(model_type, small, tokenizer), _config_table(model_type, small))
    if small.get("image_grid_pinpoints"):
        small["image_grid_pinpoints"] = pinpoints(_vision_side(small) or 32)
    _tile_tokens(processor, small)
    sections = _mrope_sections(config_class, small)
    if sections:
        _default_mrope(small, sections)
    small.pop("transformers_version", None)
    config = config_class.from_dict(small)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise NotBuilt(f"the shrunk config still has {size / 1e6:.0f} M parameters (a size the shrinker misses)")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    if getattr(model, "generation_config", None) is None:  # a model without generate (an action policy)
        raise NotBuilt(f"{type(model).__name__} has no generation config (it does not generate text)")
    _calibrate(model, processor)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(EOS)
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(PAD)
    model.generation_config.do_sample = False
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return type(model).__name__


# --- one type through vlft -------------------------------------------------------------------------------------


def _where(e: BaseException) -> str:
    """The frame that raised, and the last of vlft's own frames on the way (the call that reached it)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if "/vlft/" in f.filename or "/plugins/" in f.filename]
    named = [frames[-1]] + ([ours[-1]] if ours and ours[-1] is not frames[-1] else [])
    return " via ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in named)


def _first_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("Error", "error")) or "Error:" in line:
            return line
    return lines[-1] if lines else "(no output)"


def run_one(model_type: str, work: Path, data: Path) -> dict:
    """Build ``model_type`` and take it through run, predict and export; the result row."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import cli_invoke  # pyright: ignore[reportMissingImports] - tests/, put on the path above
    from vlft.errors import VlftError

    row: dict = {"type": model_type, "class": "", "family": "", "result": "", "reason": ""}
    shutil.rmtree(work / model_type, ignore_errors=True)
    folder = work / model_type / "ckpt"
    try:
        row["class"] = build(model_type, folder)
    except NotBuilt as e:
        return dict(row, result="not built", reason=f"cannot build here: {e}")
    except Exception as e:  # noqa: BLE001 - a builder failure is recorded, the zoo goes on
        return dict(row, result="not built", reason=f"builder: {type(e).__name__}: {_short(e)} ({_where(e)})")
    out = work / model_type / "run"
    steps = [
        ("run", "--quiet", "--backend", "cpu", "--model", folder, "--data", data, "--output", out, "--steps", "2",
         "--batch-size", "2", "--max-length", "4096", "--save-every", "0", "--eval-every", "0", "--seed", "0",
         "--max-new-tokens", "2"),
        ("predict", "--adapter", out, "--data", data, "--output", work / model_type / "p.jsonl",
         "--max-new-tokens", "2", "--quiet"),
        ("export", "--adapter", out, "--output", work / model_type / "merged", "--dtype", "fp32"),
    ]  # fmt: skip
    for args in steps:
        try:
            code, output = cli_invoke(*args)
        except VlftError as e:
            return dict(row, result="refused", reason=f"{args[0]}: {_short(e)}", family=_family(out))
        except Exception as e:  # noqa: BLE001 - the zoo records a failure and goes on
            return dict(
                row, result="fails", reason=f"{args[0]}: {type(e).__name__}: {_short(e)} ({_where(e)})",
                family=_family(out),
            )  # fmt: skip
        if code != 0:
            return dict(row, result="refused", reason=f"{args[0]}: {_first_error_line(output)}", family=_family(out))
    return dict(row, result="trains", family=_family(out))


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300]


def _family(out: Path) -> str:
    try:
        return json.loads((out / "plan.json").read_text())["model_family"]["name"]
    except Exception:  # noqa: BLE001 - no plan written (refused before it)
        return ""


def write_data(work: Path) -> Path:
    """Four records: three with one image (28-64 px a side), one text-only; at batch size 2, every step holds an
    image (so the trained steps run the processor's image tokens against the tower's features)."""
    from vlft.data.demo import write_varied_dataset

    data = work / "data"
    if not (data / "train.jsonl").exists():
        write_varied_dataset(data, n=12, seed=3, min_side=28, max_side=64, max_images=1, answer_words=(1, 4),
                             max_turns=1)  # fmt: skip
        lines = (data / "train.jsonl").read_text().splitlines()
        with_image = [line for line in lines if json.loads(line).get("images")]
        without = [line for line in lines if not json.loads(line).get("images")]
        (data / "train.jsonl").write_text("\n".join(with_image[:3] + without[:1]) + "\n")
    return data / "train.jsonl"


# --- the worker and the parent ---------------------------------------------------------------------------------


def worker(types: list[str], work: Path, results: Path) -> None:
    """Each type in turn, its start and its row appended to ``results`` (the parent sees a hang from that)."""
    import fcntl
    import logging

    logging.disable(logging.WARNING)
    data = write_data(work)
    lock = open("/tmp/vlft-cpu.lock", "w")
    held = None  # the shared CPU lock is held for a chunk of types at a time, at most LOCK_HOLD seconds
    for model_type in types:
        if held is None:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = time.monotonic()
        _append(results, {"start": model_type})
        t0 = time.perf_counter()
        row = run_one(model_type, work, data)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        _append(results, row)
        if time.monotonic() - held > LOCK_HOLD:
            fcntl.flock(lock, fcntl.LOCK_UN)
            held = None


def _append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _rows(results: Path) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    if results.exists():
        for line in results.read_text().splitlines():
            row = json.loads(line)
            if "result" in row:
                rows[row["type"]] = row
    return rows


def _started(results: Path) -> list[str]:
    if not results.exists():
        return []
    return [json.loads(line).get("start") for line in results.read_text().splitlines() if '"start"' in line]


def parent(types: list[str], work: Path, per_type: float, budget: float) -> None:
    results = work / "results.jsonl"
    t0 = time.monotonic()
    while True:
        todo = [t for t in types if t not in _rows(results)]
        if not todo or time.monotonic() - t0 > budget:
            break
        cmd = [sys.executable, __file__, "--worker", ",".join(todo), "--work", str(work)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(work / "worker.log", "a"))
        current, since = None, time.monotonic()
        while proc.poll() is None:
            time.sleep(1)
            started = _started(results)
            now = started[-1] if started else None
            if now != current:
                current, since = now, time.monotonic()
            late = current and current not in _rows(results) and time.monotonic() - since > per_type
            if late or time.monotonic() - t0 > budget:
                proc.kill()
                proc.wait()
                if late:
                    _append(results, {"type": current, "class": "", "family": "", "result": "fails",
                                      "reason": f"no result within {per_type:.0f} s (killed)",
                                      "seconds": per_type})  # fmt: skip
                break
        crashed = started[-1] if (started := _started(results)) else None
        if proc.returncode not in (0, None) and crashed and crashed not in _rows(results):
            _append(results, {"type": crashed, "class": "", "family": "", "result": "fails",
                              "reason": f"the interpreter died (exit {proc.returncode})",
                              "seconds": round(time.monotonic() - since, 1)})  # fmt: skip


def table(work: Path, out: Path) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as MAPPING

    rows = _rows(work / "results.jsonl")
    counts: dict[str, int] = {}
    lines = []
    for model_type, cls in MAPPING.items():
        row = rows.get(model_type, {"result": "not run", "reason": "", "family": "", "seconds": ""})
        counts[row["result"]] = counts.get(row["result"], 0) + 1
        reason = row["reason"].replace("|", "\\|")
        lines.append(f"| {model_type} | {cls} | {row['family']} | {row['result']} | {reason} | {row['seconds']} |")
    seconds = sum(float(r.get("seconds") or 0) for r in rows.values())
    import transformers

    head = [
        "# The zoo: every image-text-to-text model type, tiny, through vlft",
        "",
        f"`bench/zoo.py` builds a tiny checkpoint of each of the {len(MAPPING)} model types transformers "
        f"{transformers.__version__} maps to `AutoModelForImageTextToText` (a shrunk config, a tiny BPE tokenizer "
        "with the processor's tokens, the processor class sized down, a ChatML-style template writing the "
        "processor's image token), then runs a 2-step `vlft run` on tiny mixed data (text-only and one-image "
        "records), `vlft predict` and `vlft export` on it. *trains*: all three pass; *refused*: vlft stops with "
        "its own error (first line); *fails*: an exception escaped (type, message, where); *not built*: the "
        "builder could not make a checkpoint of the type here. Family: the family vlft picked.",
        "",
        "Counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"; {seconds:.0f} s in all "
        "(2 shared CPU cores).",
        "",
        "| model type | transformers class | family | result | reason / first error line | seconds |",
        "|---|---|---|---|---|---|",
    ]
    out.write_text("\n".join(head + lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-zoo"))
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--per-type", type=float, default=240.0)
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds before starting no more types")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results")
    parser.add_argument("--table", type=Path, help="write the table from the results so far and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args.worker.split(","), args.work, args.work / "results.jsonl")
    if args.table:
        return table(args.work, args.table)
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as MAPPING

    if args.fresh:
        (args.work / "results.jsonl").unlink(missing_ok=True)
    types = args.only.split(",") if args.only else list(MAPPING)
    if args.only:  # asked again: forget those types' earlier rows
        kept = [r for r in _rows(args.work / "results.jsonl").values() if r["type"] not in types]
        (args.work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    parent(types, args.work, args.per_type, args.budget)
    table(args.work, ROOT / "docs" / "zoo.md")


if __name__ == "__main__":
    main()
