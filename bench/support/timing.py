"""Times a group's variants side by side (``Interleaved``): the figures' times and ratios.

How the groups time their variants
----------------------------------
Each benchmark test compares its variants in ONE pytest-benchmark call: the
benchmarked function is one *round* that runs every variant once (or a few
times, ``Interleaved(repeats=...)``), in an order rotated every time
(A B C, B C A, C A B, ...), each call timed on its own (with a device
synchronisation before and after on accelerators).
pytest-benchmark decides how many rounds to run (``--benchmark-min-rounds``,
``--benchmark-max-time``) and its own statistics describe a whole round; the
per-variant medians, the ratios between them and the memory figures go into
``benchmark.extra_info``. Interleaving means a burst of background load hits
every variant alike, so the ratios are honest even on a busy machine, where
separate benchmarks run one after the other would not be. One untimed
warm-up round comes first (first calls pay for lazy initialisation).

With ``--benchmark-disable`` (the default ``make test``) the round runs once,
on a reduced workload where a group says so, and no warm-up: the code is
exercised so it cannot rot, and the figures it computes mean nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.support.env import BenchEnv
from bench.support.figures import figure


class Interleaved:
    """Times several variants side by side: one round runs each once, in an order rotated every time.

    ``repeats`` sub-rounds per benchmarked round give more paired samples to
    groups whose variants differ by a few percent (only when benchmarking).
    """

    def __init__(self, env: BenchEnv, variants: dict[str, Callable[[], Any]], repeats: int = 1):
        self.env = env
        self.variants = variants
        self.repeats = repeats
        self.times: dict[str, list[float]] = {name: [] for name in variants}
        self.turn = 0

    def _once(self) -> None:
        names = list(self.variants)
        k = self.turn % len(names)
        for name in names[k:] + names[:k]:
            self.env.synchronize()
            t0 = time.perf_counter()
            self.variants[name]()
            self.env.synchronize()
            self.times[name].append(time.perf_counter() - t0)
        self.turn += 1

    def run(self, benchmark, rounds: int | None = None) -> None:
        """Warm up (when benchmarking), then let pytest-benchmark run the rounds (exactly ``rounds`` if given:
        for groups whose figures are not times and whose steps are slow)."""
        repeats = 1 if benchmark.disabled else self.repeats
        if not benchmark.disabled:
            self._once()
            self.times = {name: [] for name in self.variants}

        def one_round():
            for _ in range(repeats):
                self._once()

        if rounds is None or benchmark.disabled:
            benchmark(one_round)
        else:
            benchmark.pedantic(one_round, rounds=rounds, iterations=1)

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ratio(self, num: str, den: str, per_item: dict[str, float] | None = None) -> float:
        """Median over sub-rounds of the paired time ratio num/den (or of throughputs when ``per_item``).

        Pairing each sample with its partner from the same sub-round cancels
        load that drifts over the run; the ratio of the medians is kept in
        ``summary()`` for comparison.
        """
        pairs = [a / b for a, b in zip(self.times[num], self.times[den])]
        if per_item:
            pairs = [(per_item[num] / a) / (per_item[den] / b) for a, b in zip(self.times[num], self.times[den])]
        return statistics.median(pairs)

    def ratio_figure(self, num: str, den: str, target: str | None = None, per_item: dict | None = None) -> dict:
        """A figure from ``ratio`` (paired), with the ratio of the medians alongside."""
        if per_item:
            of_medians = (per_item[num] / self.median(num)) / (per_item[den] / self.median(den))
        else:
            of_medians = self.median(num) / self.median(den)
        out = figure(self.ratio(num, den, per_item), target)
        out["ratio_of_medians"] = of_medians
        return out

    def summary(self, per_call_items: dict[str, float] | None = None) -> dict:
        """Per variant: median, min and max seconds per call and the samples; items/s where given."""
        out = {}
        for name, ts in self.times.items():
            med = statistics.median(ts)
            entry = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "samples": len(ts)}
            if per_call_items and name in per_call_items:
                entry["items"] = per_call_items[name]
                entry["items_per_s"] = per_call_items[name] / med
            out[name] = entry
        return out
