"""Structured extraction: JSON-field F1.

The reference is a JSON object; the answer's JSON object is read from it (the whole answer, a ```json fenced
block, or the text from its first ``{`` to its last ``}``). Both are flattened to leaf fields ``(path, value)``:
nested objects join their keys with dots, list items share their list's path (``items[]``), so the order of a
list does not count, its items do. Values compare after trimming, collapsing white space and lower-casing
strings; numbers as numbers (``1`` equals ``1.0`` and ``"1"``). Per answer: precision = matched fields / the
answer's, recall = matched / the reference's, F1 their harmonic mean (0 for an answer that holds no JSON object).
Figures: ``json_f1`` (the mean over answers) and ``json_valid`` (the share of answers that hold one).
"""

from __future__ import annotations

import json
import re
from collections import Counter

from vlft import Scorer

from ._common import normalise

FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def json_object(text: str) -> dict | None:
    candidates = [text.strip(), *FENCE.findall(text)]
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{") : text.rindex("}") + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _leaf(value) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(float(value))
    text = normalise(str(value)).lower()
    try:
        return repr(float(text))  # a number written as a string is that number ("12" equals 12 and 12.0)
    except ValueError:
        return text


def leaves(value, path: str = "") -> Counter:
    out: Counter = Counter()
    if isinstance(value, dict):
        for key, item in value.items():
            out += leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for item in value:
            out += leaves(item, f"{path}[]")
    else:
        out[(path, _leaf(value))] += 1
    return out


def field_f1(prediction: str, reference: str) -> float:
    wanted = json_object(reference)
    if wanted is None:
        raise ValueError(f"the reference {reference!r} is not a JSON object")
    got = json_object(prediction)
    if got is None:
        return 0.0
    want, have = leaves(wanted), leaves(got)
    matched = sum((want & have).values())
    if not matched:
        return 0.0
    precision, recall = matched / sum(have.values()), matched / sum(want.values())
    return 2 * precision * recall / (precision + recall)


def json_score(predictions, references, **context):
    return [field_f1(p, r) for p, r in zip(predictions, references)]


def json_figures(predictions, references, values, **context):
    n = len(values)
    return {
        "json_f1": sum(values) / n if n else 0.0,
        "json_valid": sum(json_object(p) is not None for p in predictions) / n if n else 0.0,
    }


def json_fit(references, **context):
    return "every reference is a JSON object" if all(json_object(r) is not None for r in references) else ""


SCORERS = [
    Scorer(
        "json",
        "JSON-field F1: the answer's JSON leaf fields against the reference's (structured extraction)",
        json_score,
        json_figures,
        json_fit,
    ),
]
