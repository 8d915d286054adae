"""Group 2, ``loop_overhead``: vlft's training step against a plain hand-written PyTorch + PEFT step.

Both variants drive the very same LoRA model, optimizer (AdamW), scheduler
(cosine) and device batch, alternately, under the backend's precision
policy (autocast and loss scaling where it has them):

- vlft: what ``vlft.training.trainer.Trainer.train_step`` does per step: count the label
  tokens on the host batch (``label_count``), then ``train_step``;
- plain: the tutorial loop: ``model(**batch, labels=...).loss.backward()``,
  ``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``,
  ``optimizer.zero_grad()``.

Sizes: the embedded default, the wide one and ``embedded:qwen3-vl`` (the last only with benchmarks enabled).

Figure: vlft/plain step time (target <= 1.03).
"""

from __future__ import annotations

import pytest
import torch

from bench.support.data import encode_batches, to_device
from bench.support.env import BATCH_SIZE
from bench.support.figures import record
from bench.support.models import adapted_model
from bench.support.timing import Interleaved
from bench.support.training import trainer


def plain_step(env, model, optimizer, scheduler, scaler=None, max_grad_norm: float = 1.0):
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch):
        with env.autocast():
            loss = model(**batch).loss  # the batch carries labels: transformers computes the loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


@pytest.mark.benchmark(group="loop_overhead")
def test_loop_overhead(benchmark, env, family_size, demo_records):
    size = family_size
    host = encode_batches(size, demo_records[:BATCH_SIZE])[0]
    dev = to_device(env, host)
    model, _ = adapted_model(env, size, "lora")
    tr = trainer(env, model)
    scaler = env.precision.make_scaler() if env.precision.loss_scaling else None
    plain = plain_step(env, model, tr.optimizer, tr.scheduler, scaler)
    timer = Interleaved(env, {"vlft": lambda: tr.step(host, dev), "plain": lambda: plain(dev)}, repeats=4)
    timer.run(benchmark)
    figures = {"vlft/plain step time": timer.ratio_figure("vlft", "plain", "<= 1.03")}
    record(
        benchmark,
        env,
        size,
        "loop_overhead",
        figures,
        timer.summary({"vlft": BATCH_SIZE, "plain": BATCH_SIZE}),
        notes=["same LoRA model, optimizer, scheduler and batch for both, stepped alternately"],
    )
