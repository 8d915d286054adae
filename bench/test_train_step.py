"""Group 1, ``train_step``: one optimizer step for the frozen base, LoRA and OFT on the same targets and batch.

Each variant is its own model (the base loaded through vlft, the adapter
applied through the method plugin on vlft's default targets: text attention
and the last six vision blocks) with its own AdamW, and each call is one
``vlft.train.train_step``. The frozen base has every weight frozen and a
single trainable scalar gain where the first adapted vision block begins,
so its backward traverses the same layers as the adapters' (activation
gradients only); see ``bench.support.models.FrozenBase``.

Sizes: the embedded default, the wide one and ``embedded:qwen3-vl`` (the last only with benchmarks enabled).

Figures: OFT/LoRA step time (target <= 1.25), LoRA and OFT over the frozen
base, and peak memory per variant with OFT/LoRA (target <= 1.05); see
``bench.support.memory.step_memory`` for how memory is measured on each backend.
"""

from __future__ import annotations

import pytest

from bench.support.data import encode_batches, to_device
from bench.support.env import BATCH_SIZE
from bench.support.figures import figure, record
from bench.support.memory import step_memory
from bench.support.models import adapted_model, frozen_model
from bench.support.timing import Interleaved
from bench.support.training import trainer


@pytest.mark.benchmark(group="train_step")
def test_train_step(benchmark, env, family_size, demo_records):
    size = family_size
    host = encode_batches(size, demo_records[:BATCH_SIZE])[0]
    dev = to_device(env, host)
    trainers = {
        "frozen": trainer(env, frozen_model(env, size)),
        "lora": trainer(env, adapted_model(env, size, "lora")[0]),
        "oft": trainer(env, adapted_model(env, size, "oft")[0]),
    }
    timer = Interleaved(env, {name: (lambda t=t: t.step(host, dev)) for name, t in trainers.items()}, repeats=3)
    timer.run(benchmark)

    memory = {name: step_memory(env, t, host, dev) for name, t in trainers.items()}
    peak = {name: m["peak_bytes"] for name, m in memory.items()}
    figures = {
        "oft/lora step time": timer.ratio_figure("oft", "lora", "<= 1.25"),
        "lora/frozen step time": timer.ratio_figure("lora", "frozen"),
        "oft/frozen step time": timer.ratio_figure("oft", "frozen"),
        "oft/lora peak memory": figure(peak["oft"] / peak["lora"] if peak["lora"] else None, "<= 1.05"),
    }
    step_key = "activation_bytes" if "activation_bytes" in memory["lora"] else "step_bytes"
    if memory["lora"].get(step_key):
        figures[f"oft/lora {step_key.replace('_bytes', '')} memory"] = figure(
            memory["oft"][step_key] / memory["lora"][step_key]
        )
    trainable = {name: sum(p.numel() for p in t.model.parameters() if p.requires_grad) for name, t in trainers.items()}
    record(
        benchmark,
        env,
        size,
        "train_step",
        figures,
        timer.summary({n: BATCH_SIZE for n in trainers}),
        memory,
        notes=[
            "frozen: all weights frozen, one trainable scalar gain at the first adapted vision "
            "block, so backward covers the adapters' layers without weight gradients"
        ],
        trainable_parameters=trainable,
        batch_tokens=int(host["input_ids"].numel()),
    )
