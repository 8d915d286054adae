"""Group 6, ``dispatch``: plugin hook calls and host-device synchronisations inside one training step.

Hook calls: ``vlft.measure.HookCallCounter`` (the counter ``tests/test_run.py``
uses too) sees every vlft hook called through any registry (the one the
models were built with, the process-wide one, one made on the spot) during
one ``vlft.train.train_step``; target 0 (DESIGN.md: no hook inside the step).

Synchronisations: ``bench.support.counters.sync_counter``, a TorchDispatchMode that
sees every aten operation of the step (forward, backward, clipping,
optimizer) on any device, counts scalar reads, data-dependent shapes and
blocking device-to-host copies, and attributes each to the code that asked
for it. ``vlft_own`` counts those asked for by vlft's own code.

The pytest-benchmark timing of this group is that of the instrumented step
and is not a figure. Two plain tests (run by ``make test``) assert zero
hook calls and zero synchronisations of vlft's own in a step.
"""

from __future__ import annotations

import pytest

from bench.support.counters import sync_counter
from bench.support.data import encode_batches, to_device
from bench.support.distributed import two_process_syncs
from bench.support.env import BATCH_SIZE
from bench.support.figures import figure, record
from bench.support.models import adapted_model
from bench.support.training import trainer
from vlft.measure import HookCallCounter

METHODS = ("lora", "oft")


def counted_step(env, size, records, method) -> dict:
    from vlft.data.batching import label_count

    host = encode_batches(size, records[:BATCH_SIZE])[0]
    dev = to_device(env, host)
    # the accelerator's step: on the CPU, vlft reads the non-finite flag on the host, which waits for nothing
    # there but would be a sync on a device, and syncs are counted as they would be on a device
    tr = trainer(env, adapted_model(env, size, method)[0], as_on_a_device=True)
    tr.step(host, dev)  # first step: lazy initialisation (optimizer state) out of the way
    tokens = label_count(host)  # on the host, before the step, as the trainer's step does
    counter = sync_counter(env.device, host_tensors=tr.host_state())
    with HookCallCounter() as hooks, counter:
        tr.step_counted(tokens, dev)
    return {"hook_calls": len(hooks.calls), "hooks": sorted(set(hooks.calls)), "syncs": counter.summary()}


@pytest.mark.benchmark(group="dispatch")
def test_dispatch(benchmark, env, size, demo_records):
    results = {}

    def measure():
        for method in METHODS:
            results[method] = counted_step(env, size, demo_records, method)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    figures = {}
    for method, r in results.items():
        figures[f"{method} hook calls per step"] = figure(r["hook_calls"], "== 0", unit="")
        figures[f"{method} syncs per step"] = figure(r["syncs"]["total"], unit="")
        figures[f"{method} syncs per step by vlft"] = figure(r["syncs"]["vlft_own"], "== 0", unit="")
    if env.device.type == "cpu":  # two processes over gloo: the label count and the stop flag are reduced
        two = two_process_syncs(demo_records, "lora")
        results["lora, 2 processes"] = two
        figures["lora syncs per step by vlft, 2 processes"] = figure(
            max(r["syncs"]["vlft_own"] for r in two), "== 0", unit=""
        )
    record(
        benchmark,
        env,
        size,
        "dispatch",
        figures,
        {},
        dispatch=results,
        notes=["syncs on CPU: every scalar read / data-dependent op counted as the sync it would be on a device"],
    )


@pytest.mark.parametrize("method", METHODS)
def test_no_hook_call_inside_a_training_step(env, embedded_size, demo_records, method):
    r = counted_step(env, embedded_size, demo_records, method)
    assert r["hook_calls"] == 0, r["hooks"]


@pytest.mark.parametrize("method", METHODS)
def test_vlft_itself_makes_no_host_device_sync_in_a_step(env, embedded_size, demo_records, method):
    r = counted_step(env, embedded_size, demo_records, method)
    assert r["syncs"]["vlft_own"] == 0, r["syncs"]["top_sites"]


def test_vlft_itself_makes_no_host_device_sync_in_a_step_with_two_processes(env, demo_records):
    if env.device.type != "cpu":
        pytest.skip("two processes over gloo on the host")
    results = two_process_syncs(demo_records, "lora")
    for r in results:
        assert r["syncs"]["vlft_own"] == 0, r["syncs"]["top_sites"]
        assert r["agreed"] is None
    # the label count is summed over both processes
    assert results[0]["global_tokens"] == results[1]["global_tokens"] == sum(r["local_tokens"] for r in results)
