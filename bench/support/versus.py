"""What the side-by-side scripts against TRL share (bench/dpo_vs_trl.py, bench/grpo_vs_trl.py): their options
and the interleaved timing of their steppers."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def options(description: str, default_steps: int, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=default_steps, help="steps per timing")
    parser.add_argument("--rounds", type=int, default=3, help="timings of each, in turns")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return parser.parse_args(argv)


def interleaved(runs: dict[str, Callable[[int], float | None]], rounds: int, steps: int):
    """Each stepper ``steps(n)`` runs ``n`` steps (returning the seconds it spent generating, or None); after a
    2-step warm-up each (first-step allocations, AdamW state), ``rounds`` timings of each in turns. Returns
    ({name: seconds a step, per round}, {name: generating seconds a step, per round}, {name: median s/step})."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    generating: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run(2)
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            gen = run(steps)
            times[name].append((time.perf_counter() - t0) / steps)
            generating[name].append((gen or 0.0) / steps)
    return times, generating, {name: statistics.median(t) for name, t in times.items()}
