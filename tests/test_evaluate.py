"""The scores in eval.json: exact match, per-field accuracy and macro F1, on answers worked out by hand."""

from __future__ import annotations

import pytest

from vlft.evaluation import scoring
from vlft.registry import load_registry
from vlft_scorers.fields import parse_fields

SCORERS = load_registry(load_entry_points=False, builtins=True).scorers


def score(predictions, references):
    """exact match and fields, as `--scorer exact,fields` chooses them."""
    return scoring.score(predictions, references, [(n, SCORERS[n]) for n in ("exact", "fields")])


REFERENCES = [
    "colour: red, defect: none",
    "colour: red, defect: scratch",
    "colour: blue, defect: crack",
    "colour: blue, defect: none",
]
PREDICTIONS = [
    "colour: red, defect: none",  # exact
    "  colour: red,  defect:\tscratch ",  # exact once white space is trimmed and collapsed
    "colour: blue, defect: none",  # colour right, defect wrong
    "it looks blue to me",  # not in field form: both fields missing
]


def test_exact_match_per_field_accuracy_and_macro_f1():
    s = score(PREDICTIONS, REFERENCES)
    assert s["samples"] == 4
    assert s["exact_match"] == pytest.approx(2 / 4)
    # colour pairs (pred, ref): (red, red) (red, red) (blue, blue) (-, blue): accuracy 3/4;
    # F1 red: tp 2 fp 0 fn 0 -> 1; blue: tp 1 fp 0 fn 1 -> 2/3; macro (1 + 2/3) / 2 = 5/6
    assert s["fields"]["colour"] == pytest.approx({"accuracy": 3 / 4, "f1": 5 / 6})
    # defect pairs: (none, none) (scratch, scratch) (none, crack) (-, none): accuracy 2/4;
    # F1 crack: tp 0 -> 0; none: tp 1 fp 1 fn 1 -> 2/4; scratch: tp 1 -> 1; macro (0 + 1/2 + 1) / 3 = 1/2
    assert s["fields"]["defect"] == pytest.approx({"accuracy": 2 / 4, "f1": 1 / 2})


def test_fields_are_matched_without_regard_to_case_or_order_but_exact_match_is_literal():
    s = score(["Defect: None, COLOUR: Red"], ["colour: red, defect: none"])
    assert s["exact_match"] == 0.0
    assert s["fields"] == {"colour": {"accuracy": 1.0, "f1": 1.0}, "defect": {"accuracy": 1.0, "f1": 1.0}}


def test_parse_fields():
    assert parse_fields("colour: red, defect: none") == {"colour": "red", "defect": "none"}
    assert parse_fields("colour: red\ndefect: a deep scratch") == {"colour": "red", "defect": "a deep scratch"}
    assert parse_fields("no fields here") == {}
    assert parse_fields("colour: red, and more") == {}  # one part out of form: not a field answer at all
