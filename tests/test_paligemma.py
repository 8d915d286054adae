"""PaliGemma (plugins/models/paligemma.py) on its tiny model: a conversation becomes PaliGemmaProcessor's prefix and
suffix (the same ids, token types and labels as ``processor(text=prompt, suffix=reply)``), a multi-turn record's
earlier turns go into the prefix and only its last reply trains, a text-only record is a prefix of text alone, the
model reads the prefix both ways from the token types vlft gives it, and what the family cannot take
(``--max-pixels`` below its fixed square, ``--packing on``) stops the run before step 1 with the reason. The CLI
runs (2-process DDP on mixed data; predict, eval, export) are tests/test_mixed_ddp.py's and
tests/test_family_runs.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import cli_invoke, installed

QUESTION, ANSWER = "What colour is the product?", "The product is red."


def _conversation(*texts: str) -> list[dict]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """One record with an image, one text-only, one of two turns over an image."""
    from PIL import Image

    root = tmp_path_factory.mktemp("paligemma")
    Image.new("RGB", (40, 30), (200, 10, 10)).save(root / "red.png")
    records = [
        {"image": "red.png", "conversations": _conversation(f"<image>\n{QUESTION}", ANSWER)},
        {"conversations": _conversation("Say yes.", "yes")},
        {"image": "red.png", "conversations": _conversation(f"<image>\n{QUESTION}", "red", "Any defect?", "no")},
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture(scope="module")
def paligemma():
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named
    from vlft.models.loading import load_processor

    registry = installed()
    family = family_named(registry, "paligemma")
    folder = embedded_family_dir(family)
    return family, folder, load_processor(str(folder), family, registry)


def _encoded(paligemma, data) -> tuple[list, list]:
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records

    family, _, processor = paligemma
    records = read_records(data / "data.jsonl")
    encoder = SampleEncoder(processor, family)
    samples = [encoder.encode(r) for r in records]
    assert [encoder.measure(r)[0] for r in records] == [len(s["input_ids"]) for s in samples]
    return records, samples


def test_a_conversation_is_the_processors_prefix_and_suffix(paligemma, data):
    from PIL import Image

    _, _, processor = paligemma
    _, (image, text, turns) = _encoded(paligemma, data)
    red = Image.open(data / "red.png").convert("RGB")
    for sample, prompt, reply in ((image, QUESTION, ANSWER), (turns, f"{QUESTION}\nred\nAny defect?", "no")):
        own = processor(text=[prompt], suffix=[reply], images=[[red]], return_tensors="pt")
        for key in ("input_ids", "token_type_ids", "labels"):
            assert sample[key].tolist() == own[key][0].tolist(), (prompt, key)
        assert sample["pixel_values"].equal(own["pixel_values"])
    # a text-only record: <bos>, the prompt and a newline (type 0), the reply and <eos> (type 1, trained)
    tokenizer = processor.tokenizer
    prefix = [tokenizer.bos_token_id, *tokenizer("Say yes.\n", add_special_tokens=False)["input_ids"]]
    suffix = [*tokenizer("yes", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    assert text["input_ids"].tolist() == prefix + suffix and "pixel_values" not in text
    assert text["token_type_ids"].tolist() == [0] * len(prefix) + [1] * len(suffix)
    assert text["labels"].tolist() == [-100] * len(prefix) + suffix


def test_the_model_reads_the_prefix_both_ways_from_the_token_types_vlft_gives(paligemma, data):
    """The encoded sample through the model, with and without its token types: without them (all causal) the
    prefix's logits change, so the types vlft gives are what makes it a prefix-LM. Generation (``vlft predict``)
    starts from the prefix alone, all of it type 0."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records

    family, folder, processor = paligemma
    _, (image, _, _) = _encoded(paligemma, data)
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
    inputs = {k: (v if k == "pixel_values" else v[None]) for k, v in image.items() if k != "labels"}
    with torch.no_grad():
        typed = model(**inputs).logits
        causal = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits
    prefix = int((image["token_type_ids"] == 0).sum())
    assert (typed[0, : prefix - 1] - causal[0, : prefix - 1]).abs().max() > 1e-4
    prompt = SampleEncoder(processor, family).encode_prompt(read_records(data / "data.jsonl")[0])
    assert prompt["input_ids"].tolist() == image["input_ids"][:prefix].tolist()
    assert prompt["token_type_ids"].tolist() == [0] * prefix


def test_max_pixels_below_the_square_and_packing_are_refused_before_step_1(data, tmp_path):
    args = ["run", "--quiet", "--backend", "cpu", "--model", "embedded:paligemma", "--data", data / "data.jsonl"]
    args += ["--steps", "1", "--eval-every", "0", "--save-every", "0"]
    code, output = cli_invoke(*args, "--max-pixels", "900", "--output", tmp_path / "small")  # the core's floor: 784
    assert code != 0 and "fixed 32x32 square" in output and "1024" in output, output
    assert not (tmp_path / "small" / "metrics.jsonl").exists()
    code, output = cli_invoke(*args, "--packing", "on", "--output", tmp_path / "packed")
    assert code != 0 and "prefix-LM" in output, output
    assert not (tmp_path / "packed" / "metrics.jsonl").exists()
