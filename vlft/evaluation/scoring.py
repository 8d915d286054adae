"""Evaluation: greedy generation on the validation split, and validation loss.

Scores: exact match (after trimming and collapsing white space) and, for
answers made of ``field: value`` pairs (``colour: red, defect: none``),
per-field accuracy and macro F1 over the values each field takes.
"""

from __future__ import annotations

import re
from collections import defaultdict

FIELD = re.compile(r"^\s*([A-Za-z][\w \-]*?)\s*:\s*(.*?)\s*$")


def normalise(text: str) -> str:
    return " ".join(text.strip().split())


def parse_fields(text: str) -> dict[str, str]:
    """``"colour: red, defect: none"`` -> ``{"colour": "red", "defect": "none"}`` ({} when not in that form)."""
    out: dict[str, str] = {}
    for part in re.split(r"[,\n;]", text):
        if not part.strip():
            continue
        m = FIELD.match(part)
        if not m:
            return {}
        out[m.group(1).strip().lower()] = m.group(2).strip().lower()
    return out


def macro_f1(pairs: list[tuple[str | None, str]]) -> float:
    """Macro F1 over the reference values; a missing prediction counts as wrong."""
    labels = sorted({ref for _, ref in pairs})
    scores = []
    for label in labels:
        tp = sum(1 for p, r in pairs if p == label and r == label)
        fp = sum(1 for p, r in pairs if p == label and r != label)
        fn = sum(1 for p, r in pairs if p != label and r == label)
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores) if scores else 0.0


def score(predictions: list[str], references: list[str]) -> dict:
    n = len(references)
    exact = sum(normalise(p) == normalise(r) for p, r in zip(predictions, references))
    fields: dict[str, list[tuple[str | None, str]]] = defaultdict(list)
    for pred, ref in zip(predictions, references):
        ref_fields = parse_fields(ref)
        pred_fields = parse_fields(pred)
        for name, value in ref_fields.items():
            fields[name].append((pred_fields.get(name), value))
    return {
        "samples": n,
        "exact_match": exact / n if n else 0.0,
        "fields": {
            name: {"accuracy": sum(p == r for p, r in pairs) / len(pairs), "f1": macro_f1(pairs)}
            for name, pairs in sorted(fields.items())
        },
    }


def format_table(before: dict | None, after: dict) -> str:
    """A short before/after table for the terminal."""
    rows = [("exact match", "exact_match", None)]
    for name in after.get("fields", {}):
        rows.append((f"{name} accuracy", name, "accuracy"))
        rows.append((f"{name} F1", name, "f1"))

    def value(result, key, sub):
        if result is None:
            return "-"
        if sub is None:
            return f"{result[key]:.1%}"
        f = result.get("fields", {}).get(key)
        return f"{f[sub]:.1%}" if f else "-"

    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric'.ljust(width)}  {'before':>8}  {'after':>8}", "-" * (width + 20)]
    for label, key, sub in rows:
        lines.append(f"{label.ljust(width)}  {value(before, key, sub):>8}  {value(after, key, sub):>8}")
    lines.append(f"({after['samples']} validation samples, greedy decoding)")
    return "\n".join(lines)
