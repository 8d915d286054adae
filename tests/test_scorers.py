"""Scorers (``--scorer``; each a ``--reward`` too): every built-in one against hand-computed figures that a wrong
implementation misses (ANLS's 0.5 threshold, relaxed accuracy's 5%, IoU at 0.5, BLEU's clipping, brevity penalty
and corpus pooling, ROUGE-L's subsequence, CIDEr-D's idf, clipping and length penalty), ``auto``'s choice, the
plugin kind, and the user's MODULE:FUNCTION.

The real runs (``vlft run --scorer``, ``vlft eval --scorer``) are in tests/test_scorer_runs.py.
"""

from __future__ import annotations

import math

import pytest

from vlft import ConfigError, Reward, Scorer, VlftError, hookimpl
from vlft.data.records import Record, Turn
from vlft.evaluation.scoring import format_table, score
from vlft.planning.scorers import choose_scorers
from vlft.registry import load_registry

REGISTRY = load_registry(load_entry_points=False, builtins=True)
SCORERS = REGISTRY.scorers


def values(name, predictions, references, **context):
    return SCORERS[name].score(predictions, references, **context)


def figures(names, predictions, references, **context):
    return score(predictions, references, [(n, SCORERS[n]) for n in names], **context)


# -- ANLS (DocVQA) ---------------------------------------------------------------------------------------------


def test_anls_is_one_minus_the_normalised_distance_below_one_half_and_zero_from_it():
    # "sitting" -> "kitten": 3 edits over the longer length 7: NL 3/7 < 0.5, so 1 - 3/7 = 4/7
    # "abxy" -> "abcd": 2 edits over 4: NL exactly 0.5, not below it: 0 (a `<=` threshold would give 0.5)
    # case and white space do not count (DocVQA lower-cases and collapses them)
    got = values("anls", ["sitting", "abxy", "  Hello   World "], ["kitten", "abcd", "hello world"])
    assert got == pytest.approx([4 / 7, 0.0, 1.0])
    assert figures(["anls"], ["sitting", "abxy", "  Hello   World "], ["kitten", "abcd", "hello world"])[
        "anls"
    ] == pytest.approx((4 / 7 + 0 + 1) / 3)
    # the best over a question's answers
    assert values("anls", ["sitting"], ["kitten"], answers=[["kitten", "sitting"]]) == [1.0]
    # one edit more than half: 0, not a small positive number
    assert values("anls", ["abxyz"], ["abcde"]) == [0.0]


# -- relaxed accuracy (ChartQA) -------------------------------------------------------------------------------


def test_relaxed_accuracy_takes_numbers_within_five_percent_and_other_answers_exact():
    references = ["100", "100", "100", "100", "50%", "0", "0", "Yes", "12"]
    predictions = ["105", "105.1", "95", "94.9", "0.52", "0.01", "0", "yes", "twelve"]
    # |105-100|/100 = 0.05 <= 0.05; 0.051 is not; 50% is 0.5 (0.52: 4%); a reference of 0 is compared as text
    assert values("relaxed", predictions, references) == [1, 0, 1, 0, 1, 0, 1, 1, 0]
    assert figures(["relaxed"], predictions, references)["relaxed_accuracy"] == pytest.approx(5 / 9)


# -- multiple choice -------------------------------------------------------------------------------------------


def _question(reference="B"):
    prompt = "<image>Which animal is it?\nA. cat\nB. dog\nC. bird"
    return Record([Turn("user", prompt), Turn("assistant", reference)], [], "choices.jsonl:1")


def test_choice_reads_the_letter_the_option_text_or_the_named_option():
    # "Bird" is the option C's text, not the letter B its first capital is; "A cat" starts with an article
    predictions = ["B", "(B)", "B. dog", "dog", "The answer is B", "A", "A cat", "C", "", "Bird"]
    records = [_question()] * len(predictions)
    got = values("choice", predictions, ["B"] * len(predictions), records=records)
    assert got == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    # a reference written as the option's text is that option's letter
    assert values("choice", ["B", "A"], ["dog", "dog"], records=[_question("dog")] * 2) == [1.0, 0.0]
    assert figures(["choice"], predictions, ["B"] * 10, records=records)["choice_accuracy"] == pytest.approx(5 / 10)
    # as a reward there are no records: the letters alone
    assert values("choice", ["B.", "C"], ["B", "B"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="names no option"):
        values("choice", ["B"], ["a horse"], records=[_question("a horse")])


# -- box IoU (grounding) ---------------------------------------------------------------------------------------


def test_iou_of_boxes_is_correct_from_one_half_in_the_familys_convention():
    ref = '{"bbox_2d": [0, 0, 10, 10], "label": "cat"}'
    # [5,5,15,15]: intersection 25, union 175 -> 1/7; [0,0,10,5]: 50 / 100 = 0.5, correct (>= 0.5);
    # [0,0,10,4.9]: 0.49, not correct; Qwen2-VL's corners "(0,0),(10,10)": 1; no box: 0
    predictions = ["[5, 5, 15, 15]", '{"bbox_2d": [0, 0, 10, 5]}', "[0, 0, 10, 4.9]", "(0,0),(10,10)", "a cat"]
    got = values("iou", predictions, [ref] * 5, box_coordinates="absolute")
    assert got == pytest.approx([1 / 7, 0.5, 0.49, 1.0, 0.0])
    result = figures(["iou"], predictions, [ref] * 5, box_coordinates="absolute")
    assert result["iou"] == pytest.approx((1 / 7 + 0.5 + 0.49 + 1) / 5)
    assert result["iou_accuracy"] == pytest.approx(2 / 5)  # 0.5 and 1.0 (a `> 0.5` rule would count one)
    # the answer is clamped to its convention's range: relative-1000 stops at 1000
    assert values("iou", ["[-100, 0, 1100, 1000]"], ["[0, 0, 1000, 1000]"], box_coordinates="relative-1000") == [1.0]
    # a reference outside the family's convention is an error: vlft never converts boxes
    with pytest.raises(ValueError, match="outside the relative-1 range"):
        values("iou", ["[0.1, 0.1, 0.5, 0.5]"], ["[100, 100, 500, 500]"], box_coordinates="relative-1")
    # two reference boxes: each paired with the answer's box in the same place, the second missing
    assert values("iou", ["[0, 0, 10, 10]"], ["[0, 0, 10, 10] [20, 20, 30, 30]"]) == [0.5]


# -- BLEU (sacrebleu) -------------------------------------------------------------------------------------------

FOX = ("the quick brown fox jumps over the dog", "the quick brown fox jumps over the lazy dog")
CAT = ("the cat sat on the mat", "the cat is on the mat")


def test_bleu_clips_counts_applies_the_brevity_penalty_and_pools_the_corpus():
    # fox: 8 words against 9: precisions 8/8, 6/7, 5/6, 4/5 and the brevity penalty exp(1 - 9/8)
    fox = math.exp(1 - 9 / 8) * (1 * 6 / 7 * 5 / 6 * 4 / 5) ** 0.25
    assert figures(["bleu"], [FOX[0]], [FOX[1]])["bleu"] == pytest.approx(fox, abs=1e-12)  # 0.76728
    # Papineni's "the the the ...": 'the' counts at most twice (2/7); no bigram matches, and sacrebleu's
    # exponential smoothing takes the zero precisions of orders 2, 3, 4 as 1/(2*6), 1/(4*5), 1/(8*4)
    clipped = (2 / 7 * 1 / 12 * 1 / 20 * 1 / 32) ** 0.25
    assert figures(["bleu"], ["the the the the the the the"], [CAT[1]])["bleu"] == pytest.approx(clipped)  # 0.0781
    # the corpus pools the counts: (8+5)/(8+6), (6+3)/(7+5), (5+1)/(6+4), (4+0)/(5+3), lengths 14 against 15 (not
    # the mean of the sentences' BLEU)
    corpus = math.exp(1 - 15 / 14) * (13 / 14 * 9 / 12 * 6 / 10 * 4 / 8) ** 0.25
    result = figures(["bleu"], [FOX[0], CAT[0]], [FOX[1], CAT[1]])
    assert result["bleu"] == pytest.approx(corpus)  # 0.62947
    # each answer's value (the reward) is its sentence BLEU
    assert values("bleu", [FOX[0]], [FOX[1]]) == pytest.approx([fox])


# -- ROUGE-L ---------------------------------------------------------------------------------------------------


def test_rouge_l_is_the_f_measure_of_the_longest_common_subsequence():
    # Lin (2004)'s example: against "police killed the gunman", "police kill the gunman" shares the subsequence
    # "police the gunman" (3 of 4 words each way: 0.75), "the gunman kill police" only "the gunman" (0.5)
    ref = "police killed the gunman"
    got = values("rouge", ["police kill the gunman", "the gunman kill police"], [ref] * 2)
    assert got == pytest.approx([0.75, 0.5])
    # unequal lengths: LCS "the cat on mat" = 4: precision 4/4, recall 4/6, F1 0.8 (a contiguous match would be 2)
    assert values("rouge", ["The cat, on mat."], ["the cat sat on the mat"]) == pytest.approx([0.8])
    assert figures(["rouge"], ["police kill the gunman", "x"], [ref, "y"])["rouge_l"] == pytest.approx(0.375)


# -- CIDEr-D (pycocoevalcap) ----------------------------------------------------------------------------------


def test_cider_weighs_ngrams_by_their_rarity_over_the_references_and_penalises_length():
    """CIDEr-D by hand (Vedantam et al., 2015, as pycocoevalcap computes it). Two images: an n-gram's idf is
    log(2 / the images whose references hold it), so 'a', in both, weighs 0. "A cat." against "a cat sat" (case
    and punctuation dropped): the unigram cosine (cat) and the bigram one (a cat) are L^2 / (L * L sqrt 2) =
    1 / sqrt 2 (L = log 2), there are no 3- or 4-grams: the mean over n = 1..4 is (2 / sqrt 2) / 4; its length
    (pycocoevalcap counts bigrams) is 1 against 2: the penalty exp(-1 / (2 * 6^2)); times 10. "a dog" against
    "A dog!": cosines 1, 1, 0, 0: 10 * 2 / 4 = 5."""
    first = 10 * (2 / math.sqrt(2)) / 4 * math.exp(-1 / 72)  # 3.4868 (no clipping or penalty: 3.5355)
    predictions, references = ["A cat.", "a dog"], ["a cat sat", "A dog!"]
    assert values("cider", predictions, references) == pytest.approx([first, 5.0])
    assert figures(["cider"], predictions, references)["cider"] == pytest.approx((first + 5) / 2)
    # clipped: "cat cat" against "a cat" counts 'cat' once, its unigram term min(2L, L) L / (2L L) = 1/2 (unclipped,
    # 1); its bigram 'cat cat' is in no reference: 10 * (1/2) / 4
    assert values("cider", ["cat cat", ""], ["a cat", "a dog"]) == pytest.approx([1.25, 0.0])
    # a record's answers are its image's references (COCO's five captions): the similarities' mean over them, so
    # a perfect match of one of two references scores half (the best of them would give 5)
    assert values(
        "cider", ["a cat", "x"], ["a cat", "a bird"], answers=[["a cat", "the dog"], ["a bird"]]
    ) == pytest.approx([2.5, 0.0])
    # one record: every n-gram is in every image's references, idf 0
    assert values("cider", ["a cat"], ["a cat"]) == [0.0]


# -- character error rate --------------------------------------------------------------------------------------


def test_cer_is_the_edits_over_the_reference_characters_pooled_over_the_set():
    # kitten -> sitting: 3 edits over 7; abd -> abc: 1 over 3; the set: 4 edits over 10 characters, 0.4 (the mean
    # of the rates would be 0.381)
    result = figures(["cer"], ["kitten", "abd"], ["sitting", "abc"])
    assert result["cer"] == pytest.approx(0.4) and result["lower_is_better"] == ["cer"]
    # the reward is 1 - CER, at least 0 (a long wrong answer: 4 edits over 2 characters)
    assert values("cer", ["kitten", "abd", "abcdef"], ["sitting", "abc", "ab"]) == pytest.approx([4 / 7, 2 / 3, 0.0])
    assert "cer (lower is better)" in format_table(None, result)


# -- JSON-field F1 -----------------------------------------------------------------------------------------------


def test_json_field_f1_matches_leaf_fields():
    ref = '{"name": "ACME", "total": 12.5, "items": ["a", "b"]}'
    # leaves (name, acme) (total, 12.5) (items[], a) (items[], b); the answer's (name, acme) (total, 12.5)
    # (items[], b) (date, x): 3 matched, precision 3/4, recall 3/4, F1 0.75; a fenced block is read
    answer = 'Here:\n```json\n{"name": "Acme ", "total": "12.5", "items": ["b"], "date": "x"}\n```'
    assert values("json", [answer, "no json here", ref], [ref] * 3) == pytest.approx([0.75, 0.0, 1.0])
    result = figures(["json"], [answer, "no json here", ref], [ref] * 3)
    assert result["json_f1"] == pytest.approx(1.75 / 3) and result["json_valid"] == pytest.approx(2 / 3)
    # precision and recall differ: one of two answered fields right against three wanted: P 1/2, R 1/3, F1 0.4
    assert values("json", ['{"a": 1, "b": 5}'], ['{"a": 1, "b": 2, "c": 3}']) == pytest.approx([0.4])


# -- exact and fields: as before (tests/test_evaluate.py), and as rewards --------------------------------------


def test_every_scorer_is_a_reward_and_the_built_in_list():
    assert sorted(SCORERS) == [
        "anls",
        "bleu",
        "cer",
        "choice",
        "cider",
        "exact",
        "fields",
        "iou",
        "json",
        "relaxed",
        "rouge",
    ]
    rewards = REGISTRY.rewards
    assert set(SCORERS) <= set(rewards) and {"format", "numeric"} <= set(rewards)
    anls = rewards["anls"].build(None)
    assert anls(["sitting"], ["kitten"], where=["a:1"]) == pytest.approx([4 / 7])
    with pytest.raises(ConfigError, match="takes no argument"):
        rewards["iou"].build("0.7")


# -- the plugin kind, auto, and the user's function ------------------------------------------------------------


def brevity(predictions, references, **context):
    """A user's scorer (--scorer test_scorers:brevity, --reward test_scorers:brevity)."""
    return [1.0 if len(p) <= len(r) else 0.0 for p, r in zip(predictions, references)]


class BrevityPlugin:
    @hookimpl
    def vlft_scorers(self):
        return [Scorer("brevity", "1 if the answer is no longer than the reference", brevity)]


class ClashingReward:
    @hookimpl
    def vlft_rewards(self):
        return [Reward("anls", "a reward named as a scorer", lambda argument: brevity)]


def test_a_plugins_scorer_is_offered_for_scoring_and_as_a_reward():
    registry = load_registry(load_entry_points=False, builtins=True, plugins=(BrevityPlugin(),))
    assert registry.pm.hook.vlft_scorers()  # the hook answers, the built-ins' and the plugin's lists
    assert registry.owners[("scorer", "brevity")] == "BrevityPlugin"
    assert registry.rewards["brevity"].build(None) is brevity
    chosen = choose_scorers(registry.scorers, "brevity,exact", ["abc", "abc"])
    assert score(["ab", "abcd"], ["abc", "abc"], chosen.chosen) == {
        "samples": 2,
        "brevity": 0.5,
        "exact_match": 0.0,
        "scorers": {"brevity": ["brevity"], "exact": ["exact_match"]},
    }
    with pytest.raises(VlftError, match="two plugins offer the reward 'anls'"):
        load_registry(load_entry_points=False, builtins=True, plugins=(ClashingReward(),))


def test_auto_picks_by_the_references_form_and_says_why():
    def auto(references, **context):
        return {label: why for label, why in choose_scorers(SCORERS, "auto", references, **context).why.items()}

    assert auto(["colour: red, defect: none"]) == {
        "exact": "auto: always",
        "fields": "auto: every reference is 'field: value' pairs",
    }
    assert auto(["3", "12.5", "40%"]) == {"exact": "auto: always", "relaxed": "auto: every reference is a number"}
    boxes = ['{"bbox_2d": [10, 20, 300, 400]}', "[0, 0, 5, 5]"]
    assert set(auto(boxes, box_coordinates="absolute")) == {"exact", "iou"}
    assert "relative-1000, the family's convention" in auto(boxes, box_coordinates="relative-1000")["iou"]
    assert set(auto(boxes, box_coordinates="relative-1")) == {"exact"}  # 300 is no fraction: not this family's
    assert set(auto(['{"a": 1}'])) == {"exact", "json"}
    assert set(auto(["3", "colour: red"])) == {"exact"}  # mixed forms: exact match alone
    # named, plus auto's
    assert list(choose_scorers(SCORERS, "anls,auto", ["3"]).why) == ["anls", "exact", "relaxed"]


def test_named_scorers_are_checked_on_the_references_before_anything_loads():
    where = [f"val.jsonl:{i}" for i in range(1, 4)]
    with pytest.raises(ConfigError, match="val.jsonl:2: scorer 'iou' cannot score this reference .*holds no box"):
        choose_scorers(SCORERS, "iou", ["[0, 0, 1, 1]", "a cat", "[1, 1, 2, 2]"], where=where)
    with pytest.raises(ConfigError, match="no plugin offers a scorer 'nosuch'; offered: anls, bleu"):
        choose_scorers(SCORERS, "nosuch", ["x"])
    with pytest.raises(ConfigError, match="named twice"):
        choose_scorers(SCORERS, "exact,exact", ["x"])
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        choose_scorers(SCORERS, "no_such_module:f", ["x"])


def test_a_users_function_scores_and_rewards():
    chosen = choose_scorers(SCORERS, f"{__name__}:brevity", ["abc"])
    assert [label for label, _ in chosen.chosen] == ["brevity"]
    assert score(["ab", "abcd"], ["abc", "abc"], chosen.chosen)["brevity"] == 0.5
    import vlft_objectives.grpo as grpo  # GRPO reads the same MODULE:FUNCTION as a reward

    [(label, function)] = grpo.resolve_rewards([f"{__name__}:brevity"], REGISTRY.rewards)
    assert (label, function) == ("brevity", brevity)


def test_the_table_has_a_row_per_figure_in_the_scorers_order():
    before = figures(["exact", "anls", "iou"], ["x", "[0, 0, 1, 1]"], ["[0, 0, 2, 2]", "[0, 0, 1, 1]"])
    after = figures(["exact", "anls", "iou"], ["[0, 0, 2, 2]", "[0, 0, 1, 1]"], ["[0, 0, 2, 2]", "[0, 0, 1, 1]"])
    table = format_table(before, after).splitlines()
    assert [line.split()[0] for line in table[2:-1]] == ["exact", "anls", "iou", "iou"]
    assert table[5].split() == ["iou", "accuracy", "50.0%", "100.0%"]
