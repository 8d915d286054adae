"""Answers made of ``field: value`` pairs (``colour: red, defect: none``): per-field accuracy and macro F1 over
the values each field takes, read without regard to case or order.

As a reward (and each answer's value): the share of the reference's pairs the answer names with the same
value. A reference without such pairs cannot be scored (an error before any weight loads: use ``exact``).
"""

from __future__ import annotations

import re
from collections import defaultdict

from vlft import Scorer

FIELD = re.compile(r"^\s*([A-Za-z][\w \-]*?)\s*:\s*(.*?)\s*$")


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


def fields_score(predictions, references, **context):
    out = []
    for prediction, reference in zip(predictions, references):
        wanted = parse_fields(reference)
        if not wanted:
            raise ValueError(
                f"the reference {reference!r} holds no 'field: value' pairs; score it with exact (or another scorer)"
            )
        got = parse_fields(prediction)
        out.append(sum(got.get(k) == v for k, v in wanted.items()) / len(wanted))
    return out


def fields_figures(predictions, references, values, **context):
    pairs: dict[str, list[tuple[str | None, str]]] = defaultdict(list)
    for prediction, reference in zip(predictions, references):
        got = parse_fields(prediction)
        for name, value in parse_fields(reference).items():
            pairs[name].append((got.get(name), value))
    return {
        "fields": {
            name: {"accuracy": sum(p == r for p, r in field) / len(field), "f1": macro_f1(field)}
            for name, field in sorted(pairs.items())
        }
    }


def fields_fit(references, **context):
    return "every reference is 'field: value' pairs" if all(parse_fields(r) for r in references) else ""


SCORERS = [
    Scorer(
        "fields",
        "per-field accuracy and macro F1 of 'field: value' answers (a reward: the share of the "
        "reference's pairs right)",
        fields_score,
        fields_figures,
        fields_fit,
    ),
]
