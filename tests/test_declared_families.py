"""The families declared on the generic family (plugins/models/declared.py, llama4.py, minicpmv.py), on their tiny models: what each declares
agrees with what the generic reader reads from the checkpoint, and what the generic family cannot know holds:
``--max-pixels`` as the family's own cap (fewer tiles and tokens, the processor's own count), the memory plan's
image tiles equal to the processor's. The contract (targets, image tokens, packing, adapter, a mixed 2-step run)
is check_family's in tests/test_families_prep.py; the CLI runs (2-process DDP on mixed data, predict, eval,
export) are tests/test_mixed_ddp.py's and tests/test_family_runs.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import vlft_models as vm
from vlft_models import declared, generic, llama4, minicpmv

FAMILIES = (*declared.FAMILIES, llama4.FAMILY, minicpmv.FAMILY)
NAMES = [f.name for f in FAMILIES]
# what a family adapts that the generic reader leaves out (it skips every module under an "expert": Llama 4's shared
# expert is a plain MLP), and what the reader finds that the family leaves out (Qwen3.5's per-head gates)
ADDED = {"llama4": {"feed_forward.shared_expert." + p for p in ("gate_proj", "up_proj", "down_proj")}}
LEFT_OUT = {"minicpmv4.6": {"linear_attn.in_proj_a", "linear_attn.in_proj_b"}}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("declared")
    out = {}
    for f in FAMILIES:
        f.tiny.build(root / f.name)
        out[f.name] = root / f.name
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_declared_facts_are_what_the_generic_reader_reads(built, name):
    from transformers import AutoConfig

    family = vm.family_named(name)
    read = generic.read(AutoConfig.from_pretrained(built[name]), str(built[name]))
    assert read is not None and read.name == "generic"
    assert family.towers == read.towers
    for part in ("vision_attention", "vision_mlp"):
        assert set(getattr(family.targets, part)) == set(getattr(read.targets, part)), part
    declared_text = {*family.targets.text_attention, *family.targets.text_linear_attention, *family.targets.text_mlp}
    read_text = {*read.targets.text_attention, *read.targets.text_mlp}
    assert declared_text == (read_text | ADDED.get(name, set())) - LEFT_OUT.get(name, set())
    assert family.chat.reply_end_token == read.chat.reply_end_token
    read_inputs = set(read.image_inputs.batch_inputs)
    if family.video_inputs is None:  # a video path the reader finds but the family does not declare (MiniCPM-V)
        read_inputs = {k for k in read_inputs if "video" not in k}
    assert set(family.image_inputs.batch_inputs) == read_inputs
    if name == minicpmv.NAME:  # every view of every image in one row of patches: the reader's two-image probe
        assert read.image_inputs.batch_inputs["pixel_values"] == "concat_last"


def _internvl_capped(processor, image, cap):
    return image, declared.internvl_max_patches(processor, cap), lambda pixels: int(pixels.shape[0])


def _mistral3_capped(processor, image, cap):
    unit = processor.patch_size * processor.spatial_merge_size
    return (
        image,
        declared.mistral3_longest_edge(processor, cap),
        lambda pixels: pixels.shape[-2] * pixels.shape[-1] // unit**2,
    )


def _minicpmv_capped(processor, image, cap):
    patch = processor.image_processor.patch_size
    return image, minicpmv.minicpmv_kwargs(processor, cap), lambda pixels: int(pixels.shape[-1]) // patch


def _llava_next_capped(processor, image, cap):
    from vlft_models.llava_onevision import capped_size

    return image.resize(capped_size(*image.size, cap)), {}, lambda pixels: int(pixels.shape[1])


# {family: (an image size the cap cuts, what the processor is given under a cap: image, keyword arguments, and how
# its pixel_values count the image's tiles)}
CAPPED = {
    "internvl": ((120, 40), _internvl_capped),
    "llava-next": ((64, 64), _llava_next_capped),
    "llava-next-video": ((64, 64), _llava_next_capped),
    "mistral3": ((120, 40), _mistral3_capped),
    "llama4": ((120, 40), _internvl_capped),
    "minicpmv4.6": ((120, 40), _minicpmv_capped),
}


def _counted(name: str, grids) -> list[int]:
    """What an image's grids count that the cap lowers: tiles (InternVL, LLaVA-NeXT, Llama 4), tokens (Mistral 3:
    one image, rows x columns of [IMG]), patches (MiniCPM-V: its views' grids, every patch in one row of pixels)."""
    if name == "minicpmv4.6":
        return [sum(t * h * w for t, h, w in grids)]
    return [grid[1] * grid[2] if name == "mistral3" else grid[0] for grid in grids]


@pytest.mark.parametrize("name", NAMES)
def test_max_pixels_lowers_the_tiles_and_tokens_as_the_processor_counts_them(built, name):
    """An image under the family's default, then under a cap of one tile: the written ids equal the processor's own
    on what the cap gives it (InternVL: a lower max_patches; LLaVA-NeXT: the image scaled down; Mistral 3: a
    shorter longest edge), the image tokens fall, and the plan's grids count the processor's tiles (tokens)."""
    from PIL import Image
    from transformers import AutoConfig

    from vlft import Media

    family = vm.family_named(name)
    processor = family.chat.load_processor(str(built[name]))
    images = family.image_inputs
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    size, capped = CAPPED[name]
    image = Image.new("RGB", size, (200, 30, 30))
    # the token the model fills with features (Llama 4's <|patch|>; its processor's image_token is the placeholder)
    image_token_id = AutoConfig.from_pretrained(built[name]).image_token_id
    tokens, tiles = [], []
    for cap in (None, 32 * 32):
        written = images.write(processor, [text], images.prepare(processor, Media([image.size], [image]), cap))
        given, kwargs, count = capped(processor, image, cap)
        own = processor(text=[text], images=[[given]], return_tensors="pt", **kwargs)
        assert written.ids[0] == own["input_ids"][0].tolist(), cap
        assert _counted(name, written.grids) == [count(own["pixel_values"])], cap
        tokens.append(written.ids[0].count(image_token_id))
        tiles.append(_counted(name, written.grids)[0])
    assert tokens[1] < tokens[0] and tiles[1] < tiles[0], (tokens, tiles)


def test_vlft_plugins_lists_each_declared_family_with_its_model_type():
    from helpers import cli_invoke

    code, output = cli_invoke("plugins")
    assert code == 0, output
    for family in FAMILIES:
        line = next((x for x in output.splitlines() if f" {family.name} " in f" {x} "), "")
        assert family.model_types[0] in line, (family.name, output[-2000:])


def test_minicpmv_numbers_the_images_of_later_turns_as_the_whole_conversation_does(built):
    """MiniCPM-V's processor opens each image with <image_id>N</image_id>, N counting the images of the text it is
    given; vlft gives it one rendered piece at a time, so the family renumbers: the pieces' ids laid end to end
    equal the processor's on the whole conversation, an image in each of two turns."""
    from PIL import Image

    from vlft import Media

    family = vm.family_named(minicpmv.NAME)
    processor = family.chat.load_processor(str(built[minicpmv.NAME]))
    turn = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    chat = [
        {"role": "user", "content": turn},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": turn},
        {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
    ]
    whole = processor.apply_chat_template(chat, tokenize=False)
    first = processor.apply_chat_template(chat[:2], tokenize=False)
    pieces = [first, whole[len(first) :]]
    images = [Image.new("RGB", (64, 64), (200, 30, 30)), Image.new("RGB", (96, 40), (30, 30, 200))]
    prepared = family.image_inputs.prepare(processor, Media([i.size for i in images], images), None)
    written = family.image_inputs.write(processor, pieces, prepared)
    own = processor(text=[whole], images=[images], return_tensors="pt")
    assert [i for ids in written.ids for i in ids] == own["input_ids"][0].tolist()
    assert "<image_id>1</image_id>" in processor.tokenizer.decode(written.ids[1])
