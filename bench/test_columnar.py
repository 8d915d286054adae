"""Group ``columnar``: a run's data check on a hub-shaped Parquet set (``bench.support.data.write_parquet_set``:
LLaVA-OneVision's columns, shards of 10,000 rows in row groups of 1,000, JPEG bytes of 224x224 drawn from a
pool of distinct images, one per ten records up to 10,000), at 5 x 10^3 and 2 x 10^4 records by default
(``--columnar-scales``, e.g. ``10000,100000``; 200 with --benchmark-disable). Each scale runs in a process of its own (``bench/support/columnar_check.py``):
``planning.preflight.load_and_check_data`` cold (every row read and checked, each distinct image decoded
once, every record measured by the parallel workers), then again from the cache, then a 2-step ``vlft run``
on the set; the process's resident memory before, at its peak during the cold check, after it with the
checked rows held (``data.lazy``: places and figures, not Records), and at its peak during the 2 steps. The
growth per record between scales (each in a process of its own, so the model and libraries cancel out) is
the figure that must stay near 0. At the smallest
scale the same set converted to JSON Lines (``vlft data convert``, images written as files) is checked too,
the rate JSON Lines gives on the same records.

Larger scales are left to ``--columnar-scales``: ``make bench`` must finish within 15 minutes on 2 cores, and
10^5 records add about 2 minutes (922 records/s measured on 2 cores), 10^6 about 15 (1,274 records/s: 13 min
5 s cold, plus writing the set); the growth per record between the two default scales says what more records
would hold.

Figures: records/s cold at each scale (target: JSON Lines' own rate on the same records), records/s from
the cache, MiB resident at the peak and held after the check, bytes held per record, MiB resident at the
peak of the 2 training steps, and bytes resident per record between scales after the check and during
the steps (target ~0: the places and figures, 44 bytes a record).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.support.data import write_parquet_set
from bench.support.figures import figure, record

MIB = 2**20


def _check(size, data: Path, val: Path, cache: Path, in_process: bool = False) -> dict:
    if in_process:  # the tiny workload of --benchmark-disable: the same check, without a process to start
        from bench.support.columnar_check import measure

        return measure(size.encoder, data, val, cache, str(size.path))
    model = size.path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "bench.support.columnar_check", model, str(data), str(val), str(cache)],
        capture_output=True,
        text=True,
        cwd=root,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.benchmark(group="columnar")
def test_columnar_check(benchmark, env, embedded_size, tmp_path_factory, monkeypatch, request):
    from vlft.data.convert import convert

    asked = tuple(sorted(int(n) for n in request.config.getoption("--columnar-scales").split(",")))
    scales = (200,) if benchmark.disabled else asked
    folder = tmp_path_factory.mktemp("columnar")
    val = next(write_parquet_set(folder / "val", 16, 4, seed=1).glob("*.parquet"))
    results = {}
    monkeypatch.setenv("VLFT_CACHE", str(folder / "cache"))  # where an in-process check keeps its result

    def measure():
        for n in scales:
            data = write_parquet_set(folder / f"set-{n}", n, max(1, min(10_000, n // 10)))
            results[n] = _check(embedded_size, data, val, folder / f"cache-{n}", benchmark.disabled)
        jsonl = folder / "jsonl" / "train.jsonl"
        convert(folder / f"set-{scales[0]}", jsonl)
        results["jsonl"] = _check(embedded_size, jsonl, val, folder / "cache-jsonl", benchmark.disabled)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    jsonl_rate = results["jsonl"]["records"] / results["jsonl"]["cold_s"]
    figures = {f"JSON Lines records/s, cold ({scales[0]:,})": figure(jsonl_rate, unit="records/s")}
    for n in scales:
        r = results[n]
        figures[f"Parquet records/s, cold ({n:,})"] = figure(
            r["records"] / r["cold_s"], f">= {jsonl_rate:.0f}", unit="records/s"
        )
        figures[f"Parquet records/s, cached ({n:,})"] = figure(r["records"] / r["cached_s"], unit="records/s")
        figures[f"MiB resident, peak during the check ({n:,})"] = figure(r["rss_peak"] / MIB, unit="MiB")
        figures[f"MiB held after the check ({n:,})"] = figure((r["rss_after"] - r["rss_before"]) / MIB, unit="MiB")
        figures[f"bytes held per record ({n:,})"] = figure((r["rss_after"] - r["rss_before"]) / r["records"], unit="B")
        figures[f"MiB resident, peak during 2 training steps ({n:,})"] = figure(r["rss_training"] / MIB, unit="MiB")
    for a, b in zip(scales, scales[1:]):  # what one more record costs: the model and libraries cancel out
        more = results[b]["records"] - results[a]["records"]
        for key, what in (("rss_after", "after the check"), ("rss_training", "during 2 training steps")):
            figures[f"bytes resident per record {what} ({a:,} -> {b:,})"] = figure(
                (results[b][key] - results[a][key]) / more, "~0 (a few tens: the rows' places and figures)", unit="B"
            )
    record(
        benchmark,
        env,
        embedded_size,
        "columnar",
        figures,
        {str(k): v for k, v in results.items()},
        notes=[
            f"workers: {os.environ.get('VLFT_CHECK_WORKERS') or 'usable cores up to 8'}; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        ],
    )
    assert [results[n]["records"] for n in scales] == [n + 16 for n in scales]
    assert [results[n]["steps"] for n in scales] == [2 for _ in scales]
