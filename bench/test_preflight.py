"""Group ``preflight``: a run's data check on the field report's shape, 16,000 records over 2,000 images of
448x448 (``bench.support.data.write_preflight_dataset``; 1,600 over 200 with --benchmark-disable).

- cold: ``planning.preflight.load_and_check_data`` with an empty cache: read and validate every record, decode
  each unique image once, render and measure every record in parallel workers (all usable cores);
- cold, 1 worker: the same in this process alone (``VLFT_CHECK_WORKERS=1``);
- warm: the same files again (a ``--resume``, a later run): the checked result from the cache.

Figures: records/s cold (target >= 1,500 on 2 cores), cold with 1 worker, warm.
"""

from __future__ import annotations

import os
import time

import pytest

from bench.support.data import write_preflight_dataset
from bench.support.figures import figure, record


def _check(config, encoder) -> float:
    from vlft.planning.preflight import load_and_check_data

    start = time.perf_counter()
    train, _, _ = load_and_check_data(config, encoder)
    assert train
    return time.perf_counter() - start


@pytest.mark.benchmark(group="preflight")
def test_preflight(benchmark, env, embedded_size, tmp_path_factory, monkeypatch):
    import vlft.planning.checked as checked
    from vlft.config import build_config
    from vlft.data import records

    n, images = (1_600, 200) if benchmark.disabled else (16_000, 2_000)
    folder = tmp_path_factory.mktemp("preflight")
    train = write_preflight_dataset(folder / "set", n, images)
    val = folder / "val.jsonl"
    val.write_text(
        "".join(train.read_text().splitlines(keepends=True)[:16]).replace('"imgs/', f'"{train.parent}/imgs/')
    )
    config = build_config({}, dict(backend="cpu", data=str(train), val_data=str(val), output=str(folder / "r")))
    times = {}

    def measure():
        for name, workers in (("cold, 1 worker", "1"), ("cold", None)):
            monkeypatch.setattr(checked, "cache_dir", lambda name=name: folder / f"cache-{name}".replace(" ", ""))
            monkeypatch.setattr(records, "_CHECKED_IMAGES", {})
            if workers:
                monkeypatch.setenv("VLFT_CHECK_WORKERS", workers)
            else:
                monkeypatch.delenv("VLFT_CHECK_WORKERS", raising=False)
            times[name] = _check(config, embedded_size.encoder)
        monkeypatch.setattr(records, "_CHECKED_IMAGES", {})
        times["warm"] = _check(config, embedded_size.encoder)  # the parallel run's cache

    from vlft.data.lengths import check_workers

    workers_used, load = check_workers(), os.getloadavg()[0]
    benchmark.pedantic(measure, rounds=1, iterations=1)
    total = n + 16
    figures = {
        "preflight records/s": figure(total / times["cold"], ">= 1500", unit="records/s"),
        "preflight records/s, 1 worker": figure(total / times["cold, 1 worker"], unit="records/s"),
        "preflight records/s, cached": figure(total / times["warm"], unit="records/s"),
    }
    record(
        benchmark,
        env,
        embedded_size,
        "preflight",
        figures,
        {k: {"seconds": v} for k, v in times.items()},
        notes=[
            f"{n} records over {images} images of 448x448; workers: {workers_used}; load average before: "
            f"{load:.1f} on {os.cpu_count()} cores"
        ],
    )
