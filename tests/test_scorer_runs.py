"""Scorers in real runs: `vlft run --scorer` on the counting and grounding demo sets (the plan says what auto
picked; eval.json, the table and `vlft report` carry the figures, and they rise), `vlft eval --scorer` on the
run's adapter and, with the answers fixed, every built-in figure equal to its hand computation; a third party's
scorer loaded as a plugin, listed, scored with and rewarded with.

The scorers' arithmetic against the papers is in tests/test_scorers.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import cli_invoke
from vlft import Scorer, hookimpl

# steps of 4 at lr 3e-3: on counting the embedded model learns the answers' form (a count; about 5 s of training on
# 2 cores), on grounding where the square is (one of 9 places; about 15 s)
STEPS = {"counting": 40, "grounding": 100}


def short_run(data, out, *flags, steps=STEPS["counting"]):
    train, val = data
    return cli_invoke("run", "--backend", "cpu", "--data", train, "--val-data", val, "--output", out,
                      "--steps", steps, "--batch-size", 4, "--lr", "3e-3", "--eval-every", 0, "--save-every", 0,
                      "--eval-samples", 12, "--seed", 1, *flags)


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    from vlft.data.demo_tasks import write_task_dataset

    ds = write_task_dataset(tmp_path_factory.mktemp("counting") / "set", "counting", n_train=120, n_val=12, seed=2)
    return ds.train, ds.val


@pytest.fixture(scope="module")
def counting_run(counting, tmp_path_factory):
    """A counting run scored with auto's choice plus ANLS (--scorer auto,anls)."""
    out = tmp_path_factory.mktemp("counting-run") / "run"
    code, output = short_run(counting, out, "--scorer", "auto,anls", "--max-new-tokens", 4)
    assert code == 0, output
    return out, output


def test_a_run_scores_with_auto_and_named_scorers_and_the_figures_rise(counting_run):
    out, output = counting_run
    # the plan says what auto picked and why, and what was asked
    assert ("scorers      exact (auto: always), relaxed (auto: every reference is a number), anls (asked)"
            "  [--scorer auto,anls]") in output
    plan = json.loads((out / "plan.json").read_text())
    assert [c["name"] for c in plan["scorers"]["chosen"]] == ["exact", "relaxed", "anls"]
    ev = json.loads((out / "eval.json").read_text())
    for when in ("before", "after"):
        assert ev[when]["scorers"] == {"exact": ["exact_match"], "relaxed": ["relaxed_accuracy"], "anls": ["anls"]}
        assert "fields" not in ev[when]
    # the random-weight model answers no number at first; after 40 steps it answers with one
    assert ev["before"]["relaxed_accuracy"] == 0.0
    assert ev["after"]["relaxed_accuracy"] > ev["before"]["relaxed_accuracy"]
    assert ev["after"]["anls"] > ev["before"]["anls"]
    # the table: a row per figure, with the run's numbers
    row = next(line for line in output.splitlines() if line.startswith("relaxed accuracy"))
    assert row.split()[-2:] == [f"{ev['before']['relaxed_accuracy']:.1%}", f"{ev['after']['relaxed_accuracy']:.1%}"]
    assert any(line.split()[:1] == ["anls"] for line in output.splitlines())


def test_eval_scores_the_runs_adapter_with_the_scorers_asked(counting_run, counting, tmp_path):
    out, _ = counting_run
    _, val = counting
    scores = tmp_path / "scores.json"
    code, output = cli_invoke("eval", "--adapter", out, "--data", val, "--samples", 12, "--max-new-tokens", 4,
                              "--batch-size", 4, "--scorer", "relaxed,anls,cer", "--output", scores)
    assert code == 0, output
    got = json.loads(scores.read_text())
    after = json.loads((out / "eval.json").read_text())["after"]
    # the same records, decoding and batch as the run's evaluation: the same figures
    assert got["scores"]["relaxed_accuracy"] == after["relaxed_accuracy"]
    assert got["scores"]["anls"] == after["anls"]
    assert [c["name"] for c in got["scorers"]["chosen"]] == ["relaxed", "anls", "cer"]
    assert "exact_match" not in got["scores"] and got["scores"]["lower_is_better"] == ["cer"]
    assert "relaxed accuracy" in output and "cer (lower is better)" in output
    # vlft report carries the scorers' figures beside exact match
    code, output = cli_invoke("report", out, "--output", tmp_path / "report")
    assert code == 0, output
    md = (tmp_path / "report" / "report.md").read_text()
    assert "relaxed_accuracy before / after" in md and "anls before / after" in md
    assert f"{after['relaxed_accuracy']:.1%}" in md


@pytest.fixture(scope="module")
def grounding(tmp_path_factory):
    from vlft.data.demo_tasks import write_task_dataset

    ds = write_task_dataset(tmp_path_factory.mktemp("grounding") / "set", "grounding", n_train=120, n_val=12, seed=3)
    return ds.train, ds.val


@pytest.fixture(scope="module")
def grounding_run(grounding, tmp_path_factory):
    out = tmp_path_factory.mktemp("grounding-run") / "run"
    code, output = short_run(grounding, out, "--max-new-tokens", 24, "--adapter-opt", "lora_dropout=0",
                             steps=STEPS["grounding"])
    assert code == 0, output
    return out, output


def test_a_grounding_run_picks_iou_in_the_familys_convention_and_it_rises(grounding_run, tmp_path):
    from vlft.data.demo_tasks import write_task_dataset

    out, output = grounding_run
    assert "iou (auto: every reference holds a box (absolute, the family's convention))" in output
    ev = json.loads((out / "eval.json").read_text())
    assert ev["before"]["iou"] == 0.0 and ev["after"]["iou"] > 0.5 and ev["after"]["iou_accuracy"] > 0.5
    assert "iou accuracy" in output
    # the writer follows the convention asked (a refusal of a box outside the family's range: test_scorers.py)
    one = write_task_dataset(tmp_path / "fractions", "grounding", n_train=8, n_val=4, seed=3,
                             box_coordinates="relative-1")
    assert json.loads(one.val.read_text().splitlines()[0])["conversations"][1]["value"].startswith("[0.")


def test_grpo_rewards_with_scorers(grounding, grounding_run, tmp_path):
    """`--reward iou --reward anls`: two scorers as GRPO's rewards, from the grounding adapter (4 steps of 2 prompts
    x 4 completions): each logged, in [0, 1], adding up to the reward."""
    train, val = grounding
    out = tmp_path / "grpo"
    code, output = cli_invoke("run", "--objective", "grpo", "--reward", "iou", "--reward", "anls", "--init-adapter",
                              grounding_run[0], "--backend", "cpu", "--data", train, "--val-data", val, "--output",
                              out, "--steps", 4, "--batch-size", 2, "--num-generations", 4, "--max-new-tokens", 24,
                              "--temperature", "0.7", "--lr", "3e-4", "--log-every", 1, "--eval-every", 0,
                              "--eval-samples", 4, "--save-every", 0, "--seed", 1, "--adapter-opt", "lora_dropout=0",
                              "--quiet")
    assert code == 0, output
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert len(steps) == 4
    for m in steps:
        assert 0 <= m["reward_iou"] <= 1 and 0 <= m["reward_anls"] <= 1
        assert m["reward"] == pytest.approx(m["reward_iou"] + m["reward_anls"])
    assert max(m["reward_iou"] for m in steps) > 0.5  # the adapter finds the square: its samples overlap it
    assert "iou" in json.loads((out / "eval.json").read_text())["after"]  # auto scores the validation too


# -- every built-in figure through `vlft eval`, the answers fixed ------------------------------------------------

OPTIONS = "A. one disc\nB. three discs\nC. two discs"
# answers every named scorer can read: an option's letter, a box (absolute pixels) and a JSON object
REFERENCES = ['B. [10, 10, 50, 50] {"count": 3}', 'C. [0, 0, 40, 40] {"count": 2}',
              'A. [60, 60, 100, 100] {"count": 1}']
ANSWERS = [REFERENCES[0], 'A. [0, 0, 40, 20] {"count": 2}', ""]


@pytest.fixture
def sink_set(counting, tmp_path):
    train, _ = counting
    rows = [json.loads(line) for line in train.read_text().splitlines()[:3]]
    data = tmp_path / "sink.jsonl"
    question = f"<image>\nWhich option, where, and how many?\n{OPTIONS}"
    data.write_text("".join(json.dumps({
        "image": str((train.parent / row["image"]).resolve()),
        "conversations": [{"from": "user", "value": question}, {"from": "assistant", "value": reference}]}) + "\n"
        for row, reference in zip(rows, REFERENCES)))
    return data


def test_eval_writes_every_built_in_figure_equal_to_its_hand_computation(sink_set, tmp_path, monkeypatch):
    import sacrebleu

    import vlft.evaluation.generation as generation

    def fixed_answers(model, encoder, records, *args, **kwargs):
        return [ANSWERS[REFERENCES.index(r.reference)] for r in records]

    monkeypatch.setattr(generation, "generate_answers", fixed_answers)
    out = tmp_path / "scores.json"
    code, output = cli_invoke("eval", "--data", sink_set, "--scorer", "anls,relaxed,iou,choice,bleu,cer,json",
                              "--output", out)
    assert code == 0, output
    got = json.loads(out.read_text())["scores"]
    # answer 2 differs from its reference by two substitutions (C->A, 4->2), answer 3 is empty
    r2 = len(REFERENCES[1])
    expected = {
        "anls": (1 + (1 - 2 / r2) + 0) / 3,
        "relaxed_accuracy": 1 / 3,  # not numbers: equal text, once
        "iou": (1 + 0.5 + 0) / 3,  # [0,0,40,20] in [0,0,40,40]: 800 / 1600
        "iou_accuracy": 2 / 3,  # 1 and 0.5 (>= 0.5)
        "choice_accuracy": 1 / 3,  # B; A for C; nothing
        "cer": (0 + 2 + len(REFERENCES[2])) / sum(len(r) for r in REFERENCES),
        "json_f1": (1 + 1 + 0) / 3,  # {"count": 2} is right in answer 2
        "json_valid": 2 / 3,
        # BLEU: sacrebleu's own figure on the same strings (its arithmetic is checked in test_scorers.py)
        "bleu": sacrebleu.corpus_bleu(ANSWERS, [REFERENCES]).score / 100,
    }
    assert {k: got[k] for k in expected} == pytest.approx(expected)
    assert list(got["scorers"]) == ["anls", "relaxed", "iou", "choice", "bleu", "cer", "json"]
    for label in ("anls", "relaxed accuracy", "iou accuracy", "choice accuracy", "bleu", "cer (lower is better)",
                  "json f1", "json valid"):
        assert any(line.startswith(label) for line in output.splitlines()), label


def test_records_with_several_answers_score_the_best_of_them(counting, tmp_path, monkeypatch):
    """A record's ``answers`` (DocVQA's several acceptable answers): ANLS and exact match take the best."""
    import vlft.evaluation.generation as generation

    train, _ = counting
    image = str((train.parent / json.loads(train.read_text().splitlines()[0])["image"]).resolve())

    def record(reply, answers):
        return json.dumps({"image": image, "answers": answers, "conversations": [
            {"from": "user", "value": "<image>\nWhat is the total?"}, {"from": "assistant", "value": reply}]})

    data = tmp_path / "docvqa.jsonl"
    data.write_text(record("$12.00", ["12", "twelve dollars"]) + "\n" + record("kitten", ["kitten"]) + "\n")
    monkeypatch.setattr(generation, "generate_answers", lambda m, e, records, *a, **k: ["12", "sitting"][:len(records)])
    out = tmp_path / "scores.json"
    code, output = cli_invoke("eval", "--data", data, "--scorer", "exact,anls", "--output", out)
    assert code == 0, output
    got = json.loads(out.read_text())["scores"]
    # "12" is one of the first record's answers: 1 for both; "sitting" against "kitten": ANLS 4/7, not exact
    assert got["exact_match"] == 0.5 and got["anls"] == pytest.approx((1 + 4 / 7) / 2)
    data.write_text(record("12", "12") + "\n")
    code, output = cli_invoke("eval", "--data", data, "--output", out)
    assert code == 1 and "docvqa.jsonl:1: 'answers' must be a list of strings" in output


# -- a third party's scorer --------------------------------------------------------------------------------------

def shortness(predictions, references, **context):
    """1 where the answer is no longer than the reference."""
    return [float(len(p) <= len(r)) for p, r in zip(predictions, references)]


@hookimpl
def vlft_scorers():
    return [Scorer("shortness", "1 if the answer is no longer than the reference", shortness)]


def test_a_plugins_scorer_is_listed_scored_with_and_a_reward(sink_set, tmp_path, monkeypatch):
    """This module as a plugin (VLFT_PLUGINS): `vlft plugins` lists its scorer, `vlft eval --scorer` uses it, and
    GRPO's rewards include it."""
    import vlft.evaluation.generation as generation
    import vlft.registry

    monkeypatch.setenv("VLFT_PLUGINS", __name__)
    monkeypatch.setattr(vlft.registry, "_default", None)  # the process's registry, loaded again with it
    monkeypatch.setattr(generation, "generate_answers", lambda m, e, records, *a, **k: ["x"] * len(records))
    code, output = cli_invoke("plugins")
    assert code == 0 and f"shortness 1 if the answer is no longer than the reference (plugin {__name__})" in \
        " ".join(output.split())
    out = tmp_path / "scores.json"
    code, output = cli_invoke("eval", "--data", sink_set, "--scorer", "shortness", "--output", out)
    assert code == 0, output
    assert json.loads(out.read_text())["scores"]["shortness"] == 1.0
    from vlft.config import RunConfig

    registry = vlft.registry.get_registry()
    objective = registry.objective_for(RunConfig(objective="grpo", reward=["shortness"]))
    assert objective.options["rewards"] == ["shortness"]
    assert registry.rewards["shortness"].build(None) is shortness
    monkeypatch.setattr(vlft.registry, "_default", None)


def test_the_demo_sets_answers_take_their_scorers_form(tmp_path):
    code, output = cli_invoke("demo-data", tmp_path / "g", "--task", "grounding", "--train", 3, "--val", 3,
                              "--box-coordinates", "relative-1000")
    assert code == 0, output
    answers = [json.loads(line)["conversations"][1]["value"] for line in (tmp_path / "g" / "val.jsonl").read_text()
               .splitlines()]
    from vlft_scorers.boxes import boxes_in

    assert all(len(boxes_in(a)) == 1 and all(0 <= v <= 1000 for v in boxes_in(a)[0]) for a in answers)
    assert Path(tmp_path / "g" / "imgs").is_dir()
