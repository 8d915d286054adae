"""Padding-free packing (--packing): packed and padded training compute the same thing.

The models are the real embedded ones (Qwen2.5-VL and ``embedded:qwen3-vl``), every parameter trainable
(vision tower, merger, embeddings, text layers, head), fp32 on the CPU; the data mixes records with up to
3 images, several turns and text-only records, of lengths that are not multiples of 8.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import installed
from vlft.data.batching import collator_for, label_count, model_inputs
from vlft.data.packing import PackingCollator, PackingPlan, resolve_packing
from vlft.data.records import IGNORE_INDEX
from vlft.models.loss import token_loss_sum
from vlft.models.segments import segments_name
from vlft.policies import AttentionPolicy

RTOL = 1e-5


@pytest.fixture(scope="module")
def varied_records(tmp_path_factory):
    from vlft.data.demo import write_varied_dataset
    from vlft.data.records import read_records

    path = write_varied_dataset(
        tmp_path_factory.mktemp("varied"), n=12, seed=1, min_side=28, max_side=160, answer_words=(1, 20)
    )
    return read_records(path)


def _setup(model_name: str, attn: str):
    """The model twice, the same weights: plain ``attn`` (padded batches) and its segments twin (packed)."""
    from vlft.data.encoding import SampleEncoder
    from vlft.models.loading import (
        load_model,
        load_processor,
        model_config_and_family,
        resolve_model_path,
    )
    from vlft.policies import PrecisionPolicy
    from vlft.registry import load_registry

    registry = load_registry()
    path = resolve_model_path(model_name, registry)
    config, family = model_config_and_family(path, registry)
    processor = load_processor(path, family, registry)
    models = []
    for text in (attn, segments_name(attn)):
        model = load_model(path, AttentionPolicy(attn, text), PrecisionPolicy("fp32"), family=family)
        models.append(model.requires_grad_(True))
    return models, config, family, processor, SampleEncoder(processor, family=family)


@pytest.fixture(scope="module")
def qwen25(varied_records):
    return _setup("embedded", "eager"), varied_records


@pytest.fixture(scope="module")
def qwen3(varied_records):
    return _setup("embedded:qwen3-vl", "eager"), varied_records


def _collators(processor, config, family):
    packed = PackingCollator(PackingPlan(True, "segments"), family.positions, config, family.image_inputs.batch_inputs)
    return collator_for(processor, family), packed


def _steps(model, collate, micro_batches, steps: int, lr: float = 1e-3):
    """``steps`` AdamW steps of sum-over-labels / step label count (``training.step``'s loss); per step the
    loss and every gradient. In float64: packed and padded rows sum in other orders, and AdamW's normalised
    update turns float32 rounding in near-zero gradients into weight differences up to the learning rate
    (2.5e-6 after 6 steps in the accumulation test), which later steps' gradients would carry; float64
    rounding (~1e-16) stays far below the tolerance on any CPU."""
    model = copy.deepcopy(model).double()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    out = []
    for step in range(steps):
        batches = [collate(samples) for samples in micro_batches[step]]
        tokens = sum(label_count(b) for b in batches)
        total = 0.0
        for b in batches:
            loss = token_loss_sum(model(**model_inputs(b)).logits, b["labels"]) / tokens
            loss.backward()
            total += loss.item()
        out.append((total, tokens, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _assert_same(padded, packed):
    for step, ((loss_a, n_a, grads_a), (loss_b, n_b, grads_b)) in enumerate(zip(padded, packed), start=1):
        assert n_a == n_b, (step, n_a, n_b)
        assert abs(loss_a - loss_b) <= RTOL * abs(loss_a), (step, loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys()
        for name, ga in grads_a.items():
            gb = grads_b[name]
            assert ga.dtype == gb.dtype == torch.float64, (name, ga.dtype)
            scale = ga.norm().item()
            assert (ga - gb).norm().item() <= RTOL * max(scale, 1e-12), (step, name, scale, (ga - gb).norm().item())


def _micro_batches(encoder, records, steps=3, per_step=2, size=2):
    samples = [encoder.encode(r) for r in records]
    it = iter(samples)
    return [[[next(it) for _ in range(size)] for _ in range(per_step)] for _ in range(steps)]


def _check_data(micro_batches):
    flat = [s for step in micro_batches for mb in step for s in mb]
    lengths = [len(s["input_ids"]) for s in flat]
    images = [len(s.get("image_grid_thw", ())) for s in flat]
    assert any(n % 8 for n in lengths) and 0 in images and max(images) >= 2, (lengths, images)


def test_packed_and_padded_training_match_on_qwen2_5_vl(qwen25):
    ((plain, segments), config, family, processor, encoder), records = qwen25
    micro = _micro_batches(encoder, records, per_step=1, size=3)
    _check_data(micro)
    padded, packed = _collators(processor, config, family)
    _assert_same(_steps(plain, padded, micro, 3), _steps(segments, packed, micro, 3))


def test_packed_and_padded_training_match_on_qwen3_vl(qwen3):
    ((plain, segments), config, family, processor, encoder), records = qwen3
    micro = _micro_batches(encoder, records)
    _check_data(micro)
    padded, packed = _collators(processor, config, family)
    _assert_same(_steps(plain, padded, micro, 3), _steps(segments, packed, micro, 3))


def test_packed_under_sdpa_matches_padding(qwen25):
    """The segments path over transformers' sdpa: six samples in one row."""
    (_, config, family, processor, encoder), records = qwen25
    from vlft.models.loading import load_model, resolve_model_path
    from vlft.policies import PrecisionPolicy

    plain, segments = (
        load_model(
            resolve_model_path("embedded", installed()),
            AttentionPolicy("sdpa", text),
            PrecisionPolicy("fp32"),
            family=family,
        ).requires_grad_(True)
        for text in ("sdpa", segments_name("sdpa"))
    )
    micro = _micro_batches(encoder, records, steps=1, per_step=1, size=6)
    padded, packed = _collators(processor, config, family)
    batch = packed(micro[0][0])
    assert batch["input_ids"].shape == (1, sum(len(s["input_ids"]) for s in micro[0][0]))  # one row, no pad
    assert batch["position_ids"].shape[:2] == (4, 1) and "attention_mask" not in batch
    _assert_same(_steps(plain, padded, micro, 1), _steps(segments, packed, micro, 1))


def test_segments_leave_padded_batches_and_generation_as_they_were(qwen25):
    """A model loaded for packing also validates on padded batches and generates with a cache: there the
    segments implementation hands the mask to the plain one, so it computes what the plain model computes."""
    ((plain, segments), _, family, processor, encoder), records = qwen25
    samples = [encoder.encode(r) for r in records[:3]]
    batch = collator_for(processor, family)(samples)
    assert (batch["attention_mask"] == 0).any()  # really padded
    with torch.no_grad():
        a, b = (m(**model_inputs(batch)).logits for m in (plain, segments))
        assert torch.equal(a, b)
        prompt = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
        ga, gb = (m.generate(**prompt, max_new_tokens=4, do_sample=False) for m in (plain, segments))
    assert torch.equal(ga, gb)


def test_no_label_predicts_across_a_sample_boundary(qwen25):
    """Every token labelled: packed, the loss must still be the sum of each sample's own loss (the shift at
    each boundary would otherwise train the last token of one sample on the first of the next)."""
    ((plain, model), config, family, processor, encoder), records = qwen25
    samples = []
    for r in records[:3]:
        s = encoder.encode(r)
        samples.append({**s, "labels": s["input_ids"].clone()})  # label everything, the first token too
    _, packed = _collators(processor, config, family)
    batch = packed(samples)
    starts = torch.tensor([0] + [len(s["input_ids"]) for s in samples]).cumsum(0)[:-1]
    assert (batch["labels"][0, starts] == IGNORE_INDEX).all()
    assert (batch["position_ids"][0, 0, starts] == 0).all()  # the text row restarts at each sample
    assert label_count(batch) == sum(len(s["input_ids"]) - 1 for s in samples)
    with torch.no_grad():
        own = sum(
            token_loss_sum(plain(**model_inputs(collator_for(processor, family)([s]))).logits, s["labels"][None]).item()
            for s in samples
        )
        together = token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"]).item()
    assert abs(together - own) <= RTOL * own, (together, own)


def test_auto_packs_where_attention_isolates_and_refuses_a_family_that_cannot(registry):
    from vlft.errors import ConfigError
    from vlft.models.families import family_named

    fam25, fam35 = family_named(registry, "qwen2.5-vl"), family_named(registry, "qwen3.5")
    cpu = registry.first(
        "vlft_attention_implementation",
        backend="cpu",
        config=__import__("vlft.config", fromlist=["RunConfig"]).RunConfig(),
        model_config=None,
    )
    assert resolve_packing("on", cpu, fam25).path == "segments"
    assert resolve_packing("auto", cpu, fam25).path == "segments"
    assert resolve_packing("auto", AttentionPolicy("sdpa", "sdpa"), fam25).path == "segments"
    assert resolve_packing("auto", AttentionPolicy("sdpa", "flash_attention_2"), fam25).path == "varlen"
    assert not resolve_packing("auto", AttentionPolicy("eager", "flex_attention"), fam25).enabled
    off = resolve_packing("auto", cpu, fam35)
    assert not off.enabled and "Gated DeltaNet" in off.reason
    with pytest.raises(ConfigError, match="Gated DeltaNet"):
        resolve_packing("on", cpu, fam35)
    assert not resolve_packing("off", cpu, fam25).enabled


def test_a_packed_micro_batch_saves_no_more_than_the_padded_shape_the_plan_counts(qwen25):
    """The memory plan counts a packed micro-batch as its padded shape (``memory.largest_batches``): that
    bound holds only if packing saves no more for backward than padding. Measured with the tracer's meter
    on the real model under eager, whose saved attention probabilities grow with the square of what one
    attention call sees; beside them, the same row attended whole under transformers' block-diagonal mask
    (what packing on sdpa/eager did before the segments path), which saves more too."""
    from vlft.measure import SavedTensorMeter

    ((plain, segments), config, family, processor, encoder), records = qwen25
    samples = [encoder.encode(r) for r in records[:4]]
    padded, packed = _collators(processor, config, family)
    saved = {}
    for name, model, batch in (
        ("padded", plain, padded(samples)),
        ("packed", segments, packed(samples)),
        ("whole row", plain, packed(samples)),
    ):
        meter = SavedTensorMeter(model)
        with meter.hooks():
            token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"])
        saved[name] = meter.bytes
    lengths = [len(s["input_ids"]) for s in samples]
    assert max(lengths) * len(lengths) > 1.2 * sum(lengths), lengths  # padding to spare
    assert saved["packed"] < min(saved["padded"], saved["whole row"]), saved
