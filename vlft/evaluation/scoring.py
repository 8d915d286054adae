"""Evaluation's figures: the chosen scorers (``vlft.planning.scorers``) on the answers, and the before/after table.

The result (``eval.json``'s ``before`` and ``after``, ``vlft eval``'s ``scores``) holds ``samples``, every chosen
scorer's figures at the top level (``exact_match``, ``fields``: ``{field: {"accuracy", "f1"}}``, ``anls``, ``iou``
and ``iou_accuracy``, ...), ``scorers`` (``{scorer: [its figures]}``, the table's order) and, where some are,
``lower_is_better`` (the character error rate).
"""

from __future__ import annotations

from vlft.errors import VlftError
from vlft.planning.scorers import finite

RESERVED = ("samples", "scorers", "lower_is_better", "examples", "validation")
LEGACY = {"exact": ["exact_match"], "fields": ["fields"]}  # what a result written before scorers holds


def score(predictions: list[str], references: list[str], scorers, **context) -> dict:
    """Every scorer's figures on ``predictions`` against ``references``; ``scorers``: ``[(label, Scorer)]``."""
    n = len(references)
    result: dict = {"samples": n}
    figures_of: dict[str, list[str]] = {}
    lower: list[str] = []
    for label, scorer in scorers if n else []:
        values = list(scorer.score(predictions, references, **context))
        if len(values) != n or not all(finite(v) for v in values):
            raise VlftError(f"scorer '{label}' answered {values!r} for {n} answers, not one finite number each")
        figures = (
            scorer.figures(predictions, references, values, **context)
            if scorer.figures is not None
            else {label: sum(values) / n}
        )
        for key, value in figures.items():
            if key in RESERVED or key in result:
                raise VlftError(
                    f"scorer '{label}' reports the figure '{key}', which "
                    + ("another scorer reports too" if key in result else "the result keeps for itself")
                )
            result[key] = value
        figures_of[label] = list(figures)
        lower += [f for f in scorer.lower_is_better if f in figures]
    result["scorers"] = figures_of
    if lower:
        result["lower_is_better"] = lower
    return result


def figure_rows(result: dict) -> list[tuple[str, tuple]]:
    """(label, path in the result) of each figure, in the scorers' order; nested figures (fields) one row per
    leaf: ``colour accuracy``, ``colour F1``."""
    order = result.get("scorers") or {k: v for k, v in LEGACY.items() if v[0] in result}
    lower = set(result.get("lower_is_better", ()))
    rows = []
    for keys in order.values():
        for key in keys:
            value = result.get(key)
            if isinstance(value, dict):
                for sub, inner in value.items():
                    if isinstance(inner, dict):
                        rows += [(f"{sub} {_words(k)}", (key, sub, k)) for k in inner]
                    else:
                        rows.append((f"{_words(key)} {sub}", (key, sub)))
            else:
                rows.append((_words(key) + (" (lower is better)" if key in lower else ""), (key,)))
    return rows


def _words(key: str) -> str:
    return "F1" if key == "f1" else key.replace("_", " ")


def figure(result: dict | None, path: tuple):
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def format_table(before: dict | None, after: dict) -> str:
    """A short before/after table for the terminal: every chosen scorer's figures."""
    rows = figure_rows(after) or [("exact match", ("exact_match",))]

    def value(result, path):
        v = figure(result, path)
        return f"{v:.1%}" if isinstance(v, (int, float)) else "-"

    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric'.ljust(width)}  {'before':>8}  {'after':>8}", "-" * (width + 20)]
    for label, path in rows:
        lines.append(f"{label.ljust(width)}  {value(before, path):>8}  {value(after, path):>8}")
    lines.append(f"({after['samples']} validation samples, greedy decoding)")
    return "\n".join(lines)
