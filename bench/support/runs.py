"""Real ``vlft run``s for the groups that time the run's own loop (``packing``, ``head-runs``): one run's per-step
metrics, and the real tokens/s of its steps."""

from __future__ import annotations

import json


def run_steps(registry, steps: int, **values) -> list[dict]:
    """One ``vlft run`` (``vlft.testing.run``: the CLI's path) of ``steps`` steps, logged every step, with no
    evaluation or checkpoint; ``values`` are the rest of its config. Its per-step metrics from ``metrics.jsonl``."""
    from vlft.config import build_config
    from vlft.testing import run

    config = build_config(
        {}, dict(method="lora", steps=steps, log_every=1, eval_every=0, eval_samples=0, save_every=0, seed=0, **values)
    )
    result = run(config, registry)
    lines = [json.loads(x) for x in (result.output / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if "step_time_s" in m]
    assert len(metrics) == steps, len(metrics)
    return metrics


def rates(steps: list[dict]) -> dict:
    """Seconds, real (non-padding) tokens, positions and real tokens/s over the steps after the first (which
    warms the allocator), from each step's metrics."""
    kept = steps[1:]
    seconds = sum(m["step_time_s"] for m in kept)
    real = sum(m["effective_tokens_per_s"] * m["step_time_s"] for m in kept)
    positions = sum(m["tokens_per_s"] * m["step_time_s"] for m in kept)
    return {"seconds": seconds, "real_tokens": real, "positions": positions, "real_tokens_per_s": real / seconds}
