"""Group ``objectives``: seconds per step of vlft's DPO against its SFT and against TRL's DPOTrainer, and of
vlft's GRPO against TRL's GRPOTrainer, generation apart; the embedded model on the CPU.

The steppers are those of ``bench/dpo_vs_trl.py`` and ``bench/grpo_vs_trl.py`` (same demo data, LoRA r 32 on
text attention and the last 6 vision blocks, batch 4 records; GRPO: 4 prompts x G 4, 16 new tokens,
temperature 1, beta 0.04, token-level normalisation, the ``fields`` reward). A step includes its data (and
GRPO its sampling and scoring). Each variant takes ``STEPS`` steps per call, the calls interleaved
(``Interleaved``). TRL is no vlft dependency: ``make bench`` puts trl 1.16 on ``PYTHONPATH`` from
``.venv/trl-site`` (installed without dependencies, so the venv's torch, transformers, peft, accelerate and
datasets stay as they are); where trl is not importable the TRL variants are left out and their figures say
so. CPU only: the steppers build CPU runs.

Figures: vlft DPO/SFT s/step, vlft DPO / TRL DPO s/step (target <= 0.8), vlft GRPO / TRL GRPO s/step
(<= 0.8), and each GRPO's generating share of a step.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import pytest

from bench import dpo_vs_trl, grpo_vs_trl
from bench.support.figures import figure, record
from bench.support.timing import Interleaved

STEPS = {"dpo": 5, "grpo": 2}  # steps per timed call (one under --benchmark-disable)
ROUNDS = 5


def _trl_missing() -> str:
    try:
        import trl  # noqa: F401 - only whether it imports
    except ImportError as e:
        if os.environ.get("VLFT_REQUIRE_TRL") == "1":  # make test's pass with .venv/trl-site: it must import
            raise
        return f"trl not importable ({e}): `make bench` runs this group with .venv/trl-site on PYTHONPATH"
    return ""


@pytest.fixture
def cpu_only(env):
    if env.device.type != "cpu":
        pytest.skip("the objectives group's steppers build CPU runs (TRL's side by side)")


def _calls(steppers: dict, n: int, generating: dict | None = None) -> dict:
    """Interleaved's variants: each call takes ``n`` steps (GRPO's steppers return their generating seconds,
    kept per call in ``generating``)."""

    def call(name, stepper):
        def run():
            seconds = stepper(n)
            if generating is not None:
                generating[name].append((seconds or 0.0) / n)

        return run

    return {name: call(name, stepper) for name, stepper in steppers.items()}


@pytest.mark.benchmark(group="objectives")
def test_dpo_step(benchmark, env, cpu_only):
    from vlft.data.demo import write_demo_preferences

    folder = Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    ds = write_demo_preferences(folder / "demo", n_train=400, n_val=8, seed=0)
    steppers = {
        "vlft sft": dpo_vs_trl.vlft_stepper("sft", (ds.root / "train.jsonl", ds.root / "val.jsonl"), env.registry),
        "vlft dpo": dpo_vs_trl.vlft_stepper("dpo", (ds.train, ds.val), env.registry),
    }
    missing = _trl_missing()
    if not missing:
        steppers["trl dpo"] = dpo_vs_trl.trl_stepper((ds.train, ds.val), env.registry, folder)
    n = 1 if benchmark.disabled else STEPS["dpo"]
    timer = Interleaved(env, _calls(steppers, n))
    timer.run(benchmark, rounds=ROUNDS)
    figures = {"vlft dpo/sft step time": timer.ratio_figure("vlft dpo", "vlft sft")}
    figures["vlft dpo / trl dpo step time"] = (
        timer.ratio_figure("vlft dpo", "trl dpo", "<= 0.8") if not missing else figure(None, "<= 0.8", note=missing)
    )
    record(
        benchmark,
        env,
        None,
        "objectives",
        figures,
        timer.summary({k: n for k in steppers}),
        notes=[
            f"{n} steps of 4 records per timed call; a step includes its data",
            "TRL's DPOTrainer: training_step, optimizer and schedule, as its train() does",
        ],
    )


@pytest.mark.benchmark(group="objectives")
def test_grpo_step(benchmark, env, cpu_only):
    from vlft.data.demo import write_demo_dataset

    folder = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    ds = write_demo_dataset(folder / "demo", n_train=400, n_val=8, seed=0)
    steppers = {"vlft grpo": grpo_vs_trl.vlft_stepper((ds.train, ds.val), env.registry)}
    missing = _trl_missing()
    if not missing:
        steppers["trl grpo"] = grpo_vs_trl.trl_stepper((ds.train, ds.val), env.registry, folder)
    n = 1 if benchmark.disabled else STEPS["grpo"]
    generating = {name: [] for name in steppers}
    timer = Interleaved(env, _calls(steppers, n, generating))
    timer.run(benchmark, rounds=ROUNDS)

    def share(name):  # the median of the timed calls' generating share (the warm-up call's left out)
        timed = timer.times[name]
        return figure(statistics.median(g / (t / n) for g, t in zip(generating[name][-len(timed) :], timed)))

    figures = {"vlft grpo generating share": share("vlft grpo")}
    if missing:
        figures["vlft grpo / trl grpo step time"] = figure(None, "<= 0.8", note=missing)
    else:
        figures["vlft grpo / trl grpo step time"] = timer.ratio_figure("vlft grpo", "trl grpo", "<= 0.8")
        figures["trl grpo generating share"] = share("trl grpo")
    record(
        benchmark,
        env,
        None,
        "objectives",
        figures,
        timer.summary({k: n for k in steppers}),
        notes=[
            f"{n} steps of {grpo_vs_trl.PROMPTS} prompts x G {grpo_vs_trl.G}, {grpo_vs_trl.NEW_TOKENS} new "
            "tokens, per timed call; a step includes its data, sampling and rewards"
        ],
    )
