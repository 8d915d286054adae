"""What the scorers share: white space collapsed, the references an answer may match, a mean."""

from __future__ import annotations


def normalise(text: str) -> str:
    """Trimmed, white space collapsed to single spaces (``vlft eval``'s exact match compares these)."""
    return " ".join(text.strip().split())


def answers_of(references: list[str], context: dict) -> list[list[str]]:
    """Each prediction's acceptable answers: ``context["answers"]`` where the caller gives several per record
    (DocVQA's ``answers``), else the one reference."""
    given = context.get("answers")
    if given is not None:
        return [list(a) if a else [r] for a, r in zip(given, references)]
    return [[r] for r in references]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def levenshtein(a, b) -> int:
    """Edits (insertions, deletions, substitutions) that turn sequence ``a`` into ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]
