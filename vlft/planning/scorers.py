"""Which scorers score a run's or an evaluation's answers (``--scorer NAME[,NAME]``), chosen once before any
weight is loaded.

A name is a plugin's scorer (``vlft_scorers``: ``vlft scorers`` lists them), ``auto`` or the user's
``MODULE:FUNCTION`` (a function ``f(predictions, references, **context) -> list[float]``, whose mean is its
figure, or a ``Scorer``). ``auto`` takes every scorer whose ``fits`` finds the references in its form (exact
match always, fields where every reference is ``field: value`` pairs, relaxed accuracy where every one is a
number, IoU where every one holds a box in the family's convention, JSON-field F1 where every one is a JSON
object) and says why in the plan. Every chosen scorer then runs on each reference as its own answer: a
reference one cannot read stops the run here, naming its records (``file:line``), before anything is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vlft.contracts.scorer import Scorer
from vlft.errors import ConfigError
from vlft.userspec import user_attribute

AUTO = "auto"
MAX_NAMED = 5  # records named in an error about references a scorer cannot read


@dataclass
class ScorerChoice:
    """The scorers chosen, in the table's order, and why each was."""

    asked: str
    chosen: list[tuple[str, Scorer]] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return {"asked": self.asked, "chosen": [{"name": label, "why": self.why[label]} for label, _ in self.chosen]}


def describe_line(desc: dict) -> str:
    """``exact (always), fields (every reference is 'field: value' pairs)`` for the plan."""
    return ", ".join(f"{c['name']} ({c['why']})" for c in desc["chosen"]) + f"  [--scorer {desc['asked']}]"


def choose_scorers(offered: dict[str, Scorer], spec: str | None, references: list[str], **context) -> ScorerChoice:
    """The scorers ``spec`` names (comma-separated), checked on ``references``; ``context`` as a scorer gets it
    (``where``, ``records``, ``box_coordinates``)."""
    spec = (spec or AUTO).strip() or AUTO
    choice = ScorerChoice(spec)
    for name in [n.strip() for n in spec.split(",") if n.strip()]:
        if name == AUTO:
            candidates = sorted(offered.items(), key=lambda kv: kv[0] != "exact") if references else []
            for label, scorer in candidates:  # exact match first; no references: nothing to fit
                why = scorer.fits(references, **context) if scorer.fits is not None else ""
                if why and label not in choice.why:
                    choice.chosen.append((label, scorer))
                    choice.why[label] = f"auto: {why}"
            continue
        if ":" in name:
            scorer = user_scorer(name)
        elif name in offered:
            scorer = offered[name]
        else:
            raise ConfigError(
                f"--scorer {name}: no plugin offers a scorer '{name}'; offered: "
                f"{', '.join(sorted(offered)) or 'none'} (`vlft scorers`), auto, or your "
                f"MODULE:FUNCTION"
            )
        if scorer.name in choice.why:
            raise ConfigError(f"--scorer {spec}: the scorer '{scorer.name}' is named twice")
        choice.chosen.append((scorer.name, scorer))
        choice.why[scorer.name] = "asked"
    problems = check_references(choice.chosen, references, context)
    if problems:
        raise ConfigError(
            "--scorer: the references cannot be scored as asked (nothing was loaded or written):\n  "
            + "\n  ".join(problems)
        )
    return choice


def user_scorer(spec: str) -> Scorer:
    """``MODULE:NAME``: a ``Scorer``, or a function scored by its mean (a module beside the user is found as
    ``python -m`` would find it)."""
    module_name, attr, found = user_attribute(spec, "--scorer")
    if isinstance(found, Scorer):
        return found
    if not callable(found):
        raise ConfigError(f"--scorer {spec}: {module_name} has no function '{attr}'")
    return Scorer(attr, f"{spec} (your function: its mean)", found)  # pyright: ignore[reportArgumentType]  # checked callable


def finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_references(chosen: list[tuple[str, Scorer]], references: list[str], context: dict) -> list[str]:
    """Each scorer on every reference as its own answer: ['file:line: problem'] for the records one cannot score
    (it raises, or answers other than one finite number each)."""
    where = list(context.get("where") or [f"record {i + 1}" for i in range(len(references))])
    records = context.get("records")
    problems: list[str] = []
    for label, scorer in chosen:
        try:  # all at once; one by one only to find the records it fails on
            values = list(scorer.score(references, references, **context))
            if len(values) == len(references) and all(finite(v) for v in values):
                continue
        except Exception:  # noqa: BLE001 - the scorer's code: found below, record by record
            pass
        named = 0
        for i, reference in enumerate(references):
            one = {**context, "where": [where[i]], **({"records": [records[i]]} if records is not None else {})}
            if "answers" in context:
                one["answers"] = [context["answers"][i]]
            try:
                values = list(scorer.score([reference], [reference], **one))
                problem = "" if len(values) == 1 and finite(values[0]) else f"answered {values!r}, not one number"
            except Exception as e:  # noqa: BLE001 - whatever it raised, reported at this record
                problem = f"{e.__class__.__name__}: {e}"
            if problem:
                named += 1
                if named <= MAX_NAMED:
                    problems.append(f"{where[i]}: scorer '{label}' cannot score this reference ({problem})")
        if named > MAX_NAMED:
            problems.append(f"... and {named - MAX_NAMED} more record(s) scorer '{label}' cannot score")
    return problems


def scoring_context(records, family) -> dict:
    """What a scorer is told besides the answers: each record's place, the records (prompts, images), the
    family's box convention and, where records list them (``"answers": [...]``), every acceptable answer (the
    reference first)."""
    context = {
        "where": [r.where for r in records],
        "records": list(records),
        "box_coordinates": family.chat.box_coordinates if family is not None else None,
    }
    if any(getattr(r, "answers", None) for r in records):
        context["answers"] = [
            [r.reference, *[a for a in (getattr(r, "answers", None) or []) if a != r.reference]] for r in records
        ]
    return context


def scorers_for_run(registry, config, val_records, family) -> ScorerChoice:
    """``--scorer`` of a run, on the validation records the before/after test scores (``--eval-samples``)."""
    records = list(val_records[: config.eval_samples] if config.eval_samples else val_records)
    return choose_scorers(
        registry.scorers, config.scorer, [r.reference for r in records], **scoring_context(records, family)
    )
