"""Group 3, ``padding``: batches padded to their own longest sample against a fixed 512 tokens.

The mixed-length set (``bench.support.data.write_mixed_dataset``: single-turn
records of ~60 tokens, long questions and multi-turn conversations up to
~280) in one seeded shuffle (``vlft.train.EpochSampler``), cut into batches
of four; the same batches collated twice: by vlft's ``Collator`` (to the
batch's longest sample) and with ``Collator(pad_to=512)`` (as the common
tutorial code does). Each variant trains the same LoRA model on all of its
batches with ``vlft.train.train_step``.

Figure: samples/s own-length over samples/s fixed-512 (target >= 2).
"""

from __future__ import annotations

import pytest

from bench.support.data import encode_batches, to_device
from bench.support.env import BATCH_SIZE
from bench.support.figures import record
from bench.support.models import adapted_model
from bench.support.timing import Interleaved
from bench.support.training import trainer

FIXED_LENGTH = 512
SAMPLES = 12  # three batches per variant and call (one batch with --benchmark-disable)


@pytest.mark.benchmark(group="padding")
def test_padding(benchmark, env, size, mixed_records):
    from vlft.data.order import EpochSampler

    order = EpochSampler(len(mixed_records), seed=0, epoch=0).indices()
    records = [mixed_records[i] for i in order][: BATCH_SIZE if benchmark.disabled else SAMPLES]
    host = {"own": encode_batches(size, records), "fixed512": encode_batches(size, records, pad_to=FIXED_LENGTH)}
    dev = {name: [to_device(env, b) for b in batches] for name, batches in host.items()}
    tr = trainer(env, adapted_model(env, size, "lora")[0])

    def run(name):
        for h, d in zip(host[name], dev[name]):
            tr.step(h, d)

    timer = Interleaved(env, {name: (lambda n=name: run(n)) for name in host})
    timer.run(benchmark)
    n = {name: float(len(records)) for name in host}
    lengths = {name: [int(b["input_ids"].shape[1]) for b in batches] for name, batches in host.items()}
    real = sum(int(b["attention_mask"].sum()) for b in host["own"])
    summary = timer.summary(n)
    for name in host:
        summary[name]["batch_lengths"] = lengths[name]
        summary[name]["real_token_share"] = real / sum(BATCH_SIZE * length for length in lengths[name])
    record(
        benchmark,
        env,
        size,
        "padding",
        {"own/fixed512 samples/s": timer.ratio_figure("own", "fixed512", ">= 2", per_item=n)},
        summary,
        notes=[f"{len(records)} mixed-length samples, batches of {BATCH_SIZE}, LoRA, one train_step per batch"],
        sample_lengths=[int(b["attention_mask"][i].sum()) for b in host["own"] for i in range(BATCH_SIZE)],
    )
