"""Group 4, ``inference``: greedy generation with the base model, the adapter unmerged, and merged.

Five models side by side: the base; LoRA and OFT each unmerged (the PEFT
model) and merged (``vlft_merge_adapter``, i.e. PEFT's
``merge_and_unload``). Adapters are applied through the method plugins on
vlft's default targets and moved off their identity start, so merging folds
a real update in. Each call generates for a left-padded batch of four
prompts, greedily, exactly ``NEW_TOKENS`` new tokens (``min_new_tokens``
too, so no variant stops early and all do the same work).

Figures: unmerged/base and merged/base generation time, per method
(merged target 0.95..1.05). A plain test checks that a merged model is the
base architecture again and computes the adapted function.
"""

from __future__ import annotations

import pytest
import torch

from bench.support.data import to_device
from bench.support.env import BATCH_SIZE
from bench.support.figures import record
from bench.support.models import adapted_model, load_base, perturb_adapter
from bench.support.timing import Interleaved

NEW_TOKENS = 12
METHODS = ("lora", "oft")


def prompt_batch(env, size, records):
    collate = size.collator(padding_side="left")
    return to_device(env, collate([size.encoder.encode_prompt(r) for r in records[:BATCH_SIZE]]))


def generator(env, size, model):
    model.eval()
    pad = size.processor.tokenizer.pad_token_id

    def generate(batch):
        with torch.no_grad(), env.autocast():
            return model.generate(
                **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad
            )

    return generate


def adapted(env, size, method, merged: bool):
    model, _ = adapted_model(env, size, method)
    perturb_adapter(model, seed=1)
    if merged:
        model = env.registry.first("vlft_merge_adapter", method=method, model=model)
    return model.eval()


@pytest.mark.benchmark(group="inference")
def test_inference(benchmark, env, size, demo_records):
    batch = prompt_batch(env, size, demo_records)
    models = {"base": load_base(env, size).to(env.device).eval()}
    for method in METHODS:
        models[f"{method}_unmerged"] = adapted(env, size, method, merged=False)
        models[f"{method}_merged"] = adapted(env, size, method, merged=True)
    gens = {name: generator(env, size, m) for name, m in models.items()}
    timer = Interleaved(env, {name: (lambda g=g: g(batch)) for name, g in gens.items()}, repeats=2)
    timer.run(benchmark)
    figures = {}
    for method in METHODS:
        figures[f"{method} unmerged/base time"] = timer.ratio_figure(f"{method}_unmerged", "base")
        figures[f"{method} merged/base time"] = timer.ratio_figure(f"{method}_merged", "base", "0.95..1.05")
    tokens = {name: float(BATCH_SIZE * NEW_TOKENS) for name in models}
    record(
        benchmark,
        env,
        size,
        "inference",
        figures,
        timer.summary(tokens),
        notes=[f"greedy, batch {BATCH_SIZE}, exactly {NEW_TOKENS} new tokens; items/s = generated tokens/s"],
    )


@pytest.mark.parametrize("method", METHODS)
def test_merged_model_is_the_base_architecture_computing_the_adapted_function(env, embedded_size, demo_records, method):
    """merged ~ base: after merging, the same modules and parameters as the base, and the adapter's outputs."""
    size = embedded_size
    base = load_base(env, size).to(env.device).eval()
    unmerged = adapted(env, size, method, merged=False)
    merged = adapted(env, size, method, merged=True)
    assert {n: type(m) for n, m in merged.named_modules()} == {n: type(m) for n, m in base.named_modules()}
    assert {n: p.shape for n, p in merged.named_parameters()} == {n: p.shape for n, p in base.named_parameters()}
    batch = prompt_batch(env, size, demo_records)
    with torch.no_grad(), env.autocast():
        want = unmerged(**batch).logits.float()
        got = merged(**batch).logits.float()
        plain = base(**batch).logits.float()
    # errors relative to the largest logit: fp32 merges exactly up to rounding; bf16/fp16 round the merged weights
    tol = 1e-4 if env.precision.autocast_dtype is None and env.precision.param_dtype == "float32" else 3e-2
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < tol, "merged outputs differ from the unmerged adapter's"
    assert (plain - want).abs().max() / scale > 10 * tol, "the perturbed adapter should change the outputs"
    out = generator(env, size, merged)(batch)
    assert out.shape == (BATCH_SIZE, batch["input_ids"].shape[1] + NEW_TOKENS)
