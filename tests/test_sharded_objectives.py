"""DPO and GRPO under ``--shard fsdp`` (FSDP2, 2 processes on the CPU with gloo) through the CLI, against one
process: the reference pass (the adapter off, or the ``--init-adapter`` weights swapped in) and generation run
on the sharded parameters.

Four short runs on the embedded default, shared by the module: DPO on 4 pairs, one process of 2 pairs a step
and 2 sharded processes of 1 pair each (the same pairs a step); GRPO on one demo record written 4 times (each
process samples the same prompt) from the one-process DPO adapter (``--init-adapter``: the reference is that
adapter, swapped in), one process and 2 sharded processes of 1 prompt each, the completions each process's
``generate`` returned written down by the test plugin ``grpo_samples``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from helpers import cli_invoke, installed, vlft_command

TESTS = Path(__file__).resolve().parent
DPO_FIGURES = ("reward_chosen", "reward_rejected", "reward_margin", "preference_accuracy")
G = 4  # completions per prompt


def logged(out: Path) -> list[dict]:
    return [m for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def common(data: Path, val: Path, out: Path, batch: int) -> list[str]:
    """2 steps of ``batch`` records per process, no validation passes, one greedy answer of 2 tokens before
    and after; LoRA dropout 0, so one process and two draw the same computation."""
    return [
        *("--backend", "cpu", "--data", str(data), "--val-data", str(val), "--output", str(out)),
        *("--steps", "2", "--batch-size", str(batch), "--log-every", "1", "--eval-every", "0"),
        *("--eval-batches", "0", "--eval-samples", "1", "--max-new-tokens", "2", "--save-every", "0"),
        *("--seed", "1", "--lr", "3e-3", "--adapter-opt", "lora_dropout=0", "--quiet"),
    ]


def sharded(argv: list[str], env: dict | None = None) -> None:
    """``vlft ARGV --shard fsdp --nproc-per-node 2`` as a user runs it."""
    proc = subprocess.run(
        [*vlft_command(), *argv, "--shard", "fsdp", "--nproc-per-node", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def pref(tmp_path_factory):
    from vlft.data.demo import write_demo_preferences

    return write_demo_preferences(tmp_path_factory.mktemp("sharded-prefs") / "demo", n_train=4, n_val=1, seed=4)


@pytest.fixture(scope="module")
def dpo_runs(pref, tmp_path_factory):
    """(one process's run folder, the 2 sharded processes' run folder)."""
    root = tmp_path_factory.mktemp("sharded-dpo")
    one, two = root / "one", root / "two"
    code, output = cli_invoke("run", "--objective", "dpo", *common(pref.train, pref.val, one, 2))
    assert code == 0, output
    sharded(["run", "--objective", "dpo", *common(pref.train, pref.val, two, 1)])
    return one, two


def test_dpo_sharded_trains_as_one_process(dpo_runs):
    """Step 1 (the policy is the base: rewards 0, the loss log 2) and step 2 (the adapter moved: the rewards
    compare the sharded policy with the sharded reference, the adapter off) log one process's loss and
    figures; the plan says the run is sharded."""
    one, two = dpo_runs
    plan = json.loads((two / "plan.json").read_text())
    assert plan["sharding"]["strategy"] == "fsdp" and plan["sharding"]["world_size"] == 2
    a, b = logged(one), logged(two)
    assert [m["step"] for m in b] == [1, 2]
    assert a[1]["reward_chosen"] != 0 and a[1]["reward_margin"] != 0  # step 2 compares a moved policy
    for x, y in zip(a, b, strict=True):
        for key in ("loss", *DPO_FIGURES):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (key, x, y)


# -- GRPO ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpo_runs(pref, dpo_runs, tmp_path_factory):
    """{'one' | 'two': (run folder, [each process's sampled lines: {prompt, new}, one a step])}: GRPO from the
    one-process DPO adapter, one process and 2 sharded processes."""
    import grpo_samples

    from vlft.testing import registry_with

    root = tmp_path_factory.mktemp("sharded-grpo")
    record = json.loads((pref.root / "train.jsonl").read_text().splitlines()[0])
    data = pref.root / "one-record.jsonl"  # beside the demo's imgs/
    data.write_text((json.dumps(record) + "\n") * 4)
    extra = [
        *("--objective", "grpo", "--reward", "grpo_samples:characters", "--init-adapter", str(dpo_runs[0])),
        *("--num-generations", str(G), "--max-new-tokens", "24", "--temperature", "1.0"),
    ]
    runs = {}
    for name in ("one", "two"):
        out, samples = root / name, root / f"{name}-samples"
        samples.mkdir()
        argv = ["run", *common(data, data, out, 1), *extra]  # extra's --max-new-tokens last: the completions
        env = {grpo_samples.FOLDER_ENV: str(samples)}
        if name == "one":
            os.environ.update(env)
            try:
                code, output = cli_invoke(*argv, registry=registry_with(grpo_samples))
            finally:
                del os.environ[grpo_samples.FOLDER_ENV]
            assert code == 0, output
        else:
            path = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
            sharded(argv, {**env, "VLFT_PLUGINS": "grpo_samples", "PYTHONPATH": path})
        ranks = sorted(samples.glob("rank-*.jsonl"))
        runs[name] = (out, [[json.loads(x) for x in r.read_text().splitlines()] for r in ranks])
    return runs


def hand_step_one(drawn: list[list[list[int]]]) -> dict:
    """Step 1's loss and figures, by hand, from each process's completions (``drawn``: per process, its G
    sampled token lists): the characters reward, the group advantages, and the token-normalised loss with the
    ratio 1 and the KL 0 (the policy is its reference and the sampler): ``-sum A_i L_i / sum L_i``."""
    import grpo_samples
    import torch
    from transformers import AutoTokenizer

    import vlft_objectives.grpo as grpo
    from vlft.models.embedded import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir(installed())))
    ends = set(grpo._eos_ids(tokenizer))
    weighted, tokens, rewards = 0.0, 0, []
    for rows in drawn:
        kept = [t[: next((i + 1 for i, x in enumerate(t) if x in ends), len(t))] for t in rows]
        texts = [t.strip() for t in tokenizer.batch_decode(kept, skip_special_tokens=True)]
        scored = grpo_samples.characters(texts, texts)
        advantages, _ = grpo.group_advantages(torch.tensor(scored, dtype=torch.float32), G, "group")
        weighted += sum(-a * len(t) for a, t in zip(advantages.tolist(), kept))
        tokens += sum(len(t) for t in kept)
        rewards += scored
    return {
        "loss": weighted / tokens,
        "reward": sum(rewards) / len(rewards),
        "completion_length": tokens / len(rewards),
    }


def test_grpo_sharded_samples_and_trains_as_one_process(grpo_runs):
    """Rank 0 of the sharded run samples one process's completions, token for token (generate on the shards,
    every process decoding in step); step 1's loss, reward and completion length are, in both runs, those
    computed by hand from the completions their processes drew; the KL to the reference (the --init-adapter
    weights swapped into the shards) is 0 at step 1 and above 0 once the adapter moved."""
    (one, [one_samples]), (two, two_samples) = grpo_runs["one"], grpo_runs["two"]
    assert len(two_samples) == 2 and [len(r) for r in two_samples] == [2, 2]  # one sampling call a step each
    assert two_samples[0][0] == one_samples[0]  # the same prompt, the same completions
    for out, drawn in ((one, [one_samples[0]["new"]]), (two, [r[0]["new"] for r in two_samples])):
        first = logged(out)[0]
        want = hand_step_one(drawn)
        assert abs(want["loss"]) > 1e-3, want  # completions of several lengths: not the 0 of equal ones
        for key, value in want.items():
            assert first[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (out.name, key, first, want)
    steps = logged(two)
    assert steps[0]["kl"] == 0 and math.isfinite(steps[1]["kl"]) and steps[1]["kl"] > 0, steps
