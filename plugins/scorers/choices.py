"""Multiple choice: 1 where the answer chooses the reference's option, by its letter.

The options are read from the record's prompt (the user turns), one per line: ``A. cat``, ``(B) dog``,
``C) bird`` or ``D: fish``. The reference is a letter (``B``, ``(B)``, ``B.``, ``B. dog``) or the text of one
option. The answer's letter is the one it starts with (``B``, ``(B)``, ``B. dog``), else the one it names
(``the answer is B``), else the option whose text it equals (case and white space aside). An answer that
chooses no option scores 0. As a reward (no records), options come from nowhere: the reference must be a
letter and the answer is read by letter.
"""

from __future__ import annotations

import re

from vlft import Scorer

from ._common import normalise

LEADING = re.compile(r"^\s*\(?([A-Z])(?:[).:,]|\s*$)")  # "B", "(B)", "B. dog"; not the article of "A cat"
NAMED = re.compile(r"\b(?i:answer|option|choice)\s*(?i:is|:)?\s*\(?([A-Z])\b")
OPTION = re.compile(r"^\s*\(?([A-Z])[).:]\s+(.+?)\s*$")


def options_of(record) -> dict[str, str]:
    """{letter: option text} from the record's user turns (the lines that list options)."""
    found: dict[str, str] = {}
    if record is None:
        return found
    for turn in record.turns:
        if turn.role != "user":
            continue
        for line in turn.text.splitlines():
            m = OPTION.match(line)
            if m:
                found[m.group(1)] = normalise(m.group(2)).lower()
    return found


def chosen_letter(text: str, options: dict[str, str]) -> str | None:
    m = LEADING.match(text)
    if m and (not options or m.group(1) in options):
        return m.group(1)
    if len(text.strip()) == 1 and text.strip().isalpha() and (not options or text.strip().upper() in options):
        return text.strip().upper()  # a lone lower-case letter
    m = NAMED.search(text)
    if m and (not options or m.group(1) in options):
        return m.group(1)
    said = normalise(text).lower().rstrip(".")
    return next((letter for letter, option in options.items() if option == said), None)


def _records(context, n):
    records = context.get("records")
    return list(records) if records is not None else [None] * n


def choice_score(predictions, references, **context):
    out = []
    for prediction, reference, record in zip(predictions, references, _records(context, len(references))):
        options = options_of(record)
        wanted = chosen_letter(reference, options)
        if wanted is None:
            raise ValueError(
                f"the reference {reference!r} names no option (a letter"
                + (f" of {', '.join(sorted(options))}" if options else "")
                + " or an option's text)"
            )
        out.append(float(chosen_letter(prediction, options) == wanted))
    return out


def choice_figures(predictions, references, values, **context):
    return {"choice_accuracy": sum(values) / len(values) if values else 0.0}


SCORERS = [
    Scorer(
        "choice",
        "multiple choice: 1 if the answer chooses the reference's option (by letter), else 0",
        choice_score,
        choice_figures,
    ),
]
