"""The model-family layer (plugins/models, issue 20), before it is wired into the core.

For every family: its tiny model builds offline and loads through the Auto classes, the processor
renders a chat with the family's template, the family's own token count equals the processor's, a real
PEFT LoRA on the family's default targets trains on the CPU; ``vlft.testing.check_family`` passes (the
contract a third-party family's tests check too: image tokens, rope index, packing, plain-PEFT reload, a
mixed-data run); and every bundled planning config counts (on the meta device) within 1% of its
published parameter count.

(This file will be renamed when the families are wired in; it loads plugins/models as ``vlft_models``
from this checkout, so it does not depend on the installed package.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from vlft.contracts.family import model_family_help
from vlft.data.processor_inputs import widened
from vlft.models.families import (
    check_family,
    frozen_router_parameters,
    resolve_module,
    select_target_modules,
)

ROOT = Path(__file__).resolve().parent.parent / "plugins" / "models"


def _load_package():
    if "vlft_models" in sys.modules and Path(sys.modules["vlft_models"].__file__).parent == ROOT:
        return sys.modules["vlft_models"]
    spec = importlib.util.spec_from_file_location(
        "vlft_models", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["vlft_models"] = module
    spec.loader.exec_module(module)
    return module


vm = _load_package()
from vlft_models import family as fam_mod  # noqa: E402 - after _load_package() makes vlft_models importable
from vlft_models import qwen3_5  # noqa: E402 - after _load_package()

FAMILIES = vm.families()
NAMES = [f.name for f in FAMILIES]
# the Qwen families (their image inputs are a QwenVision's: grids, merge size, mRoPE); the others (the processor
# writes each image's tokens) have tests of their own (below, test_smolvlm.py), and every family goes through
# check_family and the adapter test
QWEN = [f.name for f in FAMILIES if isinstance(getattr(f.image_inputs.prepare, "__self__", None), fam_mod.QwenVision)]

GLM_NAMES = ["glm4.1v", "glm4.6v"]  # QwenVision's batch-input kinds, written by their processor
DECLARED = {
    "internvl": "internvl",
    "llava-next": "llava_next",
    "llava-next-video": "llava_next_video",
    "mistral3": "mistral3",
    "llama4": "llama4",
    "minicpmv4.6": "minicpmv4_6",
}  # the families declared on the generic family (declared.py, llama4.py, minicpmv.py): {name: model type}
# checks that do not apply to a family, with the reason (check_family keeps it); the family's own tests check instead
SKIPS = {
    "paligemma": {
        "image_tokens": "PaliGemma's processor takes the prompt and the reply apart (text=, suffix=) and writes <bos> "
        "and a newline itself, so it cannot encode the whole render; tests/test_paligemma.py compares the ids, token "
        "types and labels with PaliGemmaProcessor(text=prompt, suffix=reply)'s"
    }
}
PROMPT = "What colour is the product?"
ANSWER = "The product is red and has a scratch."


# --- fixtures: each tiny model built once, loaded once --------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{family name: (folder, processor, model)}, built from the config classes, loaded offline."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    root = tmp_path_factory.mktemp("families")
    out = {}
    for f in FAMILIES:
        path = root / f.name
        f.tiny.build(path)
        out[f.name] = (path, AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path))
    return out


def _family(name):
    return vm.family_named(name)


def _tower_paths(family) -> tuple[str, ...]:
    t = family.towers
    return (t.vision, t.vision_blocks, t.decoder_layers, t.lm_head, *t.vision_mergers)


def _vision(family) -> fam_mod.QwenVision:
    """The Qwen numbers behind a Qwen family's image inputs."""
    return family.image_inputs.prepare.__self__


# the Qwen processors' placeholder and frame tokens (the template writes them; the family's image inputs repeat
# the pad once per LLM token of the grid)
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"


def _image(w, h, colour=(200, 30, 30)):
    from PIL import Image

    return Image.new("RGB", (w, h), colour)


def _chat(with_answer=True):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    if with_answer:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": ANSWER}]})
    return msgs


def _batch(family, processor, images=None, videos=None, texts=None):
    texts = texts or [processor.apply_chat_template(_chat(), tokenize=False, **family.chat.template_kwargs)]
    kw = dict(text=texts, return_tensors="pt", padding=True)
    if images is not None:
        kw["images"] = images
    if videos is not None:
        kw["videos"] = videos
        kw["videos_kwargs"] = dict(do_sample_frames=False)
    out = processor(**kw)
    for key in out:  # as vlft keeps them: half-precision outputs in fp32 (Llama 4's bf16 pixels, fp32 weights)
        out[key] = widened(out[key])
    return out


# --- the interface ---------------------------------------------------------------------------------------


def test_every_field_has_help_and_every_family_is_consistent():
    helps = model_family_help()
    assert all(helps.values()), [k for k, v in helps.items() if not v]
    problems = [p for f in FAMILIES for p in check_family(f)]
    assert problems == []
    owned = [t for f in FAMILIES for t in f.model_types]
    assert len(owned) == len(set(owned)), "two families claim one model_type"
    assert set(owned) == {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "smolvlm",
        "idefics3",
        "llava_onevision",
        "glm4v",
        "glm46v",
        "gemma4",
        "paligemma",
        *DECLARED.values(),
    }
    others = {"smolvlm", "idefics3", "llava-onevision", *GLM_NAMES, "gemma4", "paligemma", *DECLARED}
    assert set(NAMES) - set(QWEN) == others


def test_each_model_type_has_its_family():
    assert vm.family_for("qwen3_vl_moe").name == "qwen3-vl-moe"
    assert vm.family_for("qwen3_5").name == "qwen3.5"
    assert vm.family_for("gemma4").name == "gemma4"
    assert vm.family_for("llava") is None
    assert vm.family_for("llava_onevision").name == "llava-onevision"
    assert all(vm.family_for(model_type).name == name for name, model_type in DECLARED.items())
    assert {f.name for f in vm.vlft_model_families()} == set(NAMES)


def test_smart_resize_restated_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        smart_resize as tf_image,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        smart_resize as tf_video,
    )

    for h, w in [(75, 100), (33, 47), (224, 224), (1080, 1920), (31, 900), (4000, 3000), (57, 57)]:
        for factor, lo, hi in [(28, 3136, 12845056), (32, 65536, 16777216), (32, 4096, 128 * 128)]:
            assert fam_mod.smart_resize(h, w, factor, lo, hi) == tf_image(h, w, factor, lo, hi)
            for t in (2, 5, 16):
                assert fam_mod.video_smart_resize_qwen3(t, h, w, 2, factor, lo, hi * 4) == tf_video(
                    t, h, w, 2, factor, lo, hi * 4
                )


# --- per family ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_builds_offline_small_and_of_the_family(tiny, name):
    path, processor, model = tiny[name]
    f = _family(name)
    assert model.config.model_type in f.model_types
    assert type(processor).__name__ == f.chat.processor_class
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert weights < 8e6, f"{name} tiny weights are {weights / 1e6:.1f} MB"
    for dotted in _tower_paths(f):
        resolve_module(model, dotted)
    units = set(f.sharding.no_split_modules) if f.sharding is not None else set(model._no_split_modules)
    assert units <= set(model._no_split_modules)  # None (the declared families): the model class's own
    # the token the model fills with features: the processor's placeholder, but Llama 4's, which it expands into
    # <|patch|> runs between tile separators
    token = "<|patch|>" if name == "llama4" else processor.image_token
    assert processor.tokenizer.convert_tokens_to_ids(token) == model.config.image_token_id
    if name not in QWEN:
        if name != "llava-onevision":  # its sharding units are a subset of the model's set, which lists more
            assert units == set(model._no_split_modules)
        return
    v = _vision(f)
    assert processor.image_processor.patch_size == v.patch_size == f.image_inputs.patch_size
    assert processor.image_processor.merge_size == v.merge_size and f.image_inputs.patches_per_token == v.merge_size**2
    for token in (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END):
        assert token in processor.tokenizer.get_vocab(), token
    assert processor.image_token == IMAGE_PAD and processor.video_token == VIDEO_PAD
    assert processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD) == model.config.image_token_id


@pytest.mark.parametrize("name", QWEN)
def test_processor_round_trips_a_chat_through_the_template(tiny, name):
    _, processor, model = tiny[name]
    f = _family(name)
    prompt = processor.apply_chat_template(
        _chat(False), tokenize=False, add_generation_prompt=True, **f.chat.template_kwargs
    )
    full = processor.apply_chat_template(_chat(), tokenize=False, **f.chat.template_kwargs)
    assert full.startswith(prompt), "prompt and reply must split prefix by prefix (label masking)"
    reply = full[len(prompt) :]
    assert reply.startswith(ANSWER) and reply.rstrip("\n").endswith(processor.tokenizer.eos_token), repr(reply)
    assert f"{VISION_START}{IMAGE_PAD}{VISION_END}" in prompt
    batch = _batch(f, processor, images=[_image(100, 75)])
    ids = batch["input_ids"][0]
    n_image = int((ids == model.config.image_token_id).sum())  # per image against the family's: check_family
    text = processor.tokenizer.decode(ids)
    assert PROMPT in text and ANSWER in text and text.count(IMAGE_PAD) == n_image
    assert torch.equal(
        batch["mm_token_type_ids"][0],
        fam_mod.mm_token_type_ids(ids, model.config.image_token_id, model.config.video_token_id).to(
            batch["mm_token_type_ids"].dtype
        ),
    )


@pytest.mark.parametrize("name", QWEN)
def test_family_token_count_equals_the_processors(tiny, name):
    import numpy as np

    _, processor, model = tiny[name]
    f = _family(name)
    v = _vision(f)
    ip, vp = processor.image_processor, processor.video_processor
    sizes = [(75, 100), (33, 47), (128, 128), (300, 200), (17, 260), (513, 97)]
    images = [_image(w, h) for h, w in sizes]
    batch = processor.image_processor(images=images, return_tensors="pt")
    for (h, w), grid in zip(sizes, batch["image_grid_thw"]):
        got = v.image_tokens(h, w, min_pixels=ip.size["shortest_edge"], max_pixels=ip.size["longest_edge"])
        assert got == int(grid.prod()) // v.merge_size**2, (h, w)
    # at the checkpoints' own budgets too (no override)
    big = processor.image_processor(
        images=[_image(640, 480)],
        size={"shortest_edge": v.image_min_pixels, "longest_edge": v.image_max_pixels},
        return_tensors="pt",
    )
    assert v.image_tokens(480, 640) == int(big["image_grid_thw"][0].prod()) // v.merge_size**2
    assert tuple(f.image_inputs.grid(480, 640)) == tuple(int(x) for x in big["image_grid_thw"][0])
    for frames, h, w in [(6, 70, 90), (5, 33, 130)]:
        clip = np.zeros((frames, h, w, 3), dtype=np.uint8)
        out = vp(videos=[clip], do_sample_frames=False, return_tensors="pt")
        got = f.video_inputs.grid(frames, h, w, min_pixels=vp.size["shortest_edge"], max_pixels=vp.size["longest_edge"])
        assert tuple(got) == tuple(int(x) for x in out["video_grid_thw"][0]), (frames, h, w)


@pytest.mark.parametrize("name", NAMES)
def test_check_family_passes_on_each_tiny_model(tiny, name, tmp_path):
    """vlft.testing.check_family, as a third party's tests call it: targets found, image tokens per image equal
    the processor's, the rope index equals the model's own positions, packed and padded losses equal, the
    adapter reloads with plain PEFT to the same logits, a 2-step run on mixed text-only and image data.
    Only what a family declares it lacks is skipped."""
    from vlft.testing import check_family

    # the folder built above: no second tiny build
    report = check_family(str(tiny[name][0]), tmp_path, skip=SKIPS.get(name))
    assert "(plugin models)" in report.family, report.family
    skipped = {c.name: c.detail for c in report.of("skipped")}
    refusal = _family(name).packing.refusal
    expected = {"packing": f"the family refuses packing: {refusal}"} if refusal else {}
    expected.update(SKIPS.get(name, {}))
    if _family(name).positions is None:  # SmolVLM, Idefics3, LLaVA-OneVision, Gemma 4: plain 1-D positions
        expected["positions"] = "the family has no positions (plain 1-D positions, which the model computes alone)"
    assert skipped == expected, str(report)


@pytest.mark.parametrize("name", QWEN)
def test_rope_index_of_a_video_gives_the_positions_the_model_computes(tiny, name):
    """Images and text-only samples: check_family's positions check; a clip here (the mixed data has none)."""
    import numpy as np

    _, processor, model = tiny[name]
    f = _family(name)
    captured = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: captured.append(kwargs["position_ids"]), with_kwargs=True
    )
    try:
        clip = np.random.RandomState(0).randint(0, 255, (6, 70, 90, 3), dtype=np.uint8)
        vchat = [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
        ]
        vbatch = _batch(
            f,
            processor,
            videos=[clip],
            texts=[processor.apply_chat_template(vchat, tokenize=False, **f.chat.template_kwargs)],
        )
        with torch.no_grad():
            model(**vbatch)
    finally:
        hook.remove()
    (vinternal,) = captured
    rope_index = f.positions.rope_index.rope_index  # the class's own, with an attention mask for the padding
    mine = rope_index(
        model.config,
        vbatch["input_ids"][0],
        video_grid_thw=vbatch["video_grid_thw"],
        attention_mask=vbatch["attention_mask"][0],
        second_per_grid_ts=vbatch.get("second_per_grid_ts"),
    )
    assert torch.equal(mine[:, 0], vinternal[-3:, 0])
    assert int(mine.max()) < vbatch["input_ids"].shape[1], "mRoPE compresses vision positions"


@pytest.mark.parametrize("name", NAMES)
def test_lora_on_default_targets_trains_every_adapter_weight_and_no_router(tiny, name):
    """Saving and loading with plain PEFT: check_family's adapter check."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    path, processor, _ = tiny[name]
    f = _family(name)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path)
    experts = f.experts is not None
    targets = select_target_modules(model, f, "auto", 2, experts=experts)
    assert targets.vision_blocks == [targets.vision_depth - 2, targets.vision_depth - 1]
    names = set(targets.modules)
    assert not any("merger" in n for n in names), "mergers (deepstack included) are not default targets"
    assert not any(n.startswith(m + ".") for m in f.towers.vision_mergers for n in names), "nor are projectors"
    assert all(isinstance(resolve_module(model, n), torch.nn.Linear) for n in names)
    if f.targets.text_linear_attention:  # Qwen3.5: both layer kinds adapted, the per-head gates not
        assert any(".linear_attn.in_proj_qkv" in n for n in names) and any(".self_attn.q_proj" in n for n in names)
        assert not any(n.endswith(("in_proj_a", "in_proj_b")) for n in names)
    routers = frozen_router_parameters(model, f)
    assert bool(routers) == experts
    assert not any(n.rsplit(".", 1)[0] in names for n in routers)

    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=sorted(names),
            target_parameters=targets.parameters or None,
        ),
    )
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), "only adapter weights train (routers frozen)"
    if experts:
        assert any("experts" in n for n in trainable)
    batch = _batch(f, processor, images=[_image(64, 64)])
    batch.pop("labels", None)  # PaliGemma's processor gives labels of its own (all -100 without a suffix=)
    labels = batch["input_ids"].clone()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=5e-3)
    losses, missing = [], None
    for step in range(6):
        loss = peft_model(**batch, labels=labels).loss
        loss.backward()
        if step == 1:  # LoRA B starts at zero, so A's gradient is zero on step 0 by construction
            missing = [
                n
                for n, p in peft_model.named_parameters()
                if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)
            ]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert missing == [], missing[:5]
    assert losses[-1] < 0.8 * losses[0], losses


# --- LLaVA-OneVision: any-resolution tiles, its own image inputs ---------------------------------------------

LLAVA_OV = "llava-onevision"
# one image: wide, tall, square, smaller than a tile, larger than the largest pinpoint; several: each 1 tile
LLAVA_SIZES = [
    [(100, 75)],
    [(60, 130)],
    [(112, 112)],
    [(20, 90)],
    [(300, 40)],
    [(60, 130), (47, 33)],
    [(112, 112), (28, 96), (64, 64)],
]


def _llava_written(processor, sizes, images=True, max_pixels=None):
    from vlft.contracts.family import Media

    f = _family(LLAVA_OV)
    chat = [
        {"role": "user", "content": [{"type": "image"}] * len(sizes) + [{"type": "text", "text": PROMPT}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
    ]
    text = processor.apply_chat_template(chat, tokenize=False)
    media = Media(list(sizes), [_image(w, h) for w, h in sizes] if images else None)
    prepared = f.image_inputs.prepare(processor, media, max_pixels)
    return text, f.image_inputs.write(processor, [text], prepared)


def test_llava_onevision_chat_splits_at_the_reply_and_ends_it_with_im_end(tiny):
    _, processor, _ = tiny[LLAVA_OV]
    f = _family(LLAVA_OV)
    prompt = processor.apply_chat_template(_chat(False), tokenize=False, add_generation_prompt=True)
    full = processor.apply_chat_template(_chat(), tokenize=False)
    assert full.startswith(prompt) and full[len(prompt) :].startswith(ANSWER)
    reply_end = f.chat.reply_end_token
    assert full[len(prompt) :].rstrip("\n").endswith(reply_end) and reply_end == "<|im_end|>"
    assert prompt.count(processor.image_token) == 1


@pytest.mark.parametrize("sizes", LLAVA_SIZES, ids=lambda s: "+".join(f"{w}x{h}" for w, h in s))
def test_llava_onevision_image_tokens_and_tiles_equal_the_processors_and_the_models(tiny, sizes):
    """The family's ids equal LlavaOnevisionProcessor's for the whole conversation (a record of several images
    is tiled as several: one tile, (S/p)^2 + 1 tokens each); measured from the sizes alone, the same; each
    image's grid (tiles, S/p, S/p) has the tiles the model cuts out of pixel_values for it."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    _, processor, model = tiny[LLAVA_OV]
    text, written = _llava_written(processor, sizes)
    own = processor(text=[text], images=[[_image(w, h) for w, h in sizes]], return_tensors="pt")
    assert written.ids[0] == own["input_ids"][0].tolist()
    assert _llava_written(processor, sizes, images=False)[1].ids == written.ids
    assert torch.equal(written.inputs["pixel_values"], own["pixel_values"])
    assert written.inputs["batch_num_images"].tolist() == [len(sizes)]
    side = model.config.vision_config.image_size
    tiles = [
        image_size_to_num_patches((h, w), model.config.image_grid_pinpoints, side) if len(sizes) == 1 else 1
        for w, h in sizes
    ]
    per_side = side // model.config.vision_config.patch_size
    assert written.grids == [(t, per_side, per_side) for t in tiles]
    with torch.no_grad():  # the model takes them: one feature per image token
        model(input_ids=torch.tensor(written.ids), **written.inputs)


def test_llava_onevision_image_tokens_past_anyres_max_9_are_downsampled_as_the_processor_counts(tiny):
    """Pinpoints up to 4 x 4 tiles (16 > anyres_max_9's 9): the model interpolates the tiles' features down and
    the processor counts fewer tokens; the family's write agrees with both (the tiny recipe's 2 x 2 never gets
    there, a real checkpoint's 6 x 6 does)."""
    _, processor, model = tiny[LLAVA_OV]
    side = model.config.vision_config.image_size
    big = [[side * i, side * j] for i in range(1, 5) for j in range(1, 5)]
    saved = processor.image_processor.image_grid_pinpoints, model.config.image_grid_pinpoints
    processor.image_processor.image_grid_pinpoints = model.config.image_grid_pinpoints = big
    try:
        for sizes in ([(224, 224)], [(230, 100)], [(90, 300)]):
            text, written = _llava_written(processor, sizes)
            own = processor(text=[text], images=[[_image(w, h) for w, h in sizes]], return_tensors="pt")
            assert written.ids[0] == own["input_ids"][0].tolist(), sizes
            with torch.no_grad():
                model(input_ids=torch.tensor(written.ids), **written.inputs)
        _, square = _llava_written(processor, [(224, 224)])
        assert square.grids == [(17, 4, 4)]  # 4 x 4 tiles + the base
        # 16 x 16 features over 9 x 16 allowed: ratio 4/3, so 12 x 12 + 12 newlines, after the base tile's 16
        assert square.ids[0].count(model.config.image_token_id) == 16 + 12 * 12 + 12
    finally:
        processor.image_processor.image_grid_pinpoints, model.config.image_grid_pinpoints = saved


def test_llava_onevision_max_pixels_scales_an_image_down_to_fewer_tiles_and_tokens(tiny):
    _, processor, _ = tiny[LLAVA_OV]
    f = _family(LLAVA_OV)
    assert f.image_inputs.size_cap
    _, full = _llava_written(processor, [(112, 112)])
    _, capped = _llava_written(processor, [(112, 112)], max_pixels=56 * 56)
    assert capped.grids == [(2, 4, 4)] and full.grids == [(5, 4, 4)]  # the 56 x 56 pinpoint: 1 tile + the base
    text, _ = _llava_written(processor, [(56, 56)])
    own = processor(text=[text], images=[[_image(56, 56)]], return_tensors="pt")  # what the model sees
    assert capped.ids[0] == own["input_ids"][0].tolist() and len(capped.ids[0]) < len(full.ids[0])
    assert _llava_written(processor, [(112, 112)], images=False, max_pixels=56 * 56)[1].ids == capped.ids


def test_llava_onevision_batch_of_different_tile_counts_gives_each_sample_its_own_logits(tiny):
    """A 5-tile image beside a record of two 1-tile images, joined 'concat_padded' (pixel_values padded with zero
    tiles): each sample's logits in the padded batch are those it gets alone; and batch_num_images must reach the
    model (without it the model tiles the two-image record's images as single ones: features != tokens)."""
    from vlft.data.batching import collator_for, model_inputs

    _, processor, model = tiny[LLAVA_OV]
    f = _family(LLAVA_OV)
    samples = []
    for sizes in ([(100, 75)], [(60, 130), (47, 33)]):
        _, w = _llava_written(processor, sizes)
        ids = torch.tensor(w.ids[0])
        samples.append({"input_ids": ids, "labels": ids.clone(), **w.inputs})
    assert samples[0]["pixel_values"].shape[1] == 5 and samples[1]["pixel_values"].shape[1] == 1
    batch = collator_for(processor, f)(samples)
    assert batch["pixel_values"].shape[:2] == (3, 5) and not batch["pixel_values"][1:, 1:].any()
    model.eval()
    with torch.no_grad():
        together = model(**model_inputs(batch)).logits
        for i, s in enumerate(samples):
            alone = model(**model_inputs(collator_for(processor, f)([s]))).logits[0]
            n = len(s["input_ids"])
            assert torch.allclose(together[i, :n], alone, atol=1e-5), i
        without = {k: v for k, v in model_inputs(batch).items() if k != "batch_num_images"}
        with pytest.raises(Exception, match="do not match|tokens"):
            model(**without)


@pytest.mark.parametrize("modality", ["image", "video"])
def test_llava_onevision_vision_dummy_runs_the_tower_and_reaches_every_vision_block(tiny, modality):
    """The blank image through get_image_features, the blank frame through get_video_features: either reaches
    every vision adapter, so a process without that modality's pixels uses the same parameters."""
    from peft import LoraConfig, get_peft_model

    path, _, _ = tiny[LLAVA_OV]
    from transformers import AutoModelForImageTextToText

    f = _family(LLAVA_OV)
    model = AutoModelForImageTextToText.from_pretrained(path)
    targets = select_target_modules(model, f, "vision", 10)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=targets.modules, init_lora_weights=False))
    warmup = f.vision_dummy(peft_model, modality)
    out = getattr(warmup.module, warmup.method)(**warmup.inputs)
    sum(t.sum() for t in out.pooler_output).backward()
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trained and all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in peft_model.named_parameters() if p.requires_grad
    )


def test_llava_onevision_memory_plan_traces_every_tile_through_the_siglip_layers(tiny):
    """The plan's vision activations: the family's tracer runs the SigLIP layers on every tile of every image
    ((tiles, S/p, S/p) grids), so twice the tiles save more, and nothing is left untraced."""
    from vlft.planning.trace import BatchShape, skeleton, trace_activations
    from vlft.policies import AttentionPolicy

    _, _, model = tiny[LLAVA_OV]
    f = _family(LLAVA_OV)
    traced = {}
    for attention in ("eager", "sdpa"):
        sk = skeleton(model.config, AttentionPolicy(attention, attention), torch.float32)
        for name, p in sk.named_parameters():  # as an adapter on the vision blocks would: the tower on the path
            p.requires_grad_(".encoder.layers." in name)
        for tiles in (5, 10):
            acts = trace_activations(sk, BatchShape(1, 120, [(tiles, 4, 4)]), f)
            assert acts.untraced == []
            traced[attention, tiles] = acts.full
        text_only = trace_activations(sk, BatchShape(1, 120, []), f).full
        assert text_only < traced[attention, 5] < traced[attention, 10], (attention, text_only, traced)


def test_llava_onevision_dry_run_plans_its_images_tiles_and_max_pixels_cuts_them(small_data, tmp_path):
    """`vlft run --dry-run` (the plan) on the embedded model: the largest batch's images with their tiles' patches
    (5 tiles of 4 x 4 for a 112 px demo image), no vision activations left untraced; --max-pixels 3136 (56 x 56)
    plans 2 tiles an image and fewer tokens."""
    from helpers import cli_invoke

    train, val = small_data
    plans = {}
    for cap in (None, 3136):
        args = [
            "run",
            "--model",
            "embedded:llava-onevision",
            "--backend",
            "cpu",
            "--data",
            str(train),
            "--val-data",
            str(val),
            "--output",
            str(tmp_path / str(cap)),
            "--batch-size",
            "2",
            "--dry-run",
            "--json",
        ]
        code, output = cli_invoke(*args, *(["--max-pixels", str(cap)] if cap else []))
        assert code == 0, output
        plans[cap] = json.loads(output[output.index("{") :])
    batch = plans[None]["memory"]["batch"]
    assert batch["images"] == 2 and batch["image_patches"] == 2 * 5 * 16, batch
    assert not any("not traced" in n for n in plans[None]["notes"]), plans[None]["notes"]
    capped = plans[3136]["memory"]["batch"]
    assert capped["image_patches"] == 2 * 2 * 16 and capped["tokens_per_sample"] < batch["tokens_per_sample"]


# --- GLM-4.1V / GLM-4.6V: the processor writes the image tokens, the template leaves replies open -------------


@pytest.mark.parametrize("name", GLM_NAMES)
def test_glm_tiny_model_builds_offline_small_and_of_the_family(tiny, name):
    from vlft_models import glm4v

    path, processor, model = tiny[name]
    f = _family(name)
    assert model.config.model_type in f.model_types and type(processor).__name__ == f.chat.processor_class
    ip = processor.image_processor
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (glm4v.PATCH, glm4v.MERGE, glm4v.TEMPORAL)
    assert f.image_inputs.patch_size == glm4v.PATCH and f.image_inputs.patches_per_token == glm4v.MERGE**2
    assert sum(p.stat().st_size for p in path.glob("*.safetensors")) < 8e6
    for dotted in _tower_paths(f):
        resolve_module(model, dotted)
    assert set(f.sharding.no_split_modules) == set(model._no_split_modules)
    assert processor.image_token == "<|image|>"
    assert processor.tokenizer.convert_tokens_to_ids("<|image|>") == model.config.image_token_id
    stops = {processor.tokenizer.convert_tokens_to_ids(t) for t in glm4v.STOP_TOKENS}
    assert set(model.generation_config.eos_token_id) == stops
    assert processor.tokenizer.convert_tokens_to_ids(f.chat.reply_end_token) in stops


@pytest.mark.parametrize("name", GLM_NAMES)
def test_glm_replies_are_trained_to_end_with_the_next_turns_role_token(tiny, name):
    """The template leaves a reply open; the encoder trains <|user|> as its last token: in a 2-turn record the
    ids equal the processor's for the template's render (the first reply's end is the next turn's start), and
    the last reply gets it appended."""
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import Record, Turn

    _, processor, model = tiny[name]
    f = _family(name)
    prompt = processor.apply_chat_template(_chat(False), tokenize=False, add_generation_prompt=True)
    full = processor.apply_chat_template(_chat(), tokenize=False)
    assert full.startswith(prompt) and full[len(prompt) :] == ANSWER, "GLM's template writes no reply end"
    assert "<|begin_of_image|><|image|><|end_of_image|>" in prompt
    turns = [
        Turn("user", "What colour is the product?"),
        Turn("assistant", "red"),
        Turn("user", "What defect does the product have?"),
        Turn("assistant", "a scratch"),
    ]
    encoder = SampleEncoder(processor, family=f)
    pieces = encoder.pieces(turns)
    assert [trained for _, trained in pieces] == [False, True, False, True]
    assert pieces[1][0] == "red<|user|>" and pieces[3][0] == "a scratch<|user|>"
    sample = encoder.encode(Record(turns=turns, images=[], where="t:1"))
    ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
    user = processor.tokenizer.convert_tokens_to_ids("<|user|>")
    rendered = encoder.render(turns, add_generation_prompt=False)
    assert ids == processor.tokenizer(rendered)["input_ids"] + [user]
    assert ids[-1] == labels[-1] == user
    assert sum(1 for i, label in zip(ids, labels) if i == user and label == user) == 2  # each reply's end, trained


@pytest.mark.parametrize("name", GLM_NAMES)
def test_glm_grid_and_max_pixels_equal_the_processors(tiny, name):
    """The restated resize rule equals transformers'; the family's grid equals the processor's at the tiny and
    the class-default budgets; under --max-pixels the encoder's images have at most that many pixels and the
    grid the plan uses is theirs."""
    from transformers.models.glm4v.image_processing_glm4v import smart_resize as tf_resize

    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import Record, Turn
    from vlft_models import glm4v

    _, processor, _ = tiny[name]
    f = _family(name)
    ip = processor.image_processor
    sizes = [(75, 100), (33, 47), (128, 128), (300, 200), (17, 260), (513, 97), (1080, 1920)]
    for h, w in sizes:
        for lo, hi in [(glm4v.IMAGE_MIN_PIXELS, glm4v.IMAGE_MAX_PIXELS), (6272, 25088), (100, 2 * 200 * 200)]:
            assert glm4v.smart_resize(2, h, w, 2, 28, lo, hi) == tf_resize(2, h, w, 2, 28, lo, hi), (h, w, lo, hi)
    images = [_image(w, h) for h, w in sizes]
    tiny_grids = ip(images=images, return_tensors="pt")["image_grid_thw"]
    default = ip(
        images=images,
        size={"shortest_edge": glm4v.IMAGE_MIN_PIXELS, "longest_edge": glm4v.IMAGE_MAX_PIXELS},
        return_tensors="pt",
    )["image_grid_thw"]
    for (h, w), small, big in zip(sizes, tiny_grids, default):
        assert glm4v.image_grid(h, w, ip.size["shortest_edge"], ip.size["longest_edge"]) == tuple(small.tolist())
        assert tuple(f.image_inputs.grid(h, w)) == tuple(big.tolist())
    cap = 56 * 84
    turns = [Turn("user", "<image>\nWhat colour is the product?"), Turn("assistant", "red")]
    for h, w in [(300, 200), (75, 100)]:
        path = tiny[name][0].parent / f"{name}-{w}x{h}.png"
        _image(w, h).save(path)
        record = Record(turns=turns, images=[str(path)], where="t:1")
        sample = SampleEncoder(processor, max_pixels=cap, family=f).encode(record)
        t, gh, gw = sample["image_grid_thw"][0].tolist()
        assert gh * gw * glm4v.PATCH**2 <= cap
        assert (t, gh, gw) == f.image_inputs.grid(h, w, cap)
        n = int((sample["input_ids"] == processor.image_token_id).sum())
        assert n == gh * gw // glm4v.MERGE**2


# --- Gemma 4: its processor writes the image tokens; its own numbers ------------------------------------------------


def test_gemma4_tiny_model_and_template():
    """The tiny Gemma 4: images and text (no audio tower), the family's paths and no-split classes, the turn
    format <|turn>role ... <turn|>, a reply that ends with <turn|> (eos is <eos>), and the batch inputs the
    processor returns are exactly the ones the family declares, with mm_token_type_ids 1 on the image tokens."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlft_models import gemma4

    f = gemma4.FAMILY
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        gemma4.build_tiny(Path(tmp) / "g4")
        processor = AutoProcessor.from_pretrained(Path(tmp) / "g4")
        model = AutoModelForImageTextToText.from_pretrained(Path(tmp) / "g4")
        weights = sum(p.stat().st_size for p in (Path(tmp) / "g4").glob("*.safetensors"))
    assert weights < 8e6 and model.model.audio_tower is None
    assert type(processor).__name__ == f.chat.processor_class and model.config.model_type in f.model_types
    for dotted in _tower_paths(f):
        resolve_module(model, dotted)
    assert set(f.sharding.no_split_modules) == set(model._no_split_modules)
    prompt = processor.apply_chat_template(_chat(False), tokenize=False, add_generation_prompt=True)
    full = processor.apply_chat_template(_chat(), tokenize=False)
    assert full.startswith(prompt) and prompt.endswith("<|turn>model\n") and "<|turn>user\n<|image|>" in prompt
    reply = full[len(prompt) :]
    assert reply.startswith(ANSWER) and reply.rstrip("\n").endswith(f.chat.reply_end_token)
    assert processor.tokenizer.eos_token not in reply
    batch = processor(text=[full], images=[[_image(100, 75)]], return_tensors="pt")
    video = {"pixel_values_videos", "video_position_ids", "num_frames_per_video"}  # a clip's, absent for an image
    inputs = set(f.image_inputs.batch_inputs)
    assert (
        video <= inputs and set(batch) - {"input_ids", "attention_mask", "num_soft_tokens_per_image"} == inputs - video
    )
    ids = batch["input_ids"][0]
    assert torch.equal(batch["mm_token_type_ids"][0], (ids == model.config.image_token_id).long())
    with torch.no_grad():
        assert torch.isfinite(model(**batch, labels=batch["input_ids"]).loss)
        # the tiny tower tells colours apart (with transformers' all-ones position table it did not: cosine 0.997)
        red, blue = (
            processor.image_processor(images=[_image(64, 64, c)], return_tensors="pt")
            for c in ((200, 30, 30), (30, 30, 200))
        )
        red, blue = (
            model.model.get_image_features(b["pixel_values"], b["image_position_ids"]).pooler_output[0].mean(0)
            for b in (red, blue)
        )
    assert float(torch.nn.functional.cosine_similarity(red, blue, dim=0)) < 0.9


def test_gemma4_token_counts_and_max_pixels_equal_the_processors():
    """The family's grid (restating the processor's aspect-preserving resize) gives each image's soft tokens as
    the processor writes them, at the checkpoint's numbers (patch 16, pooling 3, 280) and at each --max-pixels
    budget; a cap below the smallest budget is refused naming it."""
    from transformers import Gemma4ImageProcessor

    from vlft.errors import ConfigError
    from vlft_models import gemma4

    ip = Gemma4ImageProcessor()  # the checkpoints' class defaults
    assert (ip.patch_size, ip.pooling_kernel_size, ip.max_soft_tokens) == (
        gemma4.PATCH_SIZE,
        gemma4.POOLING,
        gemma4.MAX_SOFT_TOKENS,
    )
    sizes = [(75, 100), (33, 47), (128, 128), (300, 200), (17, 260), (513, 97), (480, 640)]
    for cap in (None, 16 * 16 * 9 * 70, 16 * 16 * 9 * 600, 10**8):
        budget = gemma4.soft_token_budget(cap, 16, 3, 280)
        out = ip(images=[_image(w, h) for h, w in sizes], max_soft_tokens=budget, return_tensors="pt")
        for (h, w), n, pos in zip(sizes, out["num_soft_tokens_per_image"], out["image_position_ids"]):
            t, gh, gw = gemma4.grid(h, w, cap)
            real = pos[(pos != -1).all(-1)]
            assert (gh, gw) == (int(real[:, 1].max()) + 1, int(real[:, 0].max()) + 1), (h, w, cap)
            assert gh * gw // gemma4.POOLING**2 == int(n), (h, w, cap)
    assert gemma4.soft_token_budget(16 * 16 * 9 * 600, 16, 3, 280) == 280  # never above the processor's own
    assert gemma4.soft_token_budget(16 * 16 * 9 * 150, 16, 3, 280) == 140
    with pytest.raises(ConfigError, match="smallest image budget is 70"):
        gemma4.soft_token_budget(100_000, 16, 3, 280)


def test_gemma4_max_pixels_reaches_the_processor(tmp_path):
    """--max-pixels through the sample encoder: the image tokens the processor writes shrink with the budget."""
    from transformers import AutoProcessor, Gemma4ImageProcessor

    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.testing import tiny_dataset
    from vlft_models import gemma4

    gemma4.build_tiny(tmp_path / "g4")
    processor = AutoProcessor.from_pretrained(tmp_path / "g4")
    big = Gemma4ImageProcessor(patch_size=4, pooling_kernel_size=3, max_soft_tokens=280)
    processor.image_processor = big
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image|>")
    train, _ = tiny_dataset(tmp_path / "data", n_train=2, n_val=1)
    record = read_records(train)[0]
    counts = {}
    for cap in (None, 4 * 4 * 9 * 140, 4 * 4 * 9 * 70):
        sample = SampleEncoder(processor, max_pixels=cap, family=gemma4.FAMILY).encode(record)
        counts[cap] = int((torch.as_tensor(sample["input_ids"]) == image_id).sum())
        assert sample["pixel_values"].shape[1] == gemma4.soft_token_budget(cap, 4, 3, 280) * 9
    assert counts[None] > counts[4 * 4 * 9 * 140] > counts[4 * 4 * 9 * 70] > 0, counts


# --- bundled planning configs -------------------------------------------------------------------------------

PUBLISHED = {k: v for k, v in json.loads((vm.CONFIGS / "published.json").read_text()).items() if not k.startswith("_")}


def test_every_bundled_config_has_a_published_count_and_a_family_owning_its_model_type():
    """Each config folder that ships, read for its ``model_type``: a family owns that model_type, so `vlft
    plugins` lists it under that family (one source: the hook's folders, no family field beside it)."""
    dirs = vm.vlft_bundled_model_configs()
    assert set(dirs) == set(PUBLISHED)
    orphans = {
        name: json.loads((folder / "config.json").read_text())["model_type"]
        for name, folder in sorted(dirs.items())
        if vm.family_for(json.loads((folder / "config.json").read_text())["model_type"]) is None
    }
    assert orphans == {}


def test_vlft_plugins_lists_every_bundled_config_under_one_family():
    from helpers import cli_invoke

    code, output = cli_invoke("plugins", "--json")
    assert code == 0, output
    data = json.loads(output)
    listed = [c for f in data["model_families"] for c in f["bundled_configs"]]
    assert sorted(listed) == sorted(data["bundled_configs"]) == sorted(vm.vlft_bundled_model_configs())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bundled_config_counts_within_one_percent_of_published(name):
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = vm.bundled_config_dir(name)
    config = AutoConfig.from_pretrained(folder)
    family = vm.family_for(config.model_type)
    assert family is not None and name.startswith(family.name.split("-moe")[0])
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    counted = sum(p.numel() for p in model.parameters())  # tied weights once
    if PUBLISHED[name]["includes_mtp"]:
        counted += qwen3_5.mtp_parameters(model)
    published = PUBLISHED[name]["params"]
    assert abs(counted - published) / published < 0.01, (counted, published)
    if PUBLISHED[name]["exact"]:
        assert counted == published
    # the planning processor builds from the bundled preprocessor configs with the family's numbers
    ip = json.loads((folder / "preprocessor_config.json").read_text())
    v = _vision(family)
    assert (ip["patch_size"], ip["merge_size"]) == (v.patch_size, v.merge_size)
    size = ip.get("size") or {"shortest_edge": ip["min_pixels"], "longest_edge": ip["max_pixels"]}  # Qwen2.5-VL's
    assert (size["shortest_edge"], size["longest_edge"]) == (v.image_min_pixels, v.image_max_pixels)


# --- the third-party example candidate (Gemma 3), through the same dataclass ------------------------------


def _example_gemma3():
    """The third-party example family (examples/vlft-example-plugin), installed or from its source folder."""
    try:
        from vlft_example_plugin import gemma3
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "vlft-example-plugin"))
        from vlft_example_plugin import gemma3
    return gemma3


def test_example_gemma3_family_trains_through_the_family_alone(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    gemma = _example_gemma3()

    f = gemma.FAMILY
    assert check_family(f) == [] and f.positions is None and f.video_inputs is None
    gemma.build_tiny(tmp_path / "g3")
    processor = AutoProcessor.from_pretrained(tmp_path / "g3")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "g3")
    assert model.config.model_type in f.model_types and set(f.sharding.no_split_modules) <= set(model._no_split_modules)
    prompt = processor.apply_chat_template(_chat(False), tokenize=False, add_generation_prompt=True)
    full = processor.apply_chat_template(_chat(), tokenize=False)
    assert full.startswith(prompt) and full[len(prompt) :].startswith(ANSWER)
    assert f.chat.reply_end_token in full[len(prompt) :] and processor.tokenizer.eos_token not in full[len(prompt) :]
    batch = processor(text=[full], images=[[_image(100, 75)]], return_tensors="pt")
    assert set(batch) - {"input_ids", "attention_mask"} == set(f.image_inputs.batch_inputs)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert int((batch["input_ids"] == image_id).sum()) == model.config.mm_tokens_per_image
    assert torch.equal(batch["token_type_ids"], gemma.token_type_ids(batch["input_ids"], image_id))
    targets = select_target_modules(model, f, "both", 1)
    assert targets.vision_blocks == [targets.vision_depth - 1] and targets.text_layers == 2
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets.modules))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        loss = peft_model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_importing_the_families_imports_neither_torch_nor_transformers():
    import subprocess

    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import importlib.util as u; from pathlib import Path; "
        f"r = Path({str(ROOT)!r}); s = u.spec_from_file_location('vlft_models', r / '__init__.py', "
        "submodule_search_locations=[str(r)]); m = u.module_from_spec(s); sys.modules['vlft_models'] = m; "
        "s.loader.exec_module(m); m.families(); m.family_for('qwen3_vl'); "
        "print(sorted(k for k in ('torch', 'transformers', 'peft') if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_embedded_default_is_the_default_familys_tiny_model(registry):
    """One recipe, owned by its family: ``--model embedded`` is the tiny model of the family a plugin names the
    default (Qwen2.5-VL, whose weights `make run`'s figures come from), the same folder as
    ``--model embedded:qwen2.5-vl``."""
    from vlft.models.embedded import embedded_family_dir, embedded_model_dir
    from vlft.models.families import family_named
    from vlft.models.loading import resolve_model_path

    assert registry.hook.vlft_default_model_family() == "qwen2.5-vl"
    family = family_named(registry, "qwen2.5-vl")
    assert embedded_model_dir(registry) == embedded_family_dir(family)
    assert resolve_model_path(None, registry) == resolve_model_path("embedded:qwen2.5-vl", registry)


def test_without_a_plugin_naming_a_default_family_the_embedded_default_is_an_error_saying_so():
    from vlft.errors import ConfigError
    from vlft.models.embedded import embedded_model_dir
    from vlft.registry import load_registry

    bare = load_registry(load_entry_points=False)
    with pytest.raises(ConfigError, match="no installed plugin names a default model family"):
        embedded_model_dir(bare)


EMBEDDED_DEFAULT_SHA256 = "76d63b531740d67aa19836df0acd455191688634a91f7a3799bbe74eda03cc5e"


def test_the_embedded_defaults_weights_are_bit_identical_to_the_ones_make_run_was_measured_on(tmp_path):
    """The Qwen2.5-VL family's tiny builder, given the demo corpus, writes the weights the embedded default
    has had since recipe version 4 (when vlft/models/embedded.py built it): `make run`'s 0% -> 98% and every
    recorded loss of the default model depend on them, byte for byte."""
    import hashlib

    from vlft.models.embedded import tokenizer_corpus
    from vlft_models.qwen2_vl import build_tiny_2_5

    build_tiny_2_5(tmp_path / "m", corpus=tokenizer_corpus())
    assert hashlib.sha256((tmp_path / "m" / "model.safetensors").read_bytes()).hexdigest() == EMBEDDED_DEFAULT_SHA256


@pytest.mark.parametrize("name", NAMES)
def test_every_built_in_familys_text_model_is_traced_by_the_memory_plan(tiny, name):
    """The plan says a text model it cannot trace is untraced (a checkpoint read generically) rather than stop; no
    built-in family's may be: each one's text layers and head run on the tracer's meta inputs."""
    from vlft.planning.trace import BatchShape, skeleton, trace_activations
    from vlft.policies import AttentionPolicy

    _, _, model = tiny[name]
    family = _family(name)
    load = family.load_kwargs("float32") if family.load_kwargs is not None else None
    sk = skeleton(model.config, AttentionPolicy("sdpa", "sdpa"), torch.float32, load)
    for n, p in sk.named_parameters():  # as adapters on the text layers would: the layers on the path
        p.requires_grad_(n.startswith(family.towers.decoder_layers))
    acts = trace_activations(sk, BatchShape(1, 64, []), family)
    assert not [u for u in acts.untraced if u.startswith("text")], acts.untraced
    assert acts.full > 0
