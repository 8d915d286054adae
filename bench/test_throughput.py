"""Groups of issue 21's throughput work, on the mixed-length set (``bench.support.data.write_mixed_dataset``).

- ``head``: one LoRA ``train_step`` with the lm_head and the fp32 logits at the labelled positions only
  (``data.batching.with_label_positions``) against the full head: step time, and the peak of live tensors
  during the step (``vlft.measure.LiveTensorMeter``);
- ``grouping``: the same records batched from the plain seeded shuffle and from the length-grouped order
  (``--group-by-length``), training one step per batch: effective (non-padding) tokens/s;
- ``guard``: bytes the non-finite guard copies in a step taken as on an accelerator (the flag stays on the
  device): with the fused AdamW told ``found_inf`` against the copy-and-restore fallback
  (``vlft.measure.CopiedBytes``).
"""

from __future__ import annotations

import pytest
import torch

from bench.support.data import encode_batches, to_device
from bench.support.env import BATCH_SIZE
from bench.support.figures import figure, record
from bench.support.models import adapted_model
from bench.support.timing import Interleaved
from bench.support.training import trainer


def _labels_only(host: dict) -> dict:
    from vlft.data.batching import with_label_positions

    return with_label_positions(host)


@pytest.mark.benchmark(group="head")
def test_head(benchmark, env, head_size, mixed_records):
    from vlft.measure import LiveTensorMeter

    size = head_size

    records = mixed_records[:BATCH_SIZE]
    host = encode_batches(size, records)[0]
    dev = {"full": to_device(env, host), "labels": to_device(env, _labels_only(host))}
    tr = trainer(env, adapted_model(env, size, "lora")[0])
    tr.step(host, dev["full"])  # optimizer state exists before anything is measured
    peaks = {}
    for name, batch in dev.items():
        resident = [
            *tr.model.parameters(),
            *(t for s in tr.optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
            *batch.values(),
        ]
        with LiveTensorMeter(resident) as meter:
            tr.step(host, batch)
        peaks[name] = meter.peak
    timer = Interleaved(env, {name: (lambda b=batch: tr.step(host, b)) for name, batch in dev.items()})
    timer.run(benchmark)
    summary = timer.summary()
    for name in dev:
        summary[name]["peak_live_bytes"] = peaks[name]
    kept = int(_labels_only(host)["logit_positions"].shape[1])
    record(
        benchmark,
        env,
        size,
        "head",
        {
            "labels-only/full-head step time": timer.ratio_figure("labels", "full"),
            # the target where the head is as wide as a real one: at the tiny models' 440 rows the logits are a
            # sliver of the step's memory, which no head can change
            "labels-only/full-head peak memory": figure(
                peaks["labels"] / peaks["full"], "<= 0.6" if size.name == "qwen-vocab" else None
            ),
        },
        summary,
        notes=[
            f"batch of {BATCH_SIZE} x {host['input_ids'].shape[1]} tokens, logits at {kept} positions per "
            f"sample; vocab {size.model_config.text_config.vocab_size}"
        ],
    )


@pytest.mark.benchmark(group="grouping")
def test_grouping(benchmark, env, size, mixed_records):
    from vlft.data.order import EpochSampler

    n = len(mixed_records) if not benchmark.disabled else 2 * BATCH_SIZE
    records = mixed_records[:n]
    lengths = [size.encoder.measure(r)[0] for r in records]
    orders = {
        "random": EpochSampler(n, 0, 0).indices(),
        "grouped": EpochSampler(n, 0, 0, lengths=lengths, batch_size=BATCH_SIZE).indices(),
    }
    host = {name: encode_batches(size, [records[i] for i in order]) for name, order in orders.items()}
    dev = {name: [to_device(env, b) for b in batches] for name, batches in host.items()}
    tr = trainer(env, adapted_model(env, size, "lora")[0])

    def run(name):
        for h, d in zip(host[name], dev[name]):
            tr.step(h, d)

    timer = Interleaved(env, {name: (lambda k=name: run(k)) for name in host})
    timer.run(benchmark, rounds=None if benchmark.disabled else 3)
    real = {name: float(sum(int(b["attention_mask"].sum()) for b in batches)) for name, batches in host.items()}
    summary = timer.summary(real)
    for name, batches in host.items():
        summary[name]["padded_tokens"] = sum(b["input_ids"].numel() for b in batches)
        summary[name]["effective_tokens"] = real[name]
    record(
        benchmark,
        env,
        size,
        "grouping",
        {"grouped/random effective tokens/s": timer.ratio_figure("grouped", "random", ">= 1.3", per_item=real)},
        summary,
        notes=[f"{n} mixed-length records, batches of {BATCH_SIZE}, LoRA, one train_step per batch"],
    )


@pytest.mark.benchmark(group="guard")
def test_guard(benchmark, env, embedded_size, demo_records):
    from dataclasses import replace

    from vlft.measure import CopiedBytes

    size = embedded_size
    host = encode_batches(size, demo_records[:BATCH_SIZE])[0]
    dev = to_device(env, host)
    copied, params = {}, 0

    def measure():
        nonlocal params
        # the same step without a guard (the flag read on the host) copies what the model itself copies
        for name, fused, on_host in (("none", False, True), ("fused", True, False), ("copy", False, False)):
            tr = trainer(env, adapted_model(env, size, "lora")[0], as_on_a_device=True)
            trainable = [p for p in tr.model.parameters() if p.requires_grad]
            params = sum(p.numel() for p in trainable)
            tr.optimizer = torch.optim.AdamW(trainable, lr=1e-4, **({"fused": True} if fused else {}))
            tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)
            tr.policy = replace(tr.policy, fused_optimizer=fused, flags_on_host=on_host)
            tr.step(host, dev)
            with CopiedBytes() as c:
                tr.step(host, dev)
            copied[name] = c.bytes

    benchmark.pedantic(measure, rounds=1, iterations=1)
    record(
        benchmark,
        env,
        size,
        "guard",
        {
            "bytes copied by the guard, fused AdamW": figure(copied["fused"] - copied["none"], "== 0", unit="bytes"),
            "bytes copied by the guard, fallback": figure(copied["copy"] - copied["none"], unit="bytes"),
        },
        {},
        copied=copied,
        adapter_parameters=params,
        notes=[
            "a step as on an accelerator (flag on the device); copies counted in torch's dispatcher "
            "(aten.clone, aten.copy_) over the whole step, less those of the same step without a guard"
        ],
    )
