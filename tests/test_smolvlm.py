"""SmolVLM (and Idefics3): what the Qwen-processor checks of test_families_prep.py do not cover. The processor
splits each image into tiles plus a global image and writes every tile's tokens itself; vlft joins each sample's
``[1, tiles, 3, S, S]`` pixels as ``[tiles, 1, 3, S, S]`` along dim 0 (the core's 'concat'), where the
processor's own batch pads the tile axis with zero images. These tests show the two give the model the same
logits, the family's tile count equals the processor's with and without ``--max-pixels``, the memory plan
traces the tower, and the processor loads without ``num2words`` (a video prompt then says what to install).
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from vlft.models.loading import load_processor
from vlft.registry import load_registry

PROMPT = "What colour is the product?"
ANSWER = "The product is red and has a scratch."


@pytest.fixture(scope="module", params=["smolvlm", "idefics3"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from vlft_models import smolvlm

    registry = load_registry()
    family = next(f for f in smolvlm.FAMILIES if f.name == request.param)
    path = tmp_path_factory.mktemp(request.param) / "tiny"
    family.tiny.build(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return family, load_processor(str(path), family, registry), model


def _image(w, h, colour=(200, 30, 30)):
    return Image.new("RGB", (w, h), colour)


def _record(tmp_path, name, sizes):
    from vlft.data.records import read_records

    images = []
    for k, (w, h) in enumerate(sizes):
        _image(w, h, (40 * k + 30, 200, 60)).save(tmp_path / f"{name}{k}.png")
        images.append(f"{name}{k}.png")
    messages = [
        {"role": "user", "content": "<image>\n" * len(images) + PROMPT},
        {"role": "assistant", "content": ANSWER},
    ]
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps({"messages": messages, "images": images}) + "\n")
    return read_records(path)[0]


def test_image_tokens_per_image_equal_the_processors_with_and_without_max_pixels(tiny):
    from vlft_models import smolvlm

    family, processor, _ = tiny
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    per_tile = processor.image_seq_len
    seen = set()
    for w, h in [(112, 112), (100, 75), (20, 20), (300, 40), (33, 47), (513, 97), (64, 65)]:
        for cap in (None, 32 * 32, 48 * 48, 64 * 64, 10**6):
            kwargs = smolvlm.longest_edge(processor, cap)
            out = processor(text=[text], images=[[_image(w, h)]], return_tensors="pt", **kwargs)
            written = int((out["input_ids"][0] == processor.image_token_id).sum())
            ((tiles, s1, s2),) = smolvlm.image_grids(processor, [(w, h)], cap)
            assert written == tiles * s1 * s2 == tiles * per_tile, (w, h, cap)
            assert out["pixel_values"].shape[1] == tiles, (w, h, cap)
            seen.add(tiles)
    assert seen == {1, 3, 5}, seen  # one tile, 1 x 2 + global, 2 x 2 + global: the cap changes the count
    # what --max-pixels means: the longest edge at the largest whole number of 32 px tiles whose square fits
    # (never below one tile, never above the processor's own 64): 112 px -> 2 x 2 + 1 tiles, or 1
    expected = {None: 5, 31 * 31: 1, 32 * 32: 1, 63 * 63: 1, 64 * 64: 5, 10**6: 5}
    assert {cap: smolvlm.tiles_of(processor, 112, 112, cap) for cap in expected} == expected
    assert smolvlm.longest_edge(processor, 63 * 63) == {"size": {"longest_edge": 32}}
    assert smolvlm.longest_edge(processor, None) == smolvlm.longest_edge(processor, 64 * 64) == {}


def test_max_pixels_lowers_the_tile_count_through_the_encoder_and_measuring_agrees(tiny, tmp_path):
    from vlft.data.encoding import SampleEncoder

    family, processor, _ = tiny
    record = _record(tmp_path, "a", [(112, 112)])
    full = SampleEncoder(processor, family=family).encode(record)
    capped = SampleEncoder(processor, max_pixels=32 * 32, family=family).encode(record)
    image_id = processor.image_token_id
    assert int((full["input_ids"] == image_id).sum()) == 5 * processor.image_seq_len
    assert int((capped["input_ids"] == image_id).sum()) == 1 * processor.image_seq_len
    assert full["pixel_values"].shape[:2] == (5, 1) and capped["pixel_values"].shape[:2] == (1, 1)
    # the length check and the memory plan measure without decoding pixels: the same grids
    for max_pixels, encoded in ((None, full), (32 * 32, capped)):
        tokens, grids = SampleEncoder(processor, max_pixels=max_pixels, family=family).measure(record)
        assert [tuple(g) for g in grids] == [(5 if max_pixels is None else 1, 2, 2)]
        assert tokens == len(encoded["input_ids"])


def test_a_collated_batch_gives_the_logits_of_the_processors_own_padded_batch(tiny, tmp_path):
    """Two samples of 10 and 5 tiles: vlft's [15, 1, 3, S, S] against the processor's [2, 10, 3, S, S] (the second
    sample's last 5 tiles zero padding the model drops). Swapping the samples' tiles changes the logits, so the
    comparison sees the order."""
    from vlft.data.batching import collator_for
    from vlft.data.encoding import SampleEncoder

    family, processor, model = tiny
    records = [_record(tmp_path, "two", [(112, 80), (60, 112)]), _record(tmp_path, "one", [(90, 90)])]
    encoder = SampleEncoder(processor, family=family)
    batch = collator_for(processor, family)([encoder.encode(r) for r in records])
    assert batch["pixel_values"].shape[:2] == (15, 1) and batch["pixel_attention_mask"].shape[:2] == (15, 1)
    own = processor.image_processor(
        images=[[_image(112, 80, (30, 200, 60)), _image(60, 112, (70, 200, 60))], [_image(90, 90, (30, 200, 60))]],
        return_tensors="pt",
    )
    assert own["pixel_values"].shape[:2] == (2, 10) and not own["pixel_values"][1, 5:].any()
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        ours = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"],
            pixel_attention_mask=batch["pixel_attention_mask"],
        ).logits
        theirs = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=own["pixel_values"],
            pixel_attention_mask=own["pixel_attention_mask"],
        ).logits
        order = torch.cat([batch["pixel_values"][10:], batch["pixel_values"][:10]])
        swapped = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=order,
            pixel_attention_mask=batch["pixel_attention_mask"],
        ).logits
    assert (ours[mask] - theirs[mask]).abs().max() < 1e-5
    assert (ours[mask] - swapped[mask]).abs().max() > 1e-3


def test_the_memory_plan_counts_and_traces_the_vision_tower(tmp_path):
    from helpers import cli_invoke

    # data of its own (the checked-data cache is keyed by the data files, not by the family's code)
    code, output = cli_invoke("demo-data", tmp_path / "demo", "--train", "8", "--val", "4")
    assert code == 0, output
    code, output = cli_invoke(
        "run",
        "--model",
        "embedded:smolvlm",
        "--backend",
        "cpu",
        "--dry-run",
        "--json",
        "--data",
        tmp_path / "demo" / "train.jsonl",
        "--val-data",
        tmp_path / "demo" / "val.jsonl",
        "--output",
        tmp_path / "run",
    )
    assert code == 0, output
    plan = json.loads(output[output.index("{") :])
    batch = plan["memory"]["batch"]
    # the demo's 112 px images: 2 x 2 tiles + the global one, 4 merged patches (LLM tokens) each
    assert batch["images"] > 0 and batch["image_patches"] == batch["images"] * 5 * 4
    assert "gives no tracer" not in output and "0 image patches" not in output
    assert plan["memory"]["activation_bytes"] > 0


def test_without_num2words_the_processor_loads_and_a_video_prompt_says_what_is_missing(tiny, monkeypatch):
    """Where ``num2words`` is missing (made so here: vlft's dev extra installs it) the family's processor loads with
    a stand-in, and a video prompt, which spells its frame count in words, is refused as bad data naming the package
    to install (the length check meets it before step 1). Idefics3's processor takes no video and needs none."""
    import numpy as np
    from transformers.models.smolvlm import processing_smolvlm

    from vlft import DataError
    from vlft_models.smolvlm import _allow_without_num2words

    family, processor, _ = tiny
    if family.name == "idefics3":
        assert getattr(processor, "video_processor", None) is None
        return
    monkeypatch.setattr(processing_smolvlm, "num2words", None)
    _allow_without_num2words()
    chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    assert processor.video_token in prompt
    frames = np.full((4, 64, 64, 3), 128, dtype=np.uint8)  # 4 frames at 2 fps
    metadata = {"fps": 2.0, "total_num_frames": 4, "duration": 2.0, "frames_indices": [0, 1, 2, 3]}
    with pytest.raises(DataError, match=r"the `num2words` package, which is not installed: pip install num2words"):
        processor(text=[prompt], videos=[frames], video_metadata=[metadata], return_tensors="pt")
