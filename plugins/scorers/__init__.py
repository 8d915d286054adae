"""Built-in scorers (``--scorer NAME`` on ``vlft run`` and ``vlft eval``; each is also ``--reward NAME``), offered
through ``vlft_scorers`` as a third party would offer its own. docs/scorers.md says what each measures, with the
paper or the reference implementation it follows.

One module per kind of answer: ``text`` (exact match, ANLS, character error rate, BLEU, ROUGE-L, CIDEr), ``fields``
(``field: value`` answers), ``numbers`` (relaxed accuracy), ``choices`` (multiple choice), ``boxes`` (IoU) and
``structured`` (JSON-field F1). Importing them imports neither torch nor sacrebleu (BLEU loads it when it scores).
"""

from vlft import hookimpl

from . import boxes, choices, fields, numbers, structured, text


@hookimpl
def vlft_scorers():
    return [*text.SCORERS, *fields.SCORERS, *numbers.SCORERS, *choices.SCORERS, *boxes.SCORERS, *structured.SCORERS]
