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


def trl_model(registry, objective: str, data, batch_size: int):
    """The plan of a one-step vlft run of ``objective`` on ``data`` (train, val) and the model it trains, built
    as that run builds it (same base, LoRA and targets): what TRL's trainer is handed."""
    import tempfile

    from vlft.config import build_config
    from vlft.models.loading import load_model
    from vlft.planning.preflight import plan_run

    train, val = data
    values = dict(backend="cpu", objective=objective, data=str(train), val_data=str(val), steps=1)
    config = build_config({}, dict(values, output=tempfile.mkdtemp(), batch_size=batch_size))
    plan = plan_run(registry, config)
    model = registry.first(
        "vlft_apply_adapter",
        method="lora",
        model=load_model(plan.model_path, plan.attention, plan.precision, family=plan.family),
        targets=plan.targets,
        config=config,
        target_parameters=[],
        family=plan.family,
    )
    return plan, model


def trl_messages(turns) -> list[dict]:
    """A record's turns as TRL's conversational rows have them (an image part where the text has ``<image>``)."""
    return [
        {
            "role": t.role,
            "content": [
                {"type": "image"} if part == "<image>" else {"type": "text", "text": part}
                for part in t.text.replace("<image>", "\0<image>\0").split("\0")
                if part
            ],
        }
        for t in turns
    ]
