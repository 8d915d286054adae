"""Scorers in real runs, on the demo sets `vlft demo-data --task counting|grounding` writes:

- counting, under 2 processes with sharded parameters and packed rows (``--nproc-per-node 2 --shard fsdp
  --packing on``): the plan says what ``--scorer auto,anls`` picked; eval.json, the table and `vlft report` carry
  the figures, relaxed accuracy rises past what one answer for every image scores, and `vlft eval` in one
  process scores the adapter as the run's gathered evaluation did;
- grounding (``--box-coordinates absolute``), interrupted after a checkpoint and resumed: IoU picked in the
  family's convention, and it rises; then GRPO with ``--reward iou`` from that adapter raises the validation IoU;
- `vlft eval` with every built-in scorer on fixed answers, each figure equal to its hand computation; a third
  party's scorer loaded as a plugin, listed, scored with and rewarded with.

The scorers' arithmetic against the papers is in tests/test_scorers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import cli_invoke, die_at_step, vlft_command
from vlft import Scorer, hookimpl

# batches of 4 at lr 3e-3: in 40 steps the embedded model learns to count the discs; in 60, where the square is
# (one of 9 places) for most images, leaving GRPO room to raise the IoU
STEPS = {"counting": 40, "grounding": 60}
INTERRUPTED_AT = 31  # the grounding run stops in this step, after the step-30 checkpoint, and is resumed


def demo_set(tmp_path_factory, task, seed, *flags):
    """`vlft demo-data --task TASK`: 120 training and 12 validation records."""
    out = tmp_path_factory.mktemp(task) / "set"
    code, output = cli_invoke("demo-data", out, "--task", task, "--train", 120, "--val", 12, "--seed", seed, *flags)
    assert code == 0, output
    return out / "train.jsonl", out / "val.jsonl"


def run_args(data, out, task, batch_size=4):
    train, val = data
    return [
        "run",
        "--backend",
        "cpu",
        "--data",
        train,
        "--val-data",
        val,
        "--output",
        out,
        "--steps",
        STEPS[task],
        "--batch-size",
        batch_size,
        "--lr",
        "3e-3",
        "--eval-every",
        0,
        "--eval-samples",
        12,
        "--seed",
        1,
    ]


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    return demo_set(tmp_path_factory, "counting", 2)


@pytest.fixture(scope="module")
def counting_run(counting, tmp_path_factory):
    """The counting run in 2 processes of batch 2 (sharded, packed), scored with auto's choice plus ANLS."""
    out = tmp_path_factory.mktemp("counting-run") / "run"
    args = [
        *run_args(counting, out, "counting", batch_size=2),
        "--save-every",
        0,
        "--scorer",
        "auto,anls",
        "--max-new-tokens",
        4,
        "--nproc-per-node",
        2,
        "--shard",
        "fsdp",
        "--packing",
        "on",
    ]
    proc = subprocess.run(
        [*vlft_command(), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout + proc.stderr


def test_a_run_scores_with_auto_and_named_scorers_and_the_figures_rise(counting_run):
    out, output = counting_run
    plan = json.loads((out / "plan.json").read_text())
    assert plan["sharding"]["strategy"] == "fsdp" and plan["packing"]["enabled"]
    # the plan says what auto picked and why, and what was asked
    assert (
        "scorers      exact (auto: always), relaxed (auto: every reference is a number), anls (asked)"
        "  [--scorer auto,anls]"
    ) in output
    assert [c["name"] for c in plan["scorers"]["chosen"]] == ["exact", "relaxed", "anls"]
    ev = json.loads((out / "eval.json").read_text())
    for when in ("before", "after"):
        assert ev[when]["scorers"] == {"exact": ["exact_match"], "relaxed": ["relaxed_accuracy"], "anls": ["anls"]}
        assert "fields" not in ev[when]
    # the random-weight model answers no number at first; after 40 steps it reads the discs: a third of the
    # answers is what one count for every image scores (4 images of each count)
    assert ev["before"]["relaxed_accuracy"] == 0.0
    assert ev["after"]["relaxed_accuracy"] > 2 / 3
    assert ev["after"]["anls"] > ev["before"]["anls"]
    # the table: a row per figure, with the run's numbers
    row = next(line for line in output.splitlines() if line.startswith("relaxed accuracy"))
    assert row.split()[-2:] == [f"{ev['before']['relaxed_accuracy']:.1%}", f"{ev['after']['relaxed_accuracy']:.1%}"]
    assert any(line.split()[:1] == ["anls"] for line in output.splitlines())


def test_eval_scores_the_runs_adapter_with_the_scorers_asked(counting_run, counting, tmp_path):
    out, _ = counting_run
    _, val = counting
    scores = tmp_path / "scores.json"
    code, output = cli_invoke(
        "eval",
        "--adapter",
        out,
        "--data",
        val,
        "--samples",
        12,
        "--max-new-tokens",
        4,
        "--batch-size",
        4,
        "--scorer",
        "relaxed,anls,cer",
        "--output",
        scores,
    )
    assert code == 0, output
    got = json.loads(scores.read_text())
    after = json.loads((out / "eval.json").read_text())["after"]
    # one process, the same records and greedy decoding as the run's evaluation, which the 2 processes split
    # and gathered: the same figures
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
    return demo_set(tmp_path_factory, "grounding", 3, "--box-coordinates", "absolute")


@pytest.fixture(scope="module")
def grounding_run(grounding, tmp_path_factory):
    """The grounding run, stopped in step 31 (as Ctrl-C would) and resumed from its step-30 checkpoint: the
    resumed run takes the scorers' before figures from the eval.json the first attempt wrote."""
    out = tmp_path_factory.mktemp("grounding-run") / "run"
    args = [
        *run_args(grounding, out, "grounding"),
        "--save-every",
        30,
        "--max-new-tokens",
        24,
        "--adapter-opt",
        "lora_dropout=0",
    ]
    with pytest.MonkeyPatch.context() as mp:
        die_at_step(mp, INTERRUPTED_AT)
        code, output = cli_invoke(*args)
    assert code != 0 and not (out / "adapter").exists(), output
    assert (out / "checkpoints" / f"step-{INTERRUPTED_AT - 1:06d}").is_dir()
    first = json.loads((out / "eval.json").read_text())
    code, output = cli_invoke(*args, "--resume")
    assert code == 0, output
    return out, output, first


def test_a_grounding_run_picks_iou_in_the_familys_convention_and_it_rises(grounding_run, tmp_path):
    from vlft.data.demo_tasks import write_task_dataset

    out, output, first = grounding_run
    assert "iou (auto: every reference holds a box (absolute, the family's convention))" in output
    ev = json.loads((out / "eval.json").read_text())
    assert ev["before"] == first["before"] and first["after"] is None  # kept across the resume
    assert ev["before"]["iou"] == 0.0 and ev["after"]["iou"] > 0.5 and ev["after"]["iou_accuracy"] > 0.5
    # the resumed run's table: the before column from the first attempt, a row per figure of every scorer
    for label, key in (("iou", "iou"), ("iou accuracy", "iou_accuracy"), ("exact match", "exact_match")):
        row = next(line for line in output.splitlines() if line.startswith(label + " "))
        assert row.split()[-2:] == [f"{ev['before'][key]:.1%}", f"{ev['after'][key]:.1%}"], row
    # the writer follows the convention asked (a refusal of a box outside the family's range: test_scorers.py)
    one = write_task_dataset(
        tmp_path / "fractions", "grounding", n_train=8, n_val=4, seed=3, box_coordinates="relative-1"
    )
    assert json.loads(one.val.read_text().splitlines()[0])["conversations"][1]["value"].startswith("[0.")


def test_grpo_with_the_iou_scorer_as_reward_raises_the_validation_iou(grounding, grounding_run, tmp_path):
    """`--reward iou` from the grounding adapter: 12 steps of 4 prompts x 8 completions (temperature 0.7, lr
    3e-4, the KL to the adapter it starts from at beta 0.04) raise the greedy answers' IoU on the validation
    records (measured: 66.7% to 82.5%; seed 2, to 79.8%); the reward, in [0, 1], is logged each step. With 2
    prompts x 4 completions a step the figure moved both ways with the seed and the step count (docs/scorers.md)."""
    train, val = grounding
    out = tmp_path / "grpo"
    code, output = cli_invoke(
        "run",
        "--objective",
        "grpo",
        "--reward",
        "iou",
        "--init-adapter",
        grounding_run[0],
        "--backend",
        "cpu",
        "--data",
        train,
        "--val-data",
        val,
        "--output",
        out,
        "--steps",
        12,
        "--batch-size",
        4,
        "--num-generations",
        8,
        "--max-new-tokens",
        24,
        "--temperature",
        "0.7",
        "--lr",
        "3e-4",
        "--log-every",
        1,
        "--eval-every",
        0,
        "--eval-samples",
        12,
        "--save-every",
        0,
        "--seed",
        1,
        "--adapter-opt",
        "lora_dropout=0",
    )
    assert code == 0, output
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert len(steps) == 12 and all(0 <= m["reward"] <= 1 for m in steps)
    ev = json.loads((out / "eval.json").read_text())
    # before: the adapter it starts from, the grounding run's after
    assert ev["before"]["iou"] == json.loads((grounding_run[0] / "eval.json").read_text())["after"]["iou"]
    assert ev["after"]["iou"] > ev["before"]["iou"] + 0.05
    assert ev["after"]["iou_accuracy"] > ev["before"]["iou_accuracy"]
    row = next(line for line in output.splitlines() if line.startswith("iou "))
    assert row.split()[-2:] == [f"{ev['before']['iou']:.1%}", f"{ev['after']['iou']:.1%}"]


# -- every built-in figure through `vlft eval`, the answers fixed ------------------------------------------------

OPTIONS = "A. one disc\nB. three discs\nC. two discs"
# answers every named scorer can read: an option's letter, a box (absolute pixels) and a JSON object
REFERENCES = [
    'B. [10, 10, 50, 50] {"count": 3}',
    'C. [0, 0, 40, 40] {"count": 2}',
    'A. [60, 60, 100, 100] {"count": 1}',
]
ANSWERS = [REFERENCES[0], 'A. [0, 0, 40, 20] {"count": 2}', ""]


@pytest.fixture
def sink_set(counting, tmp_path):
    train, _ = counting
    rows = [json.loads(line) for line in train.read_text().splitlines()[:3]]
    data = tmp_path / "sink.jsonl"
    question = f"<image>\nWhich option, where, and how many?\n{OPTIONS}"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "image": str((train.parent / row["image"]).resolve()),
                    "conversations": [{"from": "user", "value": question}, {"from": "assistant", "value": reference}],
                }
            )
            + "\n"
            for row, reference in zip(rows, REFERENCES)
        )
    )
    return data


def test_eval_writes_every_built_in_figure_equal_to_its_hand_computation(sink_set, tmp_path, monkeypatch):
    import sacrebleu

    import vlft.evaluation.generation as generation

    def fixed_answers(model, encoder, records, *args, **kwargs):
        return [ANSWERS[REFERENCES.index(r.reference)] for r in records]

    monkeypatch.setattr(generation, "generate_answers", fixed_answers)
    out = tmp_path / "scores.json"
    code, output = cli_invoke(
        "eval", "--data", sink_set, "--scorer", "anls,relaxed,iou,choice,bleu,cer,json", "--output", out
    )
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
    for label in (
        "anls",
        "relaxed accuracy",
        "iou accuracy",
        "choice accuracy",
        "bleu",
        "cer (lower is better)",
        "json f1",
        "json valid",
    ):
        assert any(line.startswith(label) for line in output.splitlines()), label


def test_records_with_several_answers_score_the_best_of_them(counting, tmp_path, monkeypatch):
    """A record's ``answers`` (DocVQA's several acceptable answers): ANLS and exact match take the best."""
    import vlft.evaluation.generation as generation

    train, _ = counting
    image = str((train.parent / json.loads(train.read_text().splitlines()[0])["image"]).resolve())

    def record(reply, answers):
        return json.dumps(
            {
                "image": image,
                "answers": answers,
                "conversations": [
                    {"from": "user", "value": "<image>\nWhat is the total?"},
                    {"from": "assistant", "value": reply},
                ],
            }
        )

    data = tmp_path / "docvqa.jsonl"
    data.write_text(record("$12.00", ["12", "twelve dollars"]) + "\n" + record("kitten", ["kitten"]) + "\n")
    monkeypatch.setattr(
        generation, "generate_answers", lambda m, e, records, *a, **k: ["12", "sitting"][: len(records)]
    )
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
    assert code == 0 and f"shortness 1 if the answer is no longer than the reference (plugin {__name__})" in " ".join(
        output.split()
    )
    out = tmp_path / "scores.json"
    code, output = cli_invoke("eval", "--data", sink_set, "--scorer", "shortness", "--output", out)
    assert code == 0, output
    assert json.loads(out.read_text())["scores"]["shortness"] == 1.0
    from vlft.config import RunConfig

    registry = vlft.registry.get_registry()
    objective = registry.objective_for(RunConfig(objective="grpo", objective_options={"reward": ["shortness"]}))
    assert objective.options.reward == ["shortness"]
    assert registry.rewards["shortness"].build(None) is shortness
    monkeypatch.setattr(vlft.registry, "_default", None)


def test_the_demo_sets_answers_take_their_scorers_form(tmp_path):
    code, output = cli_invoke(
        "demo-data",
        tmp_path / "g",
        "--task",
        "grounding",
        "--train",
        3,
        "--val",
        3,
        "--box-coordinates",
        "relative-1000",
    )
    assert code == 0, output
    answers = [
        json.loads(line)["conversations"][1]["value"]
        for line in (tmp_path / "g" / "val.jsonl").read_text().splitlines()
    ]
    from vlft_scorers.boxes import boxes_in

    assert all(len(boxes_in(a)) == 1 and all(0 <= v <= 1000 for v in boxes_in(a)[0]) for a in answers)
    assert Path(tmp_path / "g" / "imgs").is_dir()
