"""Text answers: exact match, ANLS (DocVQA), character error rate (OCR), BLEU, ROUGE-L and CIDEr (captions).

- ``exact``: 1 where the answer equals the reference once both are trimmed and their white space collapsed.
- ``anls``: average normalised Levenshtein similarity (Biten et al., ICCV 2019, the DocVQA and InfographicVQA
  metric): per question ``1 - NL`` where ``NL``, the edit distance divided by the longer string's length (both
  lower-cased, white space collapsed), is below 0.5, else 0; the best over the question's answers.
- ``cer``: character error rate, the edits that turn the answer into the reference over the reference's
  characters (both trimmed); the set's figure is the total edits over the total characters (jiwer's corpus
  CER), lower is better; as a reward, ``1 - CER`` of each answer, at least 0.
- ``bleu``: BLEU-4 (Papineni et al., 2002) as sacrebleu computes it (its 13a tokenizer, case kept, exponential
  smoothing): the set's figure is the corpus BLEU, each answer's value (the reward) its sentence BLEU; both
  as fractions (sacrebleu's 0-100 divided by 100).
- ``rouge``: ROUGE-L F1 (Lin, 2004): the longest common subsequence of words (lower-cased, split at what is
  not a letter or a digit, as Google's rouge-score does without stemming) over the answer's and the
  reference's lengths, the F-measure with beta 1; the best over the answers; the figure is the mean.
- ``cider``: CIDEr-D (Vedantam et al., CVPR 2015) as pycocoevalcap, the MS-COCO caption evaluation, computes it:
  1- to 4-gram tf-idf vectors, the idf over the set's references (each record's answers are one image's
  references), clipped cosine similarity, a Gaussian length penalty (sigma 6), times 10. COCO's pipeline first
  runs Stanford's PTB tokenizer (Java); here the words are ROUGE's (lower-cased, split at what is not a letter
  or a digit), which agree with it on captions without contractions or hyphens. Each answer's value depends on
  the whole set's references (the idf): as a reward, on the step's; a set of one record scores 0.

Imports inside functions: sacrebleu loads when BLEU scores, pycocoevalcap when CIDEr does, so listing the plugins
stays light.
"""

from __future__ import annotations

import re

from vlft import Scorer

from ._common import answers_of, levenshtein, mean, normalise

ANLS_THRESHOLD = 0.5  # DocVQA: a normalised distance at or above it scores 0
WORD = re.compile(r"[^\W_]+")


# -- exact match -------------------------------------------------------------------------------------------------


def exact_score(predictions, references, **context):
    return [
        float(any(normalise(p) == normalise(r) for r in rs))
        for p, rs in zip(predictions, answers_of(references, context))
    ]


def exact_figures(predictions, references, values, **context):
    return {"exact_match": mean(values)}


def always(references, **context):
    return "always"


# -- ANLS ----------------------------------------------------------------------------------------------------------


def nls(prediction: str, reference: str) -> float:
    """Normalised Levenshtein similarity as ANLS counts it: 1 - NL below the threshold, else 0."""
    a, b = normalise(prediction).lower(), normalise(reference).lower()
    longest = max(len(a), len(b))
    distance = levenshtein(a, b) / longest if longest else 0.0
    return 1.0 - distance if distance < ANLS_THRESHOLD else 0.0


def anls_score(predictions, references, **context):
    return [max(nls(p, r) for r in rs) for p, rs in zip(predictions, answers_of(references, context))]


# -- character error rate -------------------------------------------------------------------------------------


def _edits(predictions, references):
    return [(levenshtein(p.strip(), r.strip()), len(r.strip())) for p, r in zip(predictions, references)]


def cer_score(predictions, references, **context):
    """Per answer ``1 - CER`` (at least 0): higher is better, as a reward must be."""
    out = []
    for edits, length in _edits(predictions, references):
        rate = edits / length if length else float(edits > 0)
        out.append(max(0.0, 1.0 - rate))
    return out


def cer_figures(predictions, references, values, **context):
    pairs = _edits(predictions, references)
    edits, length = sum(e for e, _ in pairs), sum(n for _, n in pairs)
    return {"cer": edits / length if length else float(edits > 0)}


# -- BLEU ------------------------------------------------------------------------------------------------------------


def bleu_score(predictions, references, **context):
    import sacrebleu  # the reference implementation, loaded when BLEU scores

    return [sacrebleu.sentence_bleu(p, [r]).score / 100 for p, r in zip(predictions, references)]


def bleu_figures(predictions, references, values, **context):
    import sacrebleu  # the reference implementation, loaded when BLEU scores

    return {"bleu": sacrebleu.corpus_bleu(list(predictions), [list(references)]).score / 100}


# -- ROUGE-L -------------------------------------------------------------------------------------------------------


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def lcs_length(a: list, b: list) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, 1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of one answer against one reference."""
    p, r = words(prediction), words(reference)
    lcs = lcs_length(p, r)
    if not lcs:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


def rouge_score(predictions, references, **context):
    return [max(rouge_l(p, r) for r in rs) for p, rs in zip(predictions, answers_of(references, context))]


def rouge_figures(predictions, references, values, **context):
    return {"rouge_l": mean(values)}


# -- CIDEr-D -------------------------------------------------------------------------------------------------------


def cider_score(predictions, references, **context):
    from pycocoevalcap.cider.cider_scorer import CiderScorer  # the reference implementation, loaded when CIDEr scores

    scorer = CiderScorer(n=4, sigma=6.0)
    for prediction, answers in zip(predictions, answers_of(references, context)):
        scorer += (" ".join(words(prediction)), [" ".join(words(a)) for a in answers])
    if not any(ngrams for refs in scorer.crefs for ngrams in refs):  # its idf needs at least one reference word
        return [0.0] * len(predictions)
    return [float(v) for v in scorer.compute_score()[1]]


SCORERS = [
    Scorer(
        "exact",
        "1 if the answer equals the reference (white space collapsed), else 0",
        exact_score,
        exact_figures,
        always,
    ),
    Scorer("anls", "average normalised Levenshtein similarity, 0 at a distance of 0.5 or more (DocVQA)", anls_score),
    Scorer(
        "cer",
        "character error rate: edits over the reference's characters (OCR; a reward of 1 - CER)",
        cer_score,
        cer_figures,
        lower_is_better=("cer",),
    ),
    Scorer(
        "bleu",
        "BLEU-4 as sacrebleu computes it (captions): the corpus BLEU, each answer's sentence BLEU",
        bleu_score,
        bleu_figures,
    ),
    Scorer(
        "rouge", "ROUGE-L F1: the longest common word subsequence (captions, summaries)", rouge_score, rouge_figures
    ),
    Scorer(
        "cider",
        "CIDEr-D as pycocoevalcap computes it (captions): tf-idf n-gram consensus with the references, 0 to 10",
        cider_score,
    ),
]
