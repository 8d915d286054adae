"""Group ``sequence``: peak memory per process of a long sample, one process against ``--sequence-parallel 2``.

Three real ``vlft run``s of 2 steps on the embedded default (Qwen2.5-VL, eager attention, LoRA without dropout):
a short-record run (the process's resident baseline: weights, optimizer, libraries), then four text-only records of
``LONG_WORDS`` words (about 4,600 tokens) at batch 1, in one process and in two processes splitting each sample
(``--nproc-per-node 2 --sequence-parallel 2``, gloo). Each run's ``peak_memory_bytes`` is its process's peak
resident memory (rank 0's under torchrun).

Figures: the split's peak above the baseline over one process's (target <= 0.6: the text model's activations
halve, the vision tower and the head do not split), and the plan's estimates per process, the same way. The two
runs' losses are checked equal (as tests/test_sequence_parallel.py does). Too long for ``make test``: skipped under
``--benchmark-disable``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.support.figures import figure, record

LONG_WORDS = 1500
WORDS = "near worn visible box clean colour bottom edge corner seal hole left panel label right product scratch".split()


def _write(path, words: int):
    rows = []
    for i in range(4):
        text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))
        rows.append(
            {"messages": [{"role": "user", "content": f"Describe item {i}."}, {"role": "assistant", "content": text}]}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(out, data, processes: int, *extra: str) -> list[dict]:
    args = ["run", "--nproc-per-node", str(processes), "--quiet", "--backend", "cpu", "--data", str(data)]
    args += ["--output", str(out), "--steps", "2", "--batch-size", "1", "--log-every", "1", "--eval-every", "0"]
    args += ["--eval-samples", "1", "--max-new-tokens", "1", "--save-every", "0", "--seed", "2"]
    args += ["--adapter-opt", "lora_dropout=0", "--no-memory-check", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "vlft", *args], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    plan = json.loads((out / "plan.json").read_text())
    return [{**m, "estimate": plan["memory"]["estimate_bytes"]} for m in steps]


@pytest.mark.benchmark(group="sequence")
def test_sequence_split_memory(benchmark, env, tmp_path):
    if benchmark.disabled:
        pytest.skip("three real runs, two of them over 4,600-token samples: make bench only")
    short, long = _write(tmp_path / "short.jsonl", 20), _write(tmp_path / "long.jsonl", LONG_WORDS)
    seen: dict[str, list[dict]] = {}

    def runs():
        seen["one"] = _run(tmp_path / "one", long, 1)
        seen["split"] = _run(tmp_path / "split", long, 2, "--sequence-parallel", "2")
        # last: the first run of a fresh cache builds the embedded model, whose peak is not a training one
        seen["baseline"] = _run(tmp_path / "baseline", short, 1)

    benchmark.pedantic(runs, rounds=1, iterations=1)
    for a, b in zip(seen["one"], seen["split"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)  # summation order only, as the tests bound it
    base = max(m["peak_memory_bytes"] for m in seen["baseline"])
    one = max(m["peak_memory_bytes"] for m in seen["one"]) - base
    split = max(m["peak_memory_bytes"] for m in seen["split"]) - base
    figures = {
        "split/one peak memory above the baseline": figure(split / one, "<= 0.6"),
        "split/one plan estimate per process": figure(seen["split"][0]["estimate"] / seen["one"][0]["estimate"]),
    }
    record(
        benchmark,
        env,
        None,
        "sequence",
        figures,
        {name: {"peak_memory_bytes": [m["peak_memory_bytes"] for m in runs]} for name, runs in seen.items()},
        notes=[
            f"4 text-only records of {LONG_WORDS} words at batch 1, 2 steps, embedded Qwen2.5-VL, eager attention; "
            f"baseline: the same run on 20-word records ({base / 2**30:.2f} GiB peak)"
        ],
    )
