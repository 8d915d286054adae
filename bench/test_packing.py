"""Group ``packing``: padding-free packing (``--packing``) against batches padded to their longest sample.

A variable-length set with realistic shapes (``vlft.data.demo.write_varied_dataset``): 0 to 3 images per
record (a quarter or so text-only) of sides 224..1024 at dynamic resolution (the processor's own resize,
capped at 448x448 = 200,704 pixels: 64 to 256 image tokens each), 1 to 3 turns, answers of 5 to 200 words.
One seeded shuffle cut into micro-batches of four; the same micro-batches collated three ways and trained
with ``vlft.training.step.train_step`` on the same LoRA model, fp32 on the CPU reference (eager, the mask
path):

- ``padded``: ``Collator`` (to the batch's longest sample), today's default;
- ``packed``: ``PackingCollator``, the micro-batch in one row (the default of ``--max-tokens-per-batch``);
- ``packed-rows``: ``PackingCollator`` with rows of at most ``ROW_BUDGET`` tokens.

Effective tokens are the labelled tokens (the same for every variant: the same samples).
Figure: effective tokens/s packed over padded (target >= 2).
"""

from __future__ import annotations

import pytest

from bench.support.data import to_device
from bench.support.env import BATCH_SIZE
from bench.support.figures import record
from bench.support.models import adapted_model
from bench.support.timing import Interleaved
from bench.support.training import trainer

SAMPLES = 8  # two micro-batches per variant and call (one with --benchmark-disable)
ROUNDS = 3  # the steps are slow on shared cores; the figure is a paired time ratio
MAX_PIXELS = 448 * 448
ROW_BUDGET = 2048


@pytest.fixture(scope="session")
def varied_records(tmp_path_factory):
    from vlft.data.demo import write_varied_dataset
    from vlft.data.records import read_records

    return read_records(write_varied_dataset(tmp_path_factory.mktemp("bench-varied"), n=SAMPLES, seed=7))


@pytest.mark.benchmark(group="packing")
def test_packing(benchmark, env, embedded_size, varied_records):
    from vlft.data.batching import Collator, label_count
    from vlft.data.encoding import SampleEncoder
    from vlft.data.order import EpochSampler
    from vlft.data.packing import PackingCollator, PackingPlan
    from vlft.models.loading import model_config_and_family
    from vlft.registry import load_registry

    size = embedded_size
    config, family = model_config_and_family(size.path, load_registry())
    encoder = SampleEncoder(size.processor, max_pixels=MAX_PIXELS, family=family)
    order = EpochSampler(len(varied_records), seed=0, epoch=0).indices()
    records = [varied_records[i] for i in order][: BATCH_SIZE if benchmark.disabled else SAMPLES]
    samples = [encoder.encode(r) for r in records]
    groups = [samples[i:i + BATCH_SIZE] for i in range(0, len(samples) - BATCH_SIZE + 1, BATCH_SIZE)]
    pad, image = size.processor.tokenizer.pad_token_id, size.processor.image_token_id
    collators = {
        "packed": PackingCollator(pad, image, PackingPlan(True, "mask", None), family.rope_index, config),
        "packed-rows": PackingCollator(pad, image, PackingPlan(True, "mask", ROW_BUDGET), family.rope_index, config),
        "padded": Collator(pad, image),
    }
    host = {name: [c(g) for g in groups] for name, c in collators.items()}
    dev = {name: [to_device(env, b) for b in batches] for name, batches in host.items()}
    tr = trainer(env, adapted_model(env, embedded_size, "lora")[0])

    def run(name):
        for h, d in zip(host[name], dev[name]):
            tr.step(h, d)

    timer = Interleaved(env, {name: (lambda n=name: run(n)) for name in host})
    timer.run(benchmark, rounds=ROUNDS)
    labelled = {name: float(sum(label_count(b) for b in batches)) for name, batches in host.items()}
    assert len(set(labelled.values())) == 1  # the same samples, the same labels
    real = sum(len(s["input_ids"]) for s in samples)
    summary = timer.summary(labelled)
    for name, batches in host.items():
        summary[name]["batch_shapes"] = [list(b["input_ids"].shape) for b in batches]
        summary[name]["real_token_share"] = real / sum(b["input_ids"].numel() for b in batches)
    lengths = [len(s["input_ids"]) for s in samples]
    record(benchmark, env, embedded_size, "packing",
           {"packed/padded effective tokens/s": timer.ratio_figure("packed", "padded", ">= 2", per_item=labelled),
            "packed-rows/padded effective tokens/s": timer.ratio_figure("packed-rows", "padded", ">= 2",
                                                                        per_item=labelled)},
           summary,
           notes=[f"{len(samples)} varied samples (0-3 images of 224..1024 px capped at {MAX_PIXELS} px, 1-3 turns, "
                  f"answers 5-200 words), micro-batches of {BATCH_SIZE}, LoRA, fp32, eager (mask path), one "
                  f"train_step per micro-batch; packed-rows: rows of at most {ROW_BUDGET} tokens"],
           sample_lengths=lengths, images_per_sample=[len(s.get("image_grid_thw", ())) for s in samples])
