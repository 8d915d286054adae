"""The model-family contract by capability (issue 30 items 1 and 2): a required core and capabilities, each
checked when a plugin's families are first asked for, each read by the core; errors inside a family's
functions name the plugin; a capability the family lacks is refused with the reason. Light: no training."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

import vlft
from helpers import embedded_family, installed
from vlft.contracts.family import CAPABILITIES, GROUPS, ModelFamily, model_family_help
from vlft.errors import ConfigError, DataError, PluginError
from vlft.models.families import check_family, offered_families

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-plugins.md"


def _registry_with(*families, name="vlft_broken_family"):
    from vlft.registry import load_registry

    class Plugin:
        __name__ = name

        @vlft.hookimpl
        def vlft_model_families(self):
            return list(families)

    return load_registry(load_entry_points=False, plugins=(Plugin(),))


def _qwen():
    from vlft.models.families import family_named
    from vlft.registry import get_registry

    return family_named(get_registry(), "qwen2.5-vl")


# --- the contract ------------------------------------------------------------------------------------------


def test_fields_no_run_reads_are_gone_and_every_field_has_help():
    names = {f.name for f in fields(ModelFamily)}
    gone = {
        "default_vision_last_n",
        "image_token",
        "video_token",
        "vision_start_token",
        "vision_end_token",
        "image_tokens",
        "video_tokens",
        "bundled_configs",
        "processor_expands_placeholders",
        "batch_inputs",
        "rope_index",
        "packing_refusal",
        "image_grid",
        "trace_vision",
        "no_split_modules",
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "image_min_pixels",
        "image_max_pixels",
        "video_min_pixels",
        "video_max_pixels",
        "embed_tokens",
        "text_linear_attention_optional",
        # plugin API 3: grouped (towers, targets, chat, kernels, tiny) or removed (default_parts)
        "vision_tower",
        "vision_blocks",
        "vision_mergers",
        "decoder_layers",
        "lm_head",
        "vision_attention",
        "vision_mlp",
        "text_attention",
        "text_linear_attention",
        "text_mlp",
        "default_targets",
        "default_parts",
        "processor_class",
        "load_processor",
        "bundled_processor",
        "reply_end_token",
        "reply_end_appended",
        "chat_template_kwargs",
        "box_coordinates",
        "vision_stem",
        "kernel_targets",
        "build_tiny",
        "tiny_recipe",
    }
    assert names & gone == set()
    assert set(CAPABILITIES) | set(GROUPS) <= names and len(names) <= 18
    assert not hasattr(ModelFamily, "expert_parameters") and not hasattr(ModelFamily, "router_modules")
    helps = model_family_help()
    assert all(helps.values()), [k for k, v in helps.items() if not v]
    assert {f"image_inputs.{f.name}" for f in fields(vlft.ImageInputs)} <= set(helps)


def test_build_tiny_is_called_as_its_help_says():
    """The core calls ``build_tiny(path, corpus=...)``; the help and every installed family agree."""
    assert "build(path, corpus=None)" in model_family_help()["tiny.build"]
    from vlft.models.families import installed_families
    from vlft.registry import get_registry

    for fam in installed_families(get_registry()):
        if fam.tiny is not None:
            inspect.signature(fam.tiny.build).bind(Path("x"), corpus=["a"])


def test_every_installed_family_passes_the_load_time_check_and_names_its_plugin():
    from vlft.models.families import installed_families
    from vlft.registry import get_registry

    families = installed_families(get_registry())
    assert families and all(check_family(f) == [] for f in families)
    assert all(f.plugin for f in families)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda f: replace(f, image_inputs=replace(f.image_inputs, write="not a function")), "image_inputs.write"),
        (
            lambda f: replace(f, image_inputs=replace(f.image_inputs, batch_inputs={"pixel_values": "stack"})),
            "image_inputs.batch_inputs",
        ),
        (lambda f: replace(f, positions=vlft.Positions(rope_index=None)), "positions.rope_index"),
        (lambda f: replace(f, sharding=("Block",)), "sharding"),
        (lambda f: replace(f, towers=replace(f.towers, vision_blocks="elsewhere.blocks")), "towers.vision_blocks"),
        (lambda f: replace(f, tiny=replace(f.tiny, build="later")), "tiny.build"),
    ],
)
def test_a_broken_family_stops_at_load_naming_the_plugin_and_the_field(change, field):
    from vlft.models.families import installed_families

    broken = change(replace(_qwen(), name="broken", model_types=("broken",), plugin=""))
    with pytest.raises(PluginError) as e:
        installed_families(_registry_with(broken))
    assert str(e.value).startswith("family 'broken' (plugin vlft_broken_family): ")
    assert field in str(e.value), str(e.value)


def test_a_broken_family_stops_the_run_s_lookup_by_model_type_too():
    from types import SimpleNamespace

    from vlft.models.families import resolve_family

    broken = replace(
        _qwen(),
        name="broken",
        model_types=("broken",),
        plugin="",
        image_inputs=replace(_qwen().image_inputs, prepare=None),
    )
    with pytest.raises(PluginError, match=r"family 'broken' \(plugin vlft_broken_family\): image_inputs.prepare"):
        resolve_family(_registry_with(broken), SimpleNamespace(model_type="broken"))


# --- the plugin API version: an old plugin is told what changed ----------------------------------------------


def test_a_field_removed_or_renamed_names_what_replaced_it_and_the_changelog_section():
    with pytest.raises(vlft.ContractChanged) as e:
        vlft.ModelFamily(
            name="old",
            model_types=("old",),
            vision_tower="model.vision_tower",
            embed_tokens="model.embed_tokens",
            default_parts=("attention",),
            colour="red",
        )
    message = str(e.value)
    assert isinstance(e.value, TypeError)  # what the bare call raised before, for a caller that catches it
    assert "ModelFamily(vision_tower=...) changed in plugin API 3: use towers=vlft.Towers(vision=...);" in message
    assert message.endswith(
        "(see docs/plugin-api-changes.md#plugin-api-3, docs/plugin-api-changes.md#plugin-api-2, "
        "docs/plugin-api-changes.md)"
    )
    assert "ModelFamily(embed_tokens=...) changed in plugin API 2: removed, as no run read it" in message
    assert "ModelFamily(default_parts=...) changed in plugin API 3: removed" in message
    assert "ModelFamily(colour=...): no such field in plugin API 3" in message and "towers" in message
    with pytest.raises(ImportError, match=r"vlft.policies.ModelFamily changed in plugin API 3: import it from vlft"):
        from vlft.policies import ModelFamily  # noqa: F401 - the import is what is tested


OLD_INTERNVL = """
from vlft import ModelFamily, hookimpl

VLFT_PLUGIN_API = 2  # written from the guide of plugin API 2

INTERNVL = ModelFamily(name="internvl", model_types=("internvl",), vision_tower="model.vision_tower",
                       vision_blocks="model.vision_tower.encoder.layer",
                       embed_tokens="model.language_model.embed_tokens")


@hookimpl
def vlft_model_families():
    return [INTERNVL]
"""

OLD_LAZY = """
from vlft import ModelFamily, Towers, hookimpl

VLFT_PLUGIN_API = 2


@hookimpl
def vlft_model_families():  # built when asked, as the built-in families are
    return [ModelFamily(name="lazyvl", model_types=("lazyvl",), towers=Towers(), default_parts=("mlp",))]


@hookimpl
def vlft_model_family(model_type):
    return None
"""


def test_vlft_plugins_tells_a_planted_old_plugin_what_changed(tmp_path, monkeypatch):
    """Two plugins written for plugin API 2, planted beside the installed ones (VLFT_PLUGINS): one builds its
    family at import, one when asked and answers the removed vlft_model_family hook. `vlft plugins` lists both
    broken with the field, its replacement and the changelog section, and notes what the second declares."""
    from helpers import cli_invoke
    from vlft.registry import load_registry

    (tmp_path / "vlft_old_internvl.py").write_text(OLD_INTERNVL)
    (tmp_path / "vlft_old_lazy.py").write_text(OLD_LAZY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLFT_PLUGINS", "vlft_old_internvl,vlft_old_lazy")
    registry = load_registry()
    code, out = cli_invoke("plugins", registry=registry)
    assert code == 0, out
    lines = out.splitlines()
    internvl = next(line for line in lines if line.lstrip().startswith("vlft_old_internvl"))
    assert "broken" in internvl and "ContractChanged" in internvl
    assert "ModelFamily(vision_tower=...) changed in plugin API 3: use towers=vlft.Towers(vision=...)" in internvl
    assert "ModelFamily(embed_tokens=...) changed in plugin API 2" in internvl
    assert "docs/plugin-api-changes.md#plugin-api-2" in internvl
    lazy = lines.index(next(line for line in lines if line.lstrip().startswith("vlft_old_lazy")))
    assert "broken" in lines[lazy] and "ModelFamily(default_parts=...) changed in plugin API 3" in lines[lazy]
    notes = " ".join(lines[lazy + 1 : lazy + 3])
    assert "written for plugin API 2; this vlft's is 3: see docs/plugin-api-changes.md#plugin-api-3" in notes
    assert "the hook vlft_model_family changed in plugin API 3: removed, nothing asks it" in notes
    assert any(f.name == "qwen2.5-vl" for f in offered_families(registry)[0])  # the others still listed


def test_the_changelog_lists_every_change_under_its_version():
    """docs/plugin-api-changes.md has a section per plugin API version whose table is vlft.contracts.CHANGES'
    rows of that version, in order: what a ContractChanged message points a plugin author to exists."""
    from vlft.contracts import CHANGES, PLUGIN_API

    doc = (ROOT / "docs" / "plugin-api-changes.md").read_text(encoding="utf-8")
    for api in range(2, PLUGIN_API + 1):
        section = doc.split(f"## Plugin API {api}\n", 1)[1].split("\n## ", 1)[0]
        rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert rows == [f"| {c.contract} | `{c.old}` | {c.now} |" for c in CHANGES if c.api == api], api
    assert f"`vlft.PLUGIN_API` (this vlft: {PLUGIN_API})" in doc


# --- the core reads the capabilities ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor():
    from vlft.models.embedded import embedded_model_dir
    from vlft.models.loading import load_processor

    return load_processor(str(embedded_model_dir(installed())), embedded_family(), installed())


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from vlft.data.demo import write_demo_dataset
    from vlft.data.records import read_records

    return read_records(write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=4, n_val=1).train)


def test_an_error_inside_a_family_function_names_the_plugin_and_the_field(processor, records):
    from vlft.data.encoding import SampleEncoder

    def prepare(processor, media, max_pixels=None):
        raise KeyError("image_grid_thw")

    fam = replace(_qwen(), image_inputs=replace(_qwen().image_inputs, prepare=prepare), plugin="vlft_mine")
    with pytest.raises(
        PluginError,
        match=r"family 'qwen2.5-vl' \(plugin vlft_mine\): image_inputs.prepare raised "
        r"KeyError",
    ):
        SampleEncoder(processor, family=fam).encode(next(r for r in records if r.images))


def test_an_error_inside_a_familys_rope_index_while_packing_names_the_plugin(processor, records):
    """The packing collator builds positions in the data stage (a DataLoader worker, where there is one), with
    the family's rope_index resolved at plan time: an error there names the family and its plugin as the
    collator the run builds (setup.training_collator) says it."""
    from types import SimpleNamespace

    from vlft.data.encoding import SampleEncoder
    from vlft.data.packing import PackingPlan
    from vlft.models.embedded import embedded_model_dir
    from vlft.models.loading import load_model_config
    from vlft.training.setup import training_collator

    def rope_index(model_config, sample):
        raise IndexError("grid and image tokens disagree")

    fam = replace(_qwen(), positions=replace(_qwen().positions, rope_index=rope_index), plugin="vlft_mine")
    samples = [SampleEncoder(processor, family=fam).encode(r) for r in records[:2]]
    plan = SimpleNamespace(packing=PackingPlan(True, "segments"), family=fam)  # what training_collator reads
    collate = training_collator(plan, load_model_config(str(embedded_model_dir(installed())), installed()), processor)
    with pytest.raises(
        PluginError,
        match=r"family 'qwen2.5-vl' \(plugin vlft_mine\): positions.rope_index raised "
        r"IndexError: grid and image tokens disagree",
    ):
        collate(samples)


def test_what_a_family_lacks_is_refused_with_the_reason(processor, records):
    from vlft.data.encoding import SampleEncoder
    from vlft.data.packing import resolve_packing
    from vlft.policies import AttentionPolicy

    with_image = next(r for r in records if r.images)
    text_only = replace(_qwen(), image_inputs=None, video_inputs=None)
    with pytest.raises(DataError, match="images are not supported for the qwen2.5-vl family"):
        SampleEncoder(processor, family=text_only).encode(with_image)
    no_video = replace(_qwen(), video_inputs=None)
    with pytest.raises(DataError, match="videos are not supported for the qwen2.5-vl family"):
        SampleEncoder(processor, family=no_video).encode(replace(with_image, videos=["clip.mp4"]))
    uncapped = replace(_qwen(), image_inputs=replace(_qwen().image_inputs, size_cap=""))
    with pytest.raises(ConfigError, match="--max-pixels: the qwen2.5-vl family has no image size cap"):
        SampleEncoder(processor, max_pixels=448 * 448, family=uncapped)
    with pytest.raises(ConfigError, match="declares no packing capability"):
        resolve_packing("on", AttentionPolicy("eager", "eager"), replace(_qwen(), packing=None))


def test_the_batch_joins_what_the_family_declares_and_nothing_else(processor, records):
    """The collator pads the family's 'sequence' inputs and joins its 'concat' ones; an input the family does
    not declare never reaches the batch (the core knows no key of its own)."""
    from vlft.data.batching import collator_for
    from vlft.data.encoding import SampleEncoder

    fam = _qwen()
    samples = SampleEncoder(processor, family=fam).encode_conversations(records[0], [records[0].turns])
    samples = [dict(s, extra_unknown=s["input_ids"]) for s in samples]
    batch = collator_for(processor, fam)(samples)
    assert "extra_unknown" not in batch
    assert set(batch) - {"input_ids", "attention_mask", "labels"} <= set(fam.image_inputs.batch_inputs)
    fewer = replace(fam, image_inputs=replace(fam.image_inputs, batch_inputs={"pixel_values": "concat"}))
    assert set(collator_for(processor, fewer)(samples)) == {"input_ids", "attention_mask", "labels", "pixel_values"}


def test_concat_padded_joins_tensors_of_different_second_dims_padding_with_zero_padded_and_packed():
    """'concat_padded' (LLaVA-OneVision's pixel_values [images, tiles, 3, H, W], tiles differing by image): each
    sample's tensor padded with 0 at the end of its other dims to the batch's largest, then joined along dim 0,
    padded and packed alike; 'concat' of the same tensors cannot join them."""
    import torch

    from vlft.data.batching import Collator
    from vlft.data.packing import PackingCollator, PackingPlan

    one = torch.arange(1 * 5 * 3 * 2 * 2, dtype=torch.float32).reshape(1, 5, 3, 2, 2) + 1
    two = torch.arange(2 * 1 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 1, 3, 2, 2) + 1
    samples = [
        {"input_ids": torch.tensor([5, 6, 7]), "pix": one, "n": torch.tensor([1])},
        {"input_ids": torch.tensor([5, 6]), "n": torch.tensor([0])},
        {"input_ids": torch.tensor([8]), "pix": two, "n": torch.tensor([2])},
    ]
    joins = {"pix": "concat_padded", "n": "concat"}
    padded = Collator(0, joins)(samples)
    packed = PackingCollator(PackingPlan(True, "segments"), None, None, joins)(samples)
    for batch in (padded, packed):
        assert batch["pix"].shape == (3, 5, 3, 2, 2) and batch["n"].tolist() == [1, 0, 2]
        assert torch.equal(batch["pix"][:1], one) and torch.equal(batch["pix"][1:, :1], two)
        assert not batch["pix"][1:, 1:].any()
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        Collator(0, {"pix": "concat"})(samples)
    joins = {**_qwen().image_inputs.batch_inputs, "pixel_values": "concat_padded"}
    assert check_family(replace(_qwen(), image_inputs=replace(_qwen().image_inputs, batch_inputs=joins))) == []


def test_concat_last_joins_one_row_of_patches_per_sample_into_one_row_padded_and_packed():
    """'concat_last' (MiniCPM-V's NaViT pixel_values [1, C, p, patches]: every view of a sample in one row): the
    samples' rows joined along the last dim in sample order, padded and packed alike; the per-view sizes beside
    them join 'concat'."""
    import torch

    from vlft.data.batching import Collator
    from vlft.data.packing import PackingCollator, PackingPlan

    one = torch.arange(1 * 3 * 2 * 6, dtype=torch.float32).reshape(1, 3, 2, 6) + 1
    two = -torch.arange(1 * 3 * 2 * 4, dtype=torch.float32).reshape(1, 3, 2, 4) - 1
    samples = [
        {"input_ids": torch.tensor([5, 6, 7]), "pix": one, "sizes": torch.tensor([[2, 3]])},
        {"input_ids": torch.tensor([5, 6])},
        {"input_ids": torch.tensor([8]), "pix": two, "sizes": torch.tensor([[2, 2]])},
    ]
    joins = {"pix": "concat_last", "sizes": "concat"}
    padded = Collator(0, joins)(samples)
    packed = PackingCollator(PackingPlan(True, "segments"), None, None, joins)(samples)
    for batch in (padded, packed):
        assert batch["pix"].shape == (1, 3, 2, 10) and batch["sizes"].tolist() == [[2, 3], [2, 2]]
        assert torch.equal(batch["pix"][..., :6], one) and torch.equal(batch["pix"][..., 6:], two)
    joins = {**_qwen().image_inputs.batch_inputs, "pixel_values": "concat_last"}
    assert check_family(replace(_qwen(), image_inputs=replace(_qwen().image_inputs, batch_inputs=joins))) == []


# --- the guide ------------------------------------------------------------------------------------------


def _family_section() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text[text.index("## 9. A model-family plugin") : text.index("## 10.")]


def test_the_guide_s_family_passes_the_load_time_check_and_names_every_capability():
    section = _family_section()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    family = scope["MYVLM"]
    assert check_family(family) == []
    for cap, cls in {**GROUPS, **CAPABILITIES}.items():
        assert f"`{cap}`" in section, cap
        for f in fields(cls):
            assert re.search(rf"\b{f.name}\b", section), f"{cap}.{f.name}"
    assert "build(path, corpus=None)" in section and "PluginError" in section and "ContractChanged" in section
