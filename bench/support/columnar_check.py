"""One cold and one cached data check of a set, in a process of its own (``bench/test_columnar.py``): its
resident memory is the check's alone, not what earlier scales left behind.

``python -m bench.support.columnar_check MODEL DATA VAL CACHE`` prints one JSON line: seconds cold and cached,
records, and the process's resident memory (VmRSS, sampled every 20 ms) before, at its peak during the
cold check, after it with the checked records held, and at its peak during a 2-step ``vlft run`` on the same
set in this process (its check from the cache; the model, its optimizer and one batch added). The check's
forked workers are separate processes and not counted (they hold a chunk of rows and one processor each).
The figure that should not grow with the set is the difference between scales, each in a process of its
own: what the model and libraries take is the same at every scale.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """The highest VmRSS seen while the block runs, sampled on a thread."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def main(model: str, data: str, val: str, cache: str) -> dict:
    import os

    os.environ["VLFT_CACHE"] = cache
    from vlft.data.encoding import SampleEncoder
    from vlft.models.loading import load_processor, model_config_and_family
    from vlft.registry import load_registry

    registry = load_registry()
    _, family = model_config_and_family(model, registry)
    return measure(SampleEncoder(load_processor(model, family, registry), family=family), data, val, cache, model)


def measure(encoder, data: str, val: str, cache: str, model: str) -> dict:
    """The figures of one cold and one cached check and a 2-step run (``VLFT_CACHE`` is the caller's to point
    at ``cache``)."""
    from vlft.config import build_config
    from vlft.planning.preflight import load_and_check_data

    values = dict(backend="cpu", data=[str(data)], val_data=str(val), output=str(Path(cache) / "r"))
    config = build_config({}, values)
    before = rss_bytes()
    start = time.perf_counter()
    with PeakRss() as peak:
        train, val_records, _ = load_and_check_data(config, encoder)
    cold = time.perf_counter() - start
    after = rss_bytes()
    records = len(train) + len(val_records)
    del train, val_records
    start = time.perf_counter()
    train, val_records, _ = load_and_check_data(config, encoder)
    cached = time.perf_counter() - start
    del train, val_records
    with PeakRss() as training:
        steps = two_steps(values, model)
    return {
        "records": records,
        "cold_s": cold,
        "cached_s": cached,
        "rss_before": before,
        "rss_peak": peak.peak,
        "rss_after": after,
        "rss_training": training.peak,
        "steps": steps,
    }


def two_steps(values: dict, model: str) -> int:
    """A 2-step ``vlft run`` on the checked set (the check's options unchanged, so it comes from the cache);
    one generated answer before and after, of 1 token. The steps it logged."""
    from vlft.commands.run import execute
    from vlft.config import build_config
    from vlft.registry import load_registry

    out = Path(values["output"])
    execute(
        load_registry(),
        build_config(
            {},
            dict(
                values,
                model=model,
                steps=2,
                batch_size=2,
                log_every=1,
                eval_every=0,
                save_every=0,
                eval_samples=1,
                max_new_tokens=1,
            ),
        ),
        progress=False,
    )
    return sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line)


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
