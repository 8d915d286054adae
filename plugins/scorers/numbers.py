"""Numeric answers: relaxed accuracy (ChartQA; Masry et al., 2022, after Methani et al., 2020), as
pix2struct's ``relaxed_correctness`` computes it: where the answer and the reference both read as numbers (a
trailing ``%`` divides by 100) and the reference is not 0, correct when ``|answer - reference| / |reference| <=
0.05``; otherwise correct when the two are equal ignoring case. Both are trimmed first.
"""

from __future__ import annotations

from vlft import Scorer

from ._common import answers_of

MAX_RELATIVE_CHANGE = 0.05


def to_float(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_correct(prediction: str, reference: str) -> bool:
    p, r = to_float(prediction), to_float(reference)
    if p is not None and r:
        return abs(p - r) / abs(r) <= MAX_RELATIVE_CHANGE
    return prediction.strip().lower() == reference.strip().lower()


def relaxed_score(predictions, references, **context):
    return [
        float(any(relaxed_correct(p, r) for r in rs)) for p, rs in zip(predictions, answers_of(references, context))
    ]


def relaxed_figures(predictions, references, values, **context):
    return {"relaxed_accuracy": sum(values) / len(values) if values else 0.0}


def relaxed_fit(references, **context):
    return "every reference is a number" if all(to_float(r) is not None for r in references) else ""


SCORERS = [
    Scorer(
        "relaxed",
        "relaxed accuracy: a number within 5% of the reference, other answers exact (ChartQA)",
        relaxed_score,
        relaxed_figures,
        relaxed_fit,
    ),
]
