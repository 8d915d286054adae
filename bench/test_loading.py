"""Group ``loading``: each process's host memory while ``--shard fsdp`` loads, and what ``--offload cpu`` costs.

Two real ``vlft run --nproc-per-node 2 --shard fsdp`` runs of ``STEPS`` steps on the CPU (gloo) over a generated
Qwen2.5-VL checkpoint of 0.3 GiB in fp32 (``bench/loading_memory.py``'s ``SMALL``), each process a
``bench/loading_probe.py`` worker: offload off, then ``--offload cpu``.

Figures: each process's own memory (``RssAnon``) grown while loading, over its share of the weights (each reads
only its own) and over the plan's figure (its share plus the largest tensor; target <= 1), and the same of its resident memory (``VmHWM``, which also counts the safetensors
pages it mapped: about 2); the bound of ``bench/loading_memory.py`` is asserted. Offload: step time with over
without (median of steps 2..``STEPS``) and the peak resident memory per process through step 1 with over
without. On the CPU the shares already live in host memory, so offload copies nothing between devices: the ratio
is the policy's bookkeeping (FSDP's copies to and from the "device", the CPU, and AdamW on the host), not the
transfer cost a GPU pays; ``test_offload_on_the_device`` measures that one where a GPU is present. Both runs train
the same losses (asserted). Too long for ``make test``: skipped under ``--benchmark-disable``.
"""

from __future__ import annotations

import statistics

import pytest

from bench.loading_memory import SMALL, bound_violations, checkpoint, loading_figures, probed_run, weight_bytes
from bench.support.figures import figure, record
from vlft.planning.sharding import loading_bytes

STEPS = 5


def _demo_train():
    from vlft.data.demo import write_demo_dataset
    from vlft.models.embedded import cache_root

    return write_demo_dataset(cache_root() / "demo-data").train


def _later_steps(run: dict) -> float:
    return statistics.median(run["step_time_s"][1:])  # step 1 builds FSDP's buffers and AdamW's state


@pytest.mark.benchmark(group="loading")
def test_loading_memory_and_offload_per_process(benchmark, env, tmp_path):
    if benchmark.disabled:
        pytest.skip("two real 2-process runs on a 0.3 GiB checkpoint: make bench only")
    if env.backend != "cpu":
        pytest.skip("2 processes on the CPU with gloo; on a GPU test_offload_on_the_device measures offload")
    model, data = checkpoint(SMALL), _demo_train()
    whole, largest = weight_bytes(model)
    share = -(-whole // 2)
    seen: dict[str, dict] = {}

    def runs():
        seen["none"] = probed_run(model, data, tmp_path / "none", 2, "auto", steps=STEPS)
        seen["cpu"] = probed_run(model, data, tmp_path / "cpu", 2, "auto", "--offload", "cpu", steps=STEPS)

    benchmark.pedantic(runs, rounds=1, iterations=1)
    for run in seen.values():
        assert run["loading"] == "each", run["loading"]
        assert not bound_violations(run, whole, largest), bound_violations(run, whole, largest)
    assert seen["cpu"]["losses"] == pytest.approx(seen["none"]["losses"], rel=1e-6)
    loading = {rank: loading_figures(point, share) for rank, point in seen["none"]["ranks"].items()}
    peaks = {
        name: {rank: loading_figures(point, share)["peak_through_step_1_bytes"] for rank, point in run["ranks"].items()}
        for name, run in seen.items()
    }
    figures = {
        **{
            f"rank {rank}: own memory grown while loading / its share": figure(f["own_growth_over_share"])
            for rank, f in loading.items()
        },
        **{  # the plan's figure: its share plus the largest tensor in flight (loading_bytes)
            f"rank {rank}: own memory grown while loading / the plan's loading figure": figure(
                f["own_growth_bytes"] / loading_bytes(whole, largest, 2, "each"), "<= 1"
            )
            for rank, f in loading.items()
        },
        **{
            f"rank {rank}: resident memory grown while loading / its share (mapped pages too)": figure(
                f["resident_growth_over_share"]
            )
            for rank, f in loading.items()
        },
        "offload cpu / none: step time (CPU: bookkeeping only)": figure(
            _later_steps(seen["cpu"]) / _later_steps(seen["none"])
        ),
        **{
            f"rank {rank}: offload cpu / none: peak resident memory through step 1": figure(
                peaks["cpu"][rank] / peaks["none"][rank]
            )
            for rank in peaks["none"]
        },
    }
    record(
        benchmark,
        env,
        None,
        "loading",
        figures,
        {
            name: {"step_time_s": run["step_time_s"], "peak_through_step_1_bytes": peaks[name]}
            for name, run in seen.items()
        },
        notes=[
            f"checkpoint {whole / 2**30:.2f} GiB (largest tensor {largest / 2**20:.0f} MiB), 2 processes, each "
            f"reading its own 1/2; before loading each held {loading['0']['before_bytes'] / 2**30:.2f} GiB",
            "on the CPU --offload cpu moves nothing between devices: its ratio is the policy's bookkeeping cost only",
        ],
    )


@pytest.mark.cuda
@pytest.mark.benchmark(group="loading")
def test_offload_on_the_device(benchmark, env, tmp_path):
    """One process on the GPU, ``--shard fsdp`` with and without ``--offload cpu``: step time (each block copied
    to the device and its gradients back, AdamW on the host) and the device's peak (the backend's reader)."""
    if benchmark.disabled:
        pytest.skip("two real runs: make bench only")
    if env.backend != "cuda":
        pytest.skip("needs --backend cuda and a GPU")
    model, data = checkpoint(SMALL), _demo_train()
    seen: dict[str, dict] = {}

    def runs():
        for name, extra in (("none", ()), ("cpu", ("--offload", "cpu"))):
            seen[name] = probed_run(model, data, tmp_path / name, 1, "auto", *extra, steps=STEPS, backend="cuda")

    benchmark.pedantic(runs, rounds=1, iterations=1)
    assert seen["cpu"]["losses"] == pytest.approx(seen["none"]["losses"], rel=1e-4)
    figures = {
        "offload cpu / none: step time (cuda)": figure(_later_steps(seen["cpu"]) / _later_steps(seen["none"])),
        "offload cpu / none: peak device memory": figure(
            max(seen["cpu"]["peak_memory_bytes"]) / max(seen["none"]["peak_memory_bytes"])
        ),
    }
    record(
        benchmark,
        env,
        None,
        "loading",
        figures,
        {n: {"step_time_s": r["step_time_s"], "peak_memory_bytes": r["peak_memory_bytes"]} for n, r in seen.items()},
        notes=["1 process on the GPU, the 0.3 GiB checkpoint; the offloaded shares copied in and out each step"],
    )
