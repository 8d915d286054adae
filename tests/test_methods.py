"""LoRA and OFT through their plugins: targets, identity at start, saving for plain PEFT."""

from __future__ import annotations

import pytest
import torch

from helpers import base_model, embedded_family
from vlft.config import RunConfig
from vlft.data.batching import collator_for
from vlft.data.encoding import SampleEncoder
from vlft.data.records import read_records
from vlft.errors import ConfigError
from vlft.models.families import family_of_model, resolve_family
from vlft.models.targets import select_targets


@pytest.fixture(scope="module")
def batch(small_data, processor):
    enc = SampleEncoder(processor, embedded_family())
    records = read_records(small_data[0])[:2]
    return collator_for(processor, embedded_family())([enc.encode(r) for r in records])


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def test_targets_default_to_both_towers_last_six_vision_blocks(registry, model_dir):
    model = base_model(model_dir)
    d = registry.first("vlft_adapter_defaults", method="lora", config=RunConfig())
    plan = select_targets(model, d, "both", 6, family_of_model(model, registry))
    assert plan.vision_depth == 8 and plan.vision_blocks == [2, 3, 4, 5, 6, 7]
    vision = [m for m in plan.modules if ".visual." in m]
    text = [m for m in plan.modules if ".visual." not in m]
    assert len(vision) == 12 and all(m.endswith((".attn.qkv", ".attn.proj")) for m in vision)
    assert len(text) == 8 and {m.rsplit(".", 1)[1] for m in text} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not any("patch_embed" in m or "merger" in m for m in plan.modules)


def test_target_choices(registry, model_dir):
    model = base_model(model_dir)
    d = registry.first("vlft_adapter_defaults", method="lora", config=RunConfig())
    assert all(".visual." in m for m in select_targets(model, d, "vision", 2, family_of_model(model, registry)).modules)
    assert select_targets(model, d, "vision", 2, family_of_model(model, registry)).vision_blocks == [6, 7]
    assert select_targets(model, d, "vision", 50, family_of_model(model, registry)).vision_blocks == list(
        range(8)
    )  # all when fewer
    assert not any(
        ".visual." in m for m in select_targets(model, d, "text", 6, family_of_model(model, registry)).modules
    )
    with pytest.raises(ConfigError, match="no modules to adapt"):
        select_targets(model, d, "vision", 0, family_of_model(model, registry))


@pytest.mark.parametrize("method", ["lora", "oft"])
def test_adapter_leaves_outputs_unchanged_before_the_first_step(registry, model_dir, batch, method):
    model = base_model(model_dir).eval()
    with torch.no_grad():
        before = model(**_inputs(batch)).logits
    cfg = RunConfig(method=method)
    d = registry.first("vlft_adapter_defaults", method=method, config=cfg)
    family = family_of_model(model, registry)
    targets = select_targets(model, d, "both", 6, family).modules
    adapted = registry.first(
        "vlft_apply_adapter",
        method=method,
        model=model,
        targets=targets,
        config=cfg,
        target_parameters=[],
        family=family,
    ).eval()
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(method in n for n in trainable)
    with torch.no_grad():
        after = adapted(**_inputs(batch)).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_oft_block_size_divides_every_target_or_is_refused(registry, model_dir):
    from vlft_methods.oft import choose_block_size

    model = base_model(model_dir)
    d = registry.first("vlft_adapter_defaults", method="oft", config=RunConfig(method="oft"))
    targets = select_targets(model, d, "both", 6, family_of_model(model, registry)).modules
    assert choose_block_size(model, targets, 0) == 64  # widths 64 (vision) and 128 (text)
    assert choose_block_size(model, targets, 16) == 16
    # a width no candidate divides is refused with the widths named
    model.model.visual.blocks[7].attn.proj.in_features = 63
    with pytest.raises(ConfigError, match=r"no OFT block size in 64, 32, 16, 8, 4, 2 divides .*\(128, 63, 64\)|\(63"):
        choose_block_size(model, targets, 0)
    model.model.visual.blocks[7].attn.proj.in_features = 64
    with pytest.raises(ConfigError, match=r"oft_block_size=48 does not divide .*model\.visual\.blocks\.2\.attn\.qkv"):
        choose_block_size(model, targets, 48)


def test_unknown_adapter_option_is_named(registry):
    with pytest.raises(ConfigError, match=r"method lora: unknown option\(s\) rank; valid: lora_alpha, lora_dropout, r"):
        registry.first("vlft_adapter_defaults", method="lora", config=RunConfig(adapter={"rank": 8}))


@pytest.mark.parametrize("method", ["lora", "oft"])
def test_saved_adapter_loads_with_plain_peft_and_gives_the_same_logits(registry, model_dir, batch, tmp_path, method):
    from peft import PeftModel

    torch.manual_seed(0)
    cfg = RunConfig(method=method)
    d = registry.first("vlft_adapter_defaults", method=method, config=cfg)
    model = base_model(model_dir)
    family = family_of_model(model, registry)
    targets = select_targets(model, d, "both", 6, family).modules
    adapted = registry.first(
        "vlft_apply_adapter",
        method=method,
        model=model,
        targets=targets,
        config=cfg,
        target_parameters=[],
        family=family,
    )
    # move the adapter away from identity so the comparison means something
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    adapted.eval()
    registry.first("vlft_save_adapter", method=method, model=adapted, path=tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    with torch.no_grad():
        ours = adapted(**_inputs(batch)).logits
        plain = PeftModel.from_pretrained(base_model(model_dir), str(tmp_path / "adapter")).eval()
        theirs = plain(**_inputs(batch)).logits
        base = base_model(model_dir).eval()(**_inputs(batch)).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, base, atol=1e-3)
    loaded = registry.first(
        "vlft_load_adapter", method=method, model=base_model(model_dir), path=tmp_path / "adapter", trainable=False
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**_inputs(batch)).logits, ours, atol=1e-5, rtol=1e-5)
    merged = registry.first("vlft_merge_adapter", method=method, model=plain)
    with torch.no_grad():
        torch.testing.assert_close(merged(**_inputs(batch)).logits, ours, atol=1e-4, rtol=1e-4)


def test_the_vision_warmup_runs_the_tower_on_a_text_only_batch_and_adds_exactly_zero(registry, model_dir, batch):
    """A text-only batch (no pixels): without the warm-up the vision adapters get no gradient (None: what DDP
    calls unused); with it they get zero gradients, and the loss and the text gradients are bit for bit
    those without it."""
    from vlft.models.loss import token_loss_sum
    from vlft.models.vision import install_vision_warmup

    text_only = {k: v for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw")}
    text_only["mm_token_type_ids"] = torch.zeros_like(text_only["mm_token_type_ids"])

    def step(install: bool):
        model = base_model(model_dir)
        # dropout off: the dummy pass draws dropout masks too, which would shift the text layers' masks
        cfg = RunConfig(method="lora", adapter={"lora_dropout": 0.0})
        d = registry.first("vlft_adapter_defaults", method="lora", config=cfg)
        family = resolve_family(registry, model.config)
        targets = select_targets(model, d, "both", 6, family).modules
        torch.manual_seed(0)
        adapted = registry.first(
            "vlft_apply_adapter",
            method="lora",
            model=model,
            targets=targets,
            config=cfg,
            target_parameters=[],
            family=family,
        )
        handles = install_vision_warmup(adapted, {"image"}, family) if install else []
        adapted.train()
        # the image placeholders become plain text tokens: a text-only batch of the same shape
        ids = text_only["input_ids"].masked_fill(text_only["input_ids"] == model.config.image_token_id, 1)
        loss = token_loss_sum(adapted(**{**_inputs(text_only), "input_ids": ids}).logits, text_only["labels"])
        loss.backward()
        grads = {n: p.grad for n, p in adapted.named_parameters() if p.requires_grad}
        return loss.detach(), grads, handles

    loss_off, grads_off, _ = step(False)
    loss_on, grads_on, handles = step(True)
    assert handles
    vision = [n for n in grads_on if ".visual." in n]
    assert vision and all(grads_off[n] is None for n in vision)
    assert all(grads_on[n] is not None and not grads_on[n].any() for n in vision)
    assert torch.equal(loss_on, loss_off)
    for n in grads_off:
        if ".visual." not in n:
            assert torch.equal(grads_on[n], grads_off[n]), n
