"""What a group reports: figures with their targets, and the ``extra_info`` record ``bench/report.py`` reads."""

from __future__ import annotations

from bench.support.env import BenchEnv
from bench.support.models import ModelSize


def figure(value: float | None, target: str | None = None, unit: str = "x", note: str = "") -> dict:
    """One reported figure; ``target`` like "<= 1.25", ">= 2", "0.95..1.05" (checked, never asserted)."""
    met = None
    if value is not None and target:
        t = target.replace(" ", "")
        if t.startswith("<="):
            met = value <= float(t[2:])
        elif t.startswith(">="):
            met = value >= float(t[2:])
        elif ".." in t:
            lo, hi = (float(x) for x in t.split(".."))
            met = lo <= value <= hi
        elif t.startswith("=="):
            met = value == float(t[2:])
    out = {"value": value, "target": target, "met": met, "unit": unit}
    if note:
        out["note"] = note
    return out


def record(
    benchmark,
    env: BenchEnv,
    size: ModelSize | None,
    group: str,
    figures: dict,
    variants: dict,
    memory: dict | None = None,
    notes: list[str] | None = None,
    **extra,
) -> None:
    """Everything ``bench/report.py`` reads of this benchmark, into its ``extra_info``."""
    benchmark.extra_info.update(
        {
            "group": group,
            "model": size.name if size else None,
            **env.describe(),
            "figures": figures,
            "variants": variants,
            "memory": memory or {},
            "notes": notes or [],
            "benchmark_disabled": bool(benchmark.disabled),
            **extra,
        }
    )
