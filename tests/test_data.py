"""Data formats, image resolution, validation errors, label masking and batching."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import embedded_family
from vlft.data.batching import collator_for
from vlft.data.encoding import SampleEncoder
from vlft.data.records import IGNORE_INDEX, read_records
from vlft.errors import DataError


def _png(path: Path, colour=(200, 30, 30), size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def conv(image="imgs/a.png", user="<image>\nWhat is it?", reply="colour: red"):
    return {"image": image, "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}


def test_conversations_format_with_relative_image_paths(tmp_path):
    _png(tmp_path / "sub" / "imgs" / "a.png")
    path = _jsonl(tmp_path / "sub" / "train.jsonl", [conv()])
    [rec] = read_records(path)
    assert rec.images == [str((tmp_path / "sub" / "imgs" / "a.png").resolve())]
    assert [(t.role, t.text) for t in rec.turns] == [("user", "<image>\nWhat is it?"), ("assistant", "colour: red")]
    assert rec.where == "train.jsonl:1" and rec.reference == "colour: red"


def test_messages_format_as_json_array_with_base64_images(tmp_path):
    raw = _png(None)
    b64 = base64.b64encode(raw).decode()
    records = [
        {
            "messages": [
                {"role": "user", "content": "<image><image>Compare."},
                {"role": "assistant", "content": "same"},
            ],
            "images": ["data:image/png;base64," + b64, b64],
        },
    ]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(records))
    [rec] = read_records(path)
    assert rec.images == [raw, raw] and rec.where == "train.json[0]"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"image": "imgs/a.png", "conversations": [', "train.jsonl:2: invalid JSON"),
        (conv(image="imgs/missing.png"), "train.jsonl:2: image 'imgs/missing.png' not found"),
        (conv(user="no placeholder"), "train.jsonl:2: 0 <image> placeholder(s) but 1 image(s)"),
        (
            {"image": "imgs/a.png", "conversations": [{"from": "human", "value": "<image>hi"}]},
            "train.jsonl:2: no assistant turn",
        ),
        (
            {
                "image": "imgs/a.png",
                "conversations": [{"from": "robot", "value": "<image>hi"}, {"from": "gpt", "value": "x"}],
            },
            "train.jsonl:2: turn 0: unknown role 'robot'",
        ),
        (conv(image="imgs/broken.png"), "train.jsonl:2: image 'imgs/broken.png' cannot be read"),
        ({"text": "hello"}, "train.jsonl:2: record has neither 'conversations' nor 'messages'"),
    ],
)
def test_bad_records_are_named_by_file_and_line(tmp_path, line, message):
    _png(tmp_path / "imgs" / "a.png")
    (tmp_path / "imgs" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    path = _jsonl(tmp_path / "train.jsonl", [conv(), line])
    with pytest.raises(DataError) as err:
        read_records(path)
    assert message in str(err.value)
    assert "nothing was written" in str(err.value)


def test_every_problem_is_reported_at_once(tmp_path):
    _png(tmp_path / "imgs" / "a.png")
    path = _jsonl(tmp_path / "t.jsonl", [conv(image="imgs/x.png"), conv(), conv(user="none")])
    with pytest.raises(DataError, match=r"2 problem\(s\)") as err:
        read_records(path)
    assert "t.jsonl:1:" in str(err.value) and "t.jsonl:3:" in str(err.value)


def _multi_turn(tmp_path) -> Path:
    _png(tmp_path / "imgs" / "a.png")
    _png(tmp_path / "imgs" / "b.png", colour=(20, 20, 200), size=(84, 56))
    rec = {
        "images": ["imgs/a.png", "imgs/b.png"],
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "user", "value": "<image>\nColour?"},
            {"from": "assistant", "value": "red"},
            {"from": "user", "value": "And this one? <image>"},
            {"from": "assistant", "value": "blue, and larger"},
        ],
    }
    return _jsonl(tmp_path / "multi.jsonl", [rec])


def test_labels_cover_exactly_the_assistant_replies_token_by_token(tmp_path, processor):
    [rec] = read_records(_multi_turn(tmp_path))
    enc = SampleEncoder(processor, embedded_family())
    out = enc.encode(rec)
    ids, labels = out["input_ids"].tolist(), out["labels"].tolist()
    tok = processor.tokenizer
    trained = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
    # labels equal the ids where trained
    assert all(labels[i] == ids[i] for i in trained)
    # the trained tokens form exactly two runs: each reply followed by the end-of-turn token
    runs, current = [], [trained[0]]
    for i in trained[1:]:
        if i == current[-1] + 1:
            current.append(i)
        else:
            runs.append(current)
            current = [i]
    runs.append(current)
    texts = [tok.decode([ids[i] for i in run]) for run in runs]
    assert texts == ["red<|im_end|>", "blue, and larger<|im_end|>"]
    # and every other token (system, prompts, image pads, the trailing newline) is masked
    untrained = tok.decode([ids[i] for i in range(len(ids)) if labels[i] == IGNORE_INDEX])
    assert "Be brief." in untrained and "Colour?" in untrained and "assistant" in untrained
    assert "red" not in untrained and "blue" not in untrained


def test_encoding_matches_the_processor_on_the_whole_conversation(tmp_path, processor):
    [rec] = read_records(_multi_turn(tmp_path))
    enc = SampleEncoder(processor, embedded_family())
    out = enc.encode(rec)
    full_text = enc.render(rec.turns, add_generation_prompt=False)
    from vlft.data.records import load_image

    ref = processor(text=[full_text], images=[load_image(s) for s in rec.images], return_tensors="pt")
    assert torch.equal(out["input_ids"], ref["input_ids"][0])
    assert torch.equal(out["pixel_values"], ref["pixel_values"])
    assert torch.equal(out["image_grid_thw"], ref["image_grid_thw"])


def test_batches_pad_to_their_own_longest_sample(small_data, processor):
    enc = SampleEncoder(processor, embedded_family())
    records = read_records(small_data[0])[:3]
    samples = [enc.encode(r) for r in records]
    samples[1]["input_ids"] = samples[1]["input_ids"][:-2]
    samples[1]["labels"] = samples[1]["labels"][:-2]
    col = collator_for(processor, embedded_family())
    batch = col(samples)
    longest = max(len(s["input_ids"]) for s in samples)
    assert batch["input_ids"].shape == (3, longest)
    assert batch["attention_mask"][1].sum() == longest - 2
    assert (batch["labels"][1, -2:] == IGNORE_INDEX).all()
    assert batch["mm_token_type_ids"].sum() == (batch["input_ids"] == processor.image_token_id).sum() > 0
    left = collator_for(processor, embedded_family(), padding_side="left")(samples)
    assert left["attention_mask"][1, :2].sum() == 0


def test_max_pixels_caps_the_image_tokens(small_data, processor):
    rec = read_records(small_data[0])[0]
    full = SampleEncoder(processor, embedded_family()).encode(rec)
    capped = SampleEncoder(processor, embedded_family(), max_pixels=56 * 56).encode(rec)
    assert int(full["image_grid_thw"].prod()) == 64  # 112x112 -> 8x8 patches
    assert int(capped["image_grid_thw"].prod()) == 16  # 56x56 -> 4x4 patches
    assert len(capped["input_ids"]) == len(full["input_ids"]) - 12


def test_without_validation_data_a_seeded_tenth_is_held_out(tmp_path, processor):
    from vlft.config import RunConfig
    from vlft.data.demo import write_demo_dataset
    from vlft.planning.preflight import load_and_check_data

    ds = write_demo_dataset(tmp_path / "demo", n_train=40, n_val=1, seed=2)
    everything = [r.where for r in read_records(ds.train)]
    enc = SampleEncoder(processor, embedded_family())

    def split(seed):
        train, val, _ = load_and_check_data(RunConfig(data=str(ds.train), seed=seed), enc)
        return [r.where for r in train], [r.where for r in val]

    train, val = split(0)
    assert len(val) == 4 and len(train) == 36  # 10% of 40
    assert sorted(train + val) == sorted(everything) and not set(train) & set(val)
    assert train == [w for w in everything if w not in val]  # the training records keep the file's order
    assert split(0) == (train, val)  # the same seed holds out the same records
    others = [set(split(seed)[1]) for seed in (1, 2, 3)]
    assert all(o != set(val) for o in others) and len({frozenset(o) for o in others}) == 3  # seeded, not fixed


def test_weighted_copies_never_land_in_both_the_training_set_and_the_hold_out(tmp_path, processor):
    """``FILE:3`` without a validation file: the 10% hold-out is drawn from the file's records, then the rest
    is weighted; a record held out has no copy among the training records."""
    from vlft.config import RunConfig
    from vlft.data.demo import write_demo_dataset
    from vlft.planning.preflight import load_and_check_data

    ds = write_demo_dataset(tmp_path / "demo", n_train=40, n_val=1, seed=2)
    train, val, _ = load_and_check_data(
        RunConfig(data=[f"{ds.train}:3"], seed=0), SampleEncoder(processor, embedded_family())
    )
    held, trained = {r.where for r in val}, [r.where for r in train]
    assert len(held) == len(val) == 4 and not held & set(trained)
    assert len(trained) == 3 * 36 and all(trained.count(w) == 3 for w in set(trained))


def test_an_axolotl_base64_image_part_is_read_and_a_part_without_a_source_names_its_keys(tmp_path):
    import base64
    import io
    import json

    from PIL import Image

    from vlft.errors import DataError

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    raw = buf.getvalue()

    def rec(part):
        return {
            "messages": [
                {"role": "user", "content": [part, {"type": "text", "text": "Which colour?"}]},
                {"role": "assistant", "content": "red"},
            ]
        }

    path = tmp_path / "axolotl.jsonl"
    path.write_text(json.dumps(rec({"type": "image", "base64": base64.b64encode(raw).decode()})) + "\n")
    [r] = read_records(path)
    assert r.images == [raw] and r.turns[0].text == "<image>Which colour?"
    path.write_text(json.dumps(rec({"type": "image", "b64_json": "xyz"})) + "\n")
    with pytest.raises(DataError) as err:
        read_records(path)
    assert "an image part without a source (keys found: 'b64_json', 'type'; a source is one of 'image', " in str(
        err.value
    )


def _bos_tokenizer():
    """A fast tokenizer whose special tokens add a BOS (the embedded Qwen tokenizer adds none), built with
    ``tokenizers`` (a word-level vocabulary, a template post-processor) and wrapped as transformers wraps one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<unk>", "<pad>", "<img>", "hello", "world", "the", "reply", "\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<img>"],
    )


def test_piece_ids_equal_the_tokenizers_own_calls(processor):
    """``tokenize_pieces`` (the Rust backend's batch call, which a data check makes for every record) gives the
    ids of the tokenizer's own two calls: special tokens on the first piece only, added tokens kept whole,
    empty pieces empty. A tokenizer whose backend was left set to truncate goes through its own call (which
    truncates nothing unless asked), not the backend (which would)."""
    from vlft import tokenize_pieces

    qwen = processor.tokenizer
    bos = _bos_tokenizer()
    cases = [
        (
            qwen,
            [
                "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 5 + "<|vision_end|>hi<|im_end|>\n",
                " the reply<|im_end|>",
                "\n",
                "",
                "  two  spaces",
            ],
        ),
        (bos, ["hello <img> <img> world", "the reply", "", "hello"]),
        (bos, ["hello"]),
        (bos, []),
    ]
    for tok, texts in cases:
        own = (
            (
                tok(texts[:1], add_special_tokens=True)["input_ids"]
                + (tok(texts[1:], add_special_tokens=False)["input_ids"] if len(texts) > 1 else [])
            )
            if texts
            else []
        )
        assert tokenize_pieces(tok, texts) == own
    assert tokenize_pieces(bos, ["hello world", "hello"]) == [[0, 4, 5], [4]]  # one BOS, on the first piece
    bos.backend_tokenizer.enable_truncation(max_length=2)
    assert tokenize_pieces(bos, ["hello world the", "hello"]) == [[0, 4, 5, 6], [4]]  # the tokenizer's own call
