"""Group 5, ``data``: the data pipeline alone against what a training step consumes.

- pipeline: what a run does to turn a data file into batches: ``read_records``
  (parse, validate, open every image), then ``EncodedDataset`` (decode the
  image, run the processor, render the chat template, tokenize, mask the
  labels) through a ``DataLoader`` with the backend's options
  (``vlft_dataloader_options``) and vlft's ``Collator``; samples/s over the
  whole file, reading included (as in a run's first epoch);
- pipeline_epoch: the same without ``read_records`` (every later epoch);
- step: one LoRA ``train_step`` on a batch of four of the same records;
  samples/s consumed.

Figure: pipeline samples/s over step samples/s (target >= 5), and the same
for pipeline_epoch.
"""

from __future__ import annotations

import pytest
import torch

from bench.support.data import encode_batches, to_device
from bench.support.env import BATCH_SIZE
from bench.support.figures import record
from bench.support.models import adapted_model, plan_for
from bench.support.timing import Interleaved
from bench.support.training import trainer

SAMPLES = 32  # records in the pipeline's file (8 with --benchmark-disable)


@pytest.mark.benchmark(group="data")
def test_data(benchmark, env, size, demo_data, tmp_path):
    from vlft.data.encoding import EncodedDataset
    from vlft.data.records import read_records

    n = BATCH_SIZE * 2 if benchmark.disabled else SAMPLES
    data = tmp_path / "data.jsonl"
    data.write_text("".join(demo_data.read_text().splitlines(keepends=True)[:n]))
    (tmp_path / "imgs").symlink_to(demo_data.parent / "imgs")
    loader_kwargs = plan_for(env, size, "lora").dataloader.loader_kwargs()
    collate = size.collator()
    records = read_records(data)

    def batches(recs):
        loader = torch.utils.data.DataLoader(
            EncodedDataset(recs, size.encoder), batch_size=BATCH_SIZE, collate_fn=collate, **loader_kwargs
        )
        return sum(len(b["input_ids"]) for b in loader)

    host = encode_batches(size, records[:BATCH_SIZE])[0]
    dev = to_device(env, host)
    tr = trainer(env, adapted_model(env, size, "lora")[0])
    timer = Interleaved(
        env,
        {
            "pipeline": lambda: batches(read_records(data)),
            "pipeline_epoch": lambda: batches(records),
            "step": lambda: tr.step(host, dev),
        },
        repeats=2,
    )
    timer.run(benchmark)
    items = {"pipeline": float(n), "pipeline_epoch": float(n), "step": float(BATCH_SIZE)}
    figures = {
        "pipeline/step samples/s": timer.ratio_figure("pipeline", "step", ">= 5", per_item=items),
        "pipeline_epoch/step samples/s": timer.ratio_figure("pipeline_epoch", "step", per_item=items),
    }
    record(
        benchmark,
        env,
        size,
        "data",
        figures,
        timer.summary(items),
        notes=[f"pipeline: {n} records, DataLoader {loader_kwargs}; step: LoRA train_step, batch {BATCH_SIZE}"],
    )
