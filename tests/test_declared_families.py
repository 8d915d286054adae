"""The families declared on the generic family (plugins/models/declared.py), on their tiny models: what each declares
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
from vlft_models import declared, generic

NAMES = [f.name for f in declared.FAMILIES]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("declared")
    out = {}
    for f in declared.FAMILIES:
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
    for part in ("vision_attention", "vision_mlp", "text_attention", "text_mlp"):
        assert set(getattr(family.targets, part)) == set(getattr(read.targets, part)), part
    assert family.chat.reply_end_token == read.chat.reply_end_token
    assert set(family.image_inputs.batch_inputs) == set(read.image_inputs.batch_inputs)


def _internvl_capped(processor, image, cap):
    return image, declared.internvl_max_patches(processor, cap), lambda pixels: int(pixels.shape[0])


def _mistral3_capped(processor, image, cap):
    unit = processor.patch_size * processor.spatial_merge_size
    return (
        image,
        declared.mistral3_longest_edge(processor, cap),
        lambda pixels: pixels.shape[-2] * pixels.shape[-1] // unit**2,
    )


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
}


def _counted(name: str, grid) -> int:
    """What a grid counts that the cap lowers: tiles (InternVL, LLaVA-NeXT), tokens (Mistral 3: one image, rows x
    columns of [IMG])."""
    return grid[1] * grid[2] if name == "mistral3" else grid[0]


@pytest.mark.parametrize("name", NAMES)
def test_max_pixels_lowers_the_tiles_and_tokens_as_the_processor_counts_them(built, name):
    """An image under the family's default, then under a cap of one tile: the written ids equal the processor's own
    on what the cap gives it (InternVL: a lower max_patches; LLaVA-NeXT: the image scaled down; Mistral 3: a
    shorter longest edge), the image tokens fall, and the plan's grids count the processor's tiles (tokens)."""
    from PIL import Image

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
    tokens, tiles = [], []
    for cap in (None, 32 * 32):
        written = images.write(processor, [text], images.prepare(processor, Media([image.size], [image]), cap))
        given, kwargs, count = capped(processor, image, cap)
        own = processor(text=[text], images=[[given]], return_tensors="pt", **kwargs)
        assert written.ids[0] == own["input_ids"][0].tolist(), cap
        assert [_counted(name, g) for g in written.grids] == [count(own["pixel_values"])], cap
        tokens.append(written.ids[0].count(processor.image_token_id))
        tiles.append(_counted(name, written.grids[0]))
    assert tokens[1] < tokens[0] and tiles[1] < tiles[0], (tokens, tiles)


def test_vlft_plugins_lists_each_declared_family_with_its_model_type():
    from helpers import cli_invoke

    code, output = cli_invoke("plugins")
    assert code == 0, output
    for family in declared.FAMILIES:
        line = next((x for x in output.splitlines() if f" {family.name} " in f" {x} "), "")
        assert family.model_types[0] in line, (family.name, output[-2000:])
