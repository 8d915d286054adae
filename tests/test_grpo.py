"""GRPO (``--objective grpo``): its loss against a hand computation in float64, the reward functions and their
specs, a step's gradient pushing the better completions up, and real runs through the CLI from an SFT adapter
(``--init-adapter``): figures, plan, resume, bad rewards and data stopped before step 1 or with the reward's
name and record, what is refused.

One SFT adapter is trained per session (``sft_adapter``: a few steps, enough for the colour field) and one
GRPO run made from it (``grpo_run``); the resumed run is compared with that one.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import torch

import vlft_objectives.grpo as grpo
from helpers import brief_config, brief_flags, cli_invoke, die_at_step, installed
from vlft import Average, ConfigError
from vlft_objectives.rewards import vlft_rewards

GRPO_FIGURES = (
    "reward",
    "reward_std",
    "kl",
    "clip_fraction",
    "completion_length",
    "completions",
    "completion_tokens",
    "generation_time_s",
    "reward_time_s",
)


def offered() -> dict:
    from vlft.registry import load_registry  # the rewards and the scorers (each a reward) of the built-ins

    return {**load_registry(load_entry_points=False, builtins=True).rewards, **{r.name: r for r in vlft_rewards()}}


# -- the loss, by hand (float64) ---------------------------------------------------------------------------


def test_group_advantages_by_hand():
    """(r - group mean) / (group std + 1e-4), the std unbiased (n - 1) as TRL's; a group of equal rewards gets
    0 everywhere; 'none' only centres (Dr. GRPO); 'batch' divides by the whole batch's std.

    Equal, not close: the rewards are multiples of 1/2, so every mean (of 4, of 8), deviation, square and sum is
    exact in float64 in any order; what rounds (the division by n - 1, the square root, adding 1e-4, the
    division) is one correctly rounded IEEE operation on the same operands on both sides."""
    r = [1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    rewards = torch.tensor(r, dtype=torch.float64)
    adv, spread = grpo.group_advantages(rewards, 4, "group")
    std = math.sqrt((0.5**2 + 0.5**2 + 0 + 0) / 3)
    want = [(x - 0.5) / (std + 1e-4) for x in r[:4]] + [0.0] * 4
    assert adv.tolist() == want
    assert spread.tolist() == [std] * 4 + [0.0] * 4
    adv, _ = grpo.group_advantages(rewards, 4, "none")
    assert adv.tolist() == [0.5, -0.5, 0, 0, 0, 0, 0, 0]
    mean = sum(r) / 8
    batch_std = math.sqrt(sum((x - mean) ** 2 for x in r) / 7)
    adv, _ = grpo.group_advantages(rewards, 4, "batch")
    assert adv.tolist() == [(x - 0.5) / (batch_std + 1e-4) for x in r[:4]] + [0.0] * 4
    # groups are consecutive: the same rewards as 2 groups of 4 are not 4 groups of 2
    assert grpo.group_advantages(rewards, 2, "none")[0].tolist() == [0.5, -0.5, 0, 0, 0, 0, 0, 0]


def test_the_token_loss_clip_and_kl_by_hand():
    """Per token: -min(ratio A, clip(ratio, 1 - e, 1 + e) A) + beta (exp(ref - logp) - (ref - logp) - 1), with
    the tokens where the clip decides counted; checked against plain Python arithmetic, within what the two
    sides' rounding allows: torch's exp and math.exp are each within 1 ulp (2^-52 relative) of the true value,
    and each side rounds its few multiplications, additions and subtractions (at most 2^-53 of each result):
    the KL terms at most 8 x 2^-53 (e^|d| + |d| + 1) apart, the surrogates 8 x 2^-53 |ratio A|."""
    logp = [[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5]]
    old = [[-1.5, -2.0, -0.1], [-0.3, -1.0, -3.0]]  # ratios e^0.5 (clipped for A > 0), 1, e^-0.4; 1, e^-0.5, e^0.5
    ref = [[-1.2, -1.8, -0.5], [-0.2, -1.5, -2.0]]
    adv = [0.7, -1.3]
    eps, beta = 0.2, 0.05
    per_token, kl, clipped = grpo.grpo_token_loss(
        torch.tensor(logp, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(ref, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        epsilon=eps,
        beta=beta,
    )
    for i in range(2):
        for t in range(3):
            ratio = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            surrogate = min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
            d = ref[i][t] - logp[i][t]
            k = math.exp(d) - d - 1
            kl_rounding = 8 * 2.0**-53 * (math.exp(abs(d)) + abs(d) + 1)
            rounding = 8 * 2.0**-53 * abs(ratio * a) + beta * kl_rounding
            assert abs(float(per_token[i, t]) - (-surrogate + beta * k)) <= rounding, (i, t)
            assert abs(float(kl[i, t]) - k) <= kl_rounding, (i, t)
            want_clipped = (ratio > 1 + eps and a > 0) or (ratio < 1 - eps and a < 0)
            assert bool(clipped[i, t]) == want_clipped, (i, t)
    assert clipped.tolist() == [[True, False, False], [False, True, False]]
    assert (kl >= 0).all() and float(kl[0, 2]) == 0  # the estimator is 0 where policy and reference agree
    # beta 0 (or no reference): no KL term at all
    plain, none, _ = grpo.grpo_token_loss(
        torch.tensor(logp, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        None,
        torch.tensor(adv, dtype=torch.float64),
        epsilon=eps,
        beta=beta,
    )
    # per_token is plain + beta kl rounded once, and taking beta kl off rounds once more
    assert none is None and bool(
        ((plain - (per_token - beta * kl)).abs() <= 2.0**-53 * (per_token.abs() + plain.abs())).all()
    )


def test_token_and_sequence_normalisation_by_hand():
    """token (DAPO): every completion token weighs the same, the step's sum divided by its token count (the
    core divides); sequence: each completion's token mean, summed (the core divides by completions)."""
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    # whole numbers and 6 / 3: exact in float64
    assert float(grpo.reduce_loss(per_token, mask, "token")) == 1 + 2 + 3 + 4
    assert float(grpo.reduce_loss(per_token, mask, "sequence")) == (1 + 2 + 3) / 3 + 4 / 1


# -- rewards -------------------------------------------------------------------------------------------------


def test_the_built_in_rewards():
    rewards = offered()
    fields = rewards["fields"].build(None)
    assert fields(
        ["colour: red, defect: none", "colour: red, defect: dent", "red", "defect: none, colour: red"],
        ["colour: red, defect: none"] * 4,
    ) == [1.0, 0.5, 0.0, 1.0]
    with pytest.raises(ValueError, match="holds no 'field: value' pairs"):
        fields(["x"], ["just text"])
    exact = rewards["exact"].build(None)
    assert exact(["  colour: red,  defect: none ", "colour: red"], ["colour: red, defect: none"] * 2) == [1.0, 0.0]
    fmt = rewards["format"].build(r"colour: \w+, defect: \w+")
    assert fmt(["colour: red, defect: none", "colour: red"], ["", ""]) == [1.0, 0.0]
    numeric = rewards["numeric"].build(None)
    assert numeric(["there are 12 of them", "1,200", "none", "12.001"], ["12", "1200", "3", "12"]) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert rewards["numeric"].build("1e-3")(["12.001"], ["12"]) == [1.0]
    with pytest.raises(ValueError, match="holds no number"):
        numeric(["1"], ["no number"])
    for name, argument, said in (
        ("format", None, "needs a regex"),
        ("format", "(", "not a regular expression"),
        ("exact", "x", "takes no argument"),
        ("numeric", "abc", "relative tolerance"),
    ):
        with pytest.raises(ConfigError, match=said):
            rewards[name].build(argument)


def user_reward(completions, references, **context):
    return [float(len(c) < 10) for c in completions]


def test_reward_specs_resolve_plugins_and_user_functions():
    """NAME, NAME=ARGUMENT (a regex may hold ':'), MODULE:FUNCTION; unknown names list what is offered."""
    chosen = grpo.resolve_rewards(["fields", "format=colour: \\w+.*", f"{__name__}:user_reward"], offered())
    assert [label for label, _ in chosen] == ["fields", "format", "user_reward"]
    assert chosen[1][1](["colour: red, defect: none"], [""]) == [1.0]
    assert chosen[2][1] is user_reward
    with pytest.raises(
        ConfigError,
        match="no plugin offers a reward 'nosuch'; offered: anls, bleu, cer, choice, cider, "
        "exact, fields, format, iou, json, numeric, relaxed, rouge",
    ):
        grpo.resolve_rewards(["nosuch"], offered())
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        grpo.resolve_rewards(["no_such_module:f"], offered())
    with pytest.raises(ConfigError, match="has no function 'nothing'"):
        grpo.resolve_rewards([f"{__name__}:nothing"], offered())
    with pytest.raises(ConfigError, match="given twice"):
        grpo.resolve_rewards(["exact", "exact"], offered())


def test_a_reward_that_raises_is_named_with_the_record_and_completion():
    def picky(completions, references, **context):
        return [1.0 / (c != "boom") for c in completions]  # ZeroDivisionError on 'boom' only

    def short(completions, references, **context):
        return [1.0]

    where = ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"]
    with pytest.raises(grpo.RewardError) as e:
        grpo.score([("picky", picky)], ["fine", "boom", "ok"], ["r"] * 3, where)
    assert "reward 'picky' raised ZeroDivisionError" in str(e.value) and "record a.jsonl:2" in str(e.value)
    assert "'boom'" in str(e.value)
    with pytest.raises(grpo.RewardError, match="reward 'short' answered 1 values for 3 completions"):
        grpo.score([("short", short)], ["a", "b", "c"], ["r"] * 3, where)
    nan = [("nan", lambda c, r, **k: [0.0, float("nan"), 1.0])]
    with pytest.raises(grpo.RewardError, match=r"reward 'nan' answered nan, not a finite number for record a.jsonl:2"):
        grpo.score(nan, ["a", "b", "c"], ["r"] * 3, where)
    totals, parts = grpo.score(
        [("one", lambda c, r, **k: [1.0] * len(c)), ("picky", picky)], ["x", "y"], ["r", "r"], where[:2]
    )
    assert totals == [2.0, 2.0] and parts == {"one": [1.0, 1.0], "picky": [1.0, 1.0]}


# -- real runs through the CLI ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo task, small: 48 training and 8 validation conversations ('colour: X, defect: Y')."""
    from vlft.data.demo import write_demo_dataset

    return write_demo_dataset(tmp_path_factory.mktemp("grpo-demo") / "demo", n_train=48, n_val=8, seed=3)


@pytest.fixture(scope="session")
def sft_adapter(demo, tmp_path_factory):
    """An SFT run of a few steps from the base: enough to answer in the 'colour: X, defect: Y' form, so the
    fields reward has something to read (from the base every reward is 0 and every advantage too)."""
    out = tmp_path_factory.mktemp("grpo-sft") / "sft"
    values = dict(data=demo.train, val_data=demo.val, output=out, steps=SFT_STEPS, batch_size=4, lr=2e-3)
    code, output = cli_invoke(
        "run", *brief_flags(eval_samples=8, max_new_tokens=16, adapter={"lora_dropout": 0}, **values)
    )
    assert code == 0, output
    return out


SFT_STEPS = "80"  # 80 x 4 at lr 2e-3: colour right, defect about a third (the format learnt)


def grpo_args(demo, sft, out, *extra) -> list:
    """4 GRPO steps of 2 prompts x 4 completions of at most 16 tokens, from the SFT adapter; checkpoints at 2 and
    4; LoRA dropout 0, so the resumed run can draw the same computation."""
    return [
        "run",
        *brief_flags(
            objective="grpo",
            reward="fields",
            init_adapter=sft,
            data=demo.train,
            val_data=demo.val,
            output=out,
            steps=4,
            batch_size=2,
            num_generations=4,
            max_new_tokens=16,
            temperature=0.7,
            lr=3e-4,
            eval_samples=8,
            save_every=2,
            seed=1,
            adapter={"lora_dropout": 0},
        ),
        *extra,
    ]


@pytest.fixture(scope="session")
def grpo_run(demo, sft_adapter, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    code, output = cli_invoke(*grpo_args(demo, sft_adapter, out))
    assert code == 0, output
    return out, output


def logged(out: Path) -> list[dict]:
    return [m for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def test_a_grpo_run_from_an_sft_adapter_logs_its_figures_and_trains(grpo_run, sft_adapter):
    """``vlft run --objective grpo --reward fields --init-adapter SFT``: every step logs the rewards, KL, clip
    fraction, completion lengths and generation time, all finite and in range; step 1's KL is 0 (the policy is
    its reference, the SFT adapter); the adapter moved; the plan names the objective's options and what
    generation costs in memory; the run starts where the SFT run ended (the same greedy answers)."""
    out, output = grpo_run
    lines = logged(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert set(GRPO_FIGURES) <= set(m), m
        assert all(math.isfinite(m[k]) for k in GRPO_FIGURES), m
        assert 0 <= m["reward"] <= 1 and m["reward_std"] >= 0 and m["kl"] >= 0 and m["clip_fraction"] == 0
        assert m["completions"] == 8 and 8 <= m["completion_tokens"] <= 8 * 16
        assert m["completion_length"] == m["completion_tokens"] / 8  # a whole count over 8: exact
        assert 0 < m["generation_time_s"] < m["step_time_s"]
    assert lines[0]["kl"] == 0  # the policy starts as its reference
    assert any(m["kl"] > 0 for m in lines[1:])  # and leaves it
    # the SFT adapter answers in fields: rewards are neither all 0 nor all 1 (advantages are not all 0)
    assert 0 < sum(m["reward"] for m in lines) / 4 < 1 and any(m["reward_std"] > 0 for m in lines)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["objective"]["options"] == {
        "reward": ["fields"],
        "num_generations": 4,
        "temperature": 0.7,
        "top_p": 1.0,
        "beta": 0.04,
        "clip_epsilon": 0.2,
        "num_iterations": 1,
        "scale_rewards": "group",
        "grpo_norm": "token",
    }
    assert plan["objective"]["generation"] == {"sequences_per_record": 4, "new_tokens": 16}
    assert plan["memory"]["generation_bytes"] > 0 and plan["memory"]["batch"]["samples"] == 8
    assert "generation (before the trained pass, not beside it): KV cache" in output
    assert "--init-adapter" in output and plan["init_adapter"] == str(sft_adapter / "adapter")
    before = json.loads((out / "eval.json").read_text())["before"]
    sft_after = json.loads((sft_adapter / "eval.json").read_text())["after"]
    assert [e["prediction"] for e in before["examples"]] == [e["prediction"] for e in sft_after["examples"]]
    from safetensors.torch import load_file

    start, trained = (load_file(str(p / "adapter" / "adapter_model.safetensors")) for p in (sft_adapter, out))
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["objective"] == "grpo" and summary["status"] == "completed"


# The zero loss below, as float32 arithmetic leaves it: every term has magnitude <= 1 (rewards in [0, 1],
# advantages unscaled), and the logged value goes through at most 16 (a completion's tokens) + 8 (the step's
# completions) + 4 (a group's mean) + 2 (the divisions) float32 roundings of at most 2**-24 each.
ZERO_LOSS_ATOL = (16 + 8 + 4 + 2) * 2.0**-24


class SamplingSpy:
    """What a run's GRPO sampled and trained on, seen from inside the run (in this process, ``cli_invoke``):
    each sampling ``generate`` call's raw logits, sequences and prompt length (asked of the real ``generate``
    with ``output_logits``, which changes nothing it samples; the validation's calls too), and each trained
    batch's rewards as the reward functions scored them (``grpo.score``) and the advantages its loss received
    (``grpo.Grpo.loss``), the validation's (run without gradients) left out."""

    def __init__(self, monkeypatch):
        from transformers.generation.utils import GenerationMixin

        self.calls, self.rewards, self.advantages = [], [], []
        generate, score, loss = GenerationMixin.generate, grpo.score, grpo.Grpo.loss

        def spied_generate(model, *args, **kwargs):
            if not kwargs.get("do_sample"):
                return generate(model, *args, **kwargs)
            out = generate(model, *args, **kwargs, output_logits=True, return_dict_in_generate=True)
            self.calls.append(
                {
                    "logits": torch.stack(out.logits, 1),
                    "sequences": out.sequences,
                    "length": kwargs["input_ids"].shape[1],
                    "suppressed": kwargs.get("suppress_tokens"),
                }
            )
            return out.sequences

        def spied_score(*args, **kwargs):
            totals, parts = score(*args, **kwargs)
            if torch.is_grad_enabled():
                self.rewards.append(list(totals))
            return totals, parts

        def spied_loss(objective, model, batch, *args, **kwargs):
            if torch.is_grad_enabled():
                extra = batch[grpo.OWN]
                self.advantages.append((extra["advantages"].detach().clone(), extra["groups"]))
            return loss(objective, model, batch, *args, **kwargs)

        monkeypatch.setattr(GenerationMixin, "generate", spied_generate)
        monkeypatch.setattr(grpo, "score", spied_score)
        monkeypatch.setattr(grpo.Grpo, "loss", spied_loss)


def nucleus_positions(call: dict, temperature: float, top_p: float) -> tuple[list[float], float, float]:
    """For each sampled completion token of a ``SamplingSpy`` call (up to its end token), the probability mass of
    the tokens more probable than it under the sampling distribution (the logits over the temperature, the
    suppressed tokens out), in float64: top-p keeps the smallest set of most probable tokens whose mass reaches
    p, so a token is in it exactly when the mass above it is below p. Also the mass outside the ``top_p`` nucleus
    summed over those positions (how many tokens a draw from the whole distribution would put outside it, on
    average), and the rounding generate's own float32 top-p decision may differ from ours by: it divides each
    float32 logit z by T in float32 (a move of at most 2^-24 |z| / T, which moves a probability by at most
    twice that, relatively), takes the softmax (a few roundings of 2^-24 each) and sums the V sorted
    probabilities (V roundings of at most 2^-24 of a sum <= 1): at most (2 max|z| / T + V + 4) 2^-24 in all."""
    logits = call["logits"].double() / temperature  # [rows, steps, V]
    if call["suppressed"]:
        logits[..., list(call["suppressed"])] = float("-inf")
    probs = torch.softmax(logits, -1)
    new = call["sequences"][:, call["length"] :]
    ends = set(_ends())
    above, outside = [], 0.0
    for row in range(new.shape[0]):
        for t, token in enumerate(new[row].tolist()):
            p = probs[row, t]
            above.append(float(p[p > p[token]].sum()))
            ranked = p.sort(descending=True).values
            outside += float(ranked[(ranked.cumsum(0) - ranked) >= top_p].sum())
            if token in ends:
                break
    finite = call["logits"][torch.isfinite(call["logits"])]
    vocab = call["logits"].shape[-1]
    return above, outside, (2 * float(finite.abs().max()) / temperature + vocab + 4) * 2.0**-24


def _ends() -> list[int]:
    """The embedded tokenizer's end tokens: its eos and pad ids (generate pads finished rows with pad)."""
    from transformers import AutoTokenizer

    from vlft.models.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir(installed())))
    return [i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None]


SEQUENCE_TOP_P = 0.9


def test_sequence_norm_unscaled_rewards_top_p_and_clip_options_reach_the_run(demo, sft_adapter, tmp_path, monkeypatch):
    """``--grpo-norm sequence --scale-rewards none --beta 0 --top-p 0.9 --clip-epsilon 0.1``, each seen to act:

    - ``--top-p 0.9``: every sampled token lies in the 0.9 nucleus of the sampling distribution (the probability
      mass of the tokens more probable than it is below 0.9), read from the raw logits generate computed; the
      nucleus leaves out enough that drawn from the whole distribution (top-p ignored) some would fall outside;
    - ``--scale-rewards none``: the advantages the loss receives are ``r - mean`` of each group's rewards (those
      the reward scored, whose mean is the logged ``reward``), not the default's ``(r - mean) / (std + 1e-4)``;
    - ``--grpo-norm sequence`` with unscaled advantages and ``--beta 0``: each completion is one batch's pass over
      its own sampling (ratio 1), ``r - mean`` sums to 0 in each group and the per-sequence mean weighs each
      completion once, so every logged loss is 0 (not its gradient, ``A * grad log p``: the adapter moves); under
      the default token normalisation longer completions weigh more and it is not (the first test's run);
    - ``--clip-epsilon 0.1``: in the plan; at ratio 1 nothing is clipped whatever the epsilon (``clip_fraction``
      0): the clip's effect is asserted where the ratio leaves 1,
      ``test_num_iterations_trains_each_rollout_over_n_steps_and_the_clip_acts``."""
    out = tmp_path / "sequence"
    args = grpo_args(
        demo,
        sft_adapter,
        out,
        "--top-p",
        str(SEQUENCE_TOP_P),
        "--clip-epsilon",
        "0.1",
        "--scale-rewards",
        "none",
        "--grpo-norm",
        "sequence",
        "--beta",
        "0",
    )
    for flag, value in (("--steps", "2"), ("--save-every", "0"), ("--eval-samples", "0")):
        args[args.index(flag) + 1] = value
    spy = SamplingSpy(monkeypatch)
    code, output = cli_invoke(*args)
    assert code == 0, output
    monkeypatch.undo()
    plan = json.loads((out / "plan.json").read_text())["objective"]["options"]
    assert (plan["top_p"], plan["clip_epsilon"], plan["scale_rewards"], plan["grpo_norm"], plan["beta"]) == (
        SEQUENCE_TOP_P,
        0.1,
        "none",
        "sequence",
        0.0,
    )
    lines = logged(out)
    assert [m["step"] for m in lines] == [1, 2]
    assert any(m["reward_std"] > 0 for m in lines)  # advantages not all 0: the zero below is not trivial
    for m in lines:
        assert m["loss"] == pytest.approx(0.0, abs=ZERO_LOSS_ATOL), m
        assert m["clip_fraction"] == 0, m
    from safetensors.torch import load_file

    start, trained = (load_file(str(p / "adapter" / "adapter_model.safetensors")) for p in (sft_adapter, out))
    assert any(not torch.equal(start[k], trained[k]) for k in start)

    # --top-p: every sampled token inside the nucleus
    assert spy.calls
    outside = 0.0
    temperature = float(args[args.index("--temperature") + 1])
    for call in spy.calls:
        above, out_of_nucleus, rounding = nucleus_positions(call, temperature, SEQUENCE_TOP_P)
        assert max(above) < SEQUENCE_TOP_P + rounding, (max(above), rounding)
        outside += out_of_nucleus
    # and the check can fail: drawn from the whole distribution (top-p ignored), position i would fall outside
    # the nucleus with probability m_i, its mass outside; none would with probability prod(1 - m_i) <=
    # exp(-sum m_i) < e^-10 (the sum was 29.7 when written)
    assert outside > 10, outside

    # --scale-rewards none: each trained batch's advantages, by hand from its rewards
    assert len(spy.rewards) == len(spy.advantages) == 2  # one micro-batch a step
    spread = []
    for m, rewards, (advantages, g) in zip(lines, spy.rewards, spy.advantages, strict=True):
        assert m["reward"] == sum(rewards) / len(rewards)  # the rewards the run logged
        groups = [rewards[i : i + g] for i in range(0, len(rewards), g)]  # prompt-major, as scored
        unscaled = [[r - sum(grp) / g for r in grp] for grp in groups]
        got = advantages.reshape(g, -1).T.tolist()  # the loss's rows are group-major
        # rewards are multiples of 1/2 (the fields reward of 2 fields) and a group's mean a multiple of 1/8:
        # exact in float32, so the advantages are equal, not close
        assert got == unscaled, (got, rewards)
        spread += [grp for grp in groups if statistics.stdev(grp) > 0]
    assert spread  # where a group's rewards differ, the default would have divided by their std, != 1
    for grp in spread:
        mean, std = statistics.mean(grp), statistics.stdev(grp)
        assert [(r - mean) / (std + grpo.EPS) for r in grp] != [r - mean for r in grp]


def test_a_step_moves_the_policy_toward_the_better_completions(demo, sft_adapter, registry, tmp_path):
    """The loss's sign: one small gradient step on a rolled-out batch raises the log-probability of the
    completions with positive advantages against those with negative ones (sum of A_i x the change of
    completion i's log-probability > 0), as the policy gradient must; at the start the policy is its
    reference, so the KL term neither adds to the loss nor pulls."""
    from vlft import OWN
    from vlft.config import build_config
    from vlft.training.trainer import build_trainer

    config = build_config(
        {},
        dict(
            backend="cpu",
            objective="grpo",
            data=str(demo.train),
            val_data=str(demo.val),
            output=str(tmp_path / "r"),
            steps=1,
            batch_size=4,
            init_adapter=str(sft_adapter),
            max_new_tokens=16,
            adapter={"lora_dropout": 0.0},
            objective_options=dict(num_generations=4, reward=["fields"]),
        ),
    )
    s = build_trainer(registry, config)
    host = s.collate([s.dataset[i] for i in range(4)])
    passes = s.policy.passes()
    for seed in range(10):  # a draw where some group's rewards differ (else every advantage is 0)
        torch.manual_seed(seed)
        prepared = s.plan.objective.prepare(s.model, [host], passes)
        (batch,), units = prepared.batches, prepared.units
        advantages = batch[OWN]["advantages"]
        if bool((advantages != 0).any()):
            break
    assert bool((advantages != 0).any()), "no draw gave the rewards a spread"
    assert units == int((batch["kept_labels"] != -100).sum())  # token norm: the step's completion tokens

    def sequence_logps():
        with torch.no_grad():
            logps, _ = passes.token_logps(s.model, batch, 4)
        return logps.sum(1)

    before = sequence_logps()
    loss, figures = s.plan.objective.loss(s.model, batch, passes)
    assert float(figures["kl"]) == 0
    loss.backward()
    with torch.no_grad():
        for p in s.model.parameters():
            if p.requires_grad and p.grad is not None:
                p -= 1e-2 * p.grad
    change = sequence_logps() - before
    assert float((advantages.double() * change.double()).sum()) > 0, (advantages, change)


def test_the_trained_log_probabilities_are_those_of_the_sampling_distribution(demo, sft_adapter, tmp_path, monkeypatch):
    """At --temperature 0.7 the completions are drawn from softmax(logits / 0.7) over the vocabulary less the
    image and video tokens (generate's ``suppress_tokens``): the log-probabilities the loss trains (the ratio's
    numerator, and ``old_logps`` on a rollout's first pass) are those, token by token, as generate's own
    sampling scores give them (TRL divides by the temperature likewise). In float64 (the test plugin
    ``float64_reference``) the two computations differ only by generate's float32 copy of the logits; at
    temperature 1, or normalised over the suppressed tokens too, they differ by far more."""
    from contextlib import nullcontext

    import float64_reference

    from vlft import OWN
    from vlft.config import build_config
    from vlft.models.passes import token_logps
    from vlft.models.rows import row_inputs
    from vlft.registry import load_registry
    from vlft.training.trainer import build_trainer

    config = build_config(
        {},
        dict(
            backend="cpu",
            objective="grpo",
            data=str(demo.train),
            val_data=str(demo.val),
            output=str(tmp_path / "r"),
            steps=1,
            batch_size=2,
            init_adapter=str(sft_adapter),
            max_new_tokens=8,
            adapter={"lora_dropout": 0.0},
            objective_options=dict(num_generations=3, temperature=0.7, reward=["fields"]),
        ),
    )
    s = build_trainer(load_registry(plugins=(float64_reference,)), config)
    suppressed = grpo.suppressed_tokens(s.plan.processor)
    assert suppressed  # the image and video tokens of the embedded processor
    scores = []
    generate = type(s.model).generate

    def generate_keeping_scores(self, *args, **kwargs):  # the real generate, asked for its sampling scores
        out = generate(self, *args, **kwargs, output_scores=True, return_dict_in_generate=True)
        scores.append(out.scores)
        return out.sequences

    monkeypatch.setattr(type(s.model), "generate", generate_keeping_scores)
    # two prompts of one length: float64 sdpa on the CPU turns a left-padded row's fully masked positions into
    # NaN, which a float32 model never sees (its kernel gives them 0)
    by_length = {}
    for i in range(len(s.dataset)):
        by_length.setdefault(len(s.dataset[i]["input_ids"]), []).append(i)
    pair = next(ids[:2] for ids in by_length.values() if len(ids) > 1)
    torch.manual_seed(0)
    host = s.collate([s.dataset[i] for i in pair])
    (batch,) = s.plan.objective.prepare(s.model, [host], s.policy.passes()).batches
    assert batch[OWN]["suppressed"] == suppressed
    rows = {k: v for k, v in batch.items() if k != OWN}
    (steps,) = scores
    b, g = 2, 3
    length = rows["input_ids"].shape[1] - len(steps)
    sampled = rows["input_ids"][:, length:]  # group-major rows: row j * b + i is prompt i's j-th completion
    processed = torch.stack(steps, 1).double()  # [b * g, T, V], prompt-major: generate's float32 scores
    order = torch.tensor([i * g + j for j in range(g) for i in range(b)])
    expected = torch.log_softmax(processed, -1)[order].gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        inputs = row_inputs(s.model, rows, g)
        got, mask = token_logps(s.model, inputs, rows, nullcontext(), 0.7, suppressed)
        whole, _ = token_logps(s.model, inputs, rows, nullcontext(), 0.7)
        at_one, _ = token_logps(s.model, inputs, rows, nullcontext(), 1.0, suppressed)
    assert got.dtype == torch.float64 and int(mask.sum()) > 0
    got, whole, at_one, expected = (t[:, -len(steps) :] for t in (got, whole, at_one, expected))  # labelled last
    m = mask[:, -len(steps) :]
    # generate rounds each float64 logit z to float32 and divides by T in float32: each z / T moves by at most
    # 2 x 2^-24 |z| / T; a log-softmax moves by at most twice its inputs' largest move (the target's own plus
    # the log-sum-exp's, which is 1-Lipschitz in the max norm). The float64 passes' own rounding is ~1e-13.
    finite = processed[torch.isfinite(processed)]
    bound = 2 * (2 * 2.0**-24) * finite.abs().max().item()
    assert (got[m] - expected[m]).abs().max() <= bound, ((got[m] - expected[m]).abs().max(), bound)
    assert (whole[m] - expected[m]).abs().max() > 10 * bound  # the suppressed tokens' mass (1.5e-3 measured)
    assert (at_one[m] - expected[m]).abs().max() > 5e-2


def test_killed_and_resumed_it_draws_the_same_completions(grpo_run, demo, sft_adapter, tmp_path, monkeypatch):
    """Stopped during step 3 (after the step-2 checkpoint) and resumed: the sampler's state comes back with the
    checkpoint, so steps 3 and 4 draw and score the same completions and give the same losses; the reference is
    still the SFT adapter (kept in the checkpoint). Equal, not close: the checkpoint holds the adapter, the
    optimizer and the generators bit for bit, and this process computes the same operations on the same
    threads (as the N = 2 run's resume test asserts of every figure)."""
    again = tmp_path / "again"
    die_at_step(monkeypatch, 3)
    code, _ = cli_invoke(*grpo_args(demo, sft_adapter, again))
    assert code != 0 and [m["step"] for m in logged(again)] == [1, 2]
    monkeypatch.undo()
    code, output = cli_invoke(*grpo_args(demo, sft_adapter, again, "--resume"))
    assert code == 0, output
    for a, b in zip(logged(grpo_run[0]), logged(again), strict=True):
        for key in ("loss", "reward", "kl", "completion_tokens"):
            assert b[key] == a[key], (key, a, b)


# -- --num-iterations: each rollout trained on over N steps ------------------------------------------------------


def test_the_data_order_draws_each_rollouts_prompts_for_n_steps_and_resumes_inside_one():
    """``DataOrder.repeat``: every group of batches N times in a row (the same list, which the kept rollout
    trains on again), an epoch N times the steps, resumed inside a group for the steps it has left; naming a
    step's records and the memory plan's batches follow the same order."""
    from vlft.data.order import DataOrder, batches, run_micro_batches, step_indices, total_steps_for

    def collate(samples):
        return samples

    dataset, n = list(range(10)), 3
    once, repeated = (
        DataOrder(batch_size=2, grad_accum=1, seed=3),
        DataOrder(batch_size=2, grad_accum=1, seed=3, repeat=n),
    )
    straight = batches(dataset, collate, once, 0)
    groups = [next(straight) for _ in range(7)]  # more than an epoch (5 steps)
    drawn = batches(dataset, collate, repeated, 0)
    steps = [next(drawn) for _ in range(7 * n)]
    assert steps == [g for g in groups for _ in range(n)]
    assert all(steps[k] is steps[k - k % n] for k in range(len(steps)))  # one list per rollout
    resumed = batches(dataset, collate, repeated, 4)  # inside the second group: its last 2 steps, then on
    assert [next(resumed) for _ in range(8)] == steps[4:12]
    for k in (1, 3, 4, 16, 21):
        assert step_indices(len(dataset), repeated, k) == [j for b in steps[k - 1] for j in b]
    assert total_steps_for(len(dataset), None, 1.0, 2, 1, 1, repeat=n) == 5 * n
    assert list(run_micro_batches(len(dataset), repeated, 5 * n)) == list(run_micro_batches(len(dataset), once, 5))


def test_a_kept_rollout_samples_on_each_rollouts_first_step_and_after_a_resume_inside_one():
    """``KeptRollout`` prepares on a rollout's first step and hands its batches out again after, the time its
    preparing took (``Prepared.figures``) 0 on the steps that prepared nothing."""
    from vlft import Prepared
    from vlft.training.rollouts import KeptRollout

    sampled = []

    def prepare(model, host_batches, passes):
        sampled.append(host_batches)
        return Prepared([{"rollout": len(sampled)}], len(sampled), {"generation_time_s": torch.tensor(1.5)})

    kept = KeptRollout(prepare, iterations=3, start_step=0)
    got = [kept(None, [f"prompts {k // 3}"], None) for k in range(7)]
    assert [p.units for p in got] == [1, 1, 1, 2, 2, 2, 3] and sampled == [["prompts 0"], ["prompts 1"], ["prompts 2"]]
    assert [float(p.figures["generation_time_s"]) for p in got] == [1.5, 0, 0, 1.5, 0, 0, 1.5]
    sampled.clear()
    resumed = KeptRollout(prepare, iterations=3, start_step=4)  # a checkpoint of step 4: inside a rollout
    assert [resumed(None, [k], None).units for k in range(4)] == [1, 1, 2, 2]


def iterations_args(demo, sft, out, *extra) -> list:
    """``grpo_args`` with ``--num-iterations 2`` and a clip narrow enough for one update to leave it:
    rollouts sampled at steps 1 and 3, trained on again at 2 and 4; a checkpoint at each step, the last 3 kept
    (the resume test resumes from step 2's and step 3's)."""
    args = grpo_args(
        demo, sft, out, "--num-iterations", "2", "--clip-epsilon", ITERATIONS_EPSILON, "--keep-checkpoints", "3", *extra
    )
    args[args.index("--save-every") + 1] = "1"
    return args


ITERATIONS_EPSILON = "0.001"


@pytest.fixture(scope="session")
def iterations_run(demo, sft_adapter, tmp_path_factory):
    """The N = 2 run: its folder, its output, and for each trained pass (validation left out) the per-token
    log-probabilities of the policy and of the sampling policy and the advantages its loss compared
    (``grpo.grpo_token_loss``'s inputs, seen from inside the run)."""
    out = tmp_path_factory.mktemp("grpo-iterations") / "run"
    passes, token_loss = [], grpo.grpo_token_loss

    def spied_token_loss(logps, old_logps, ref_logps, advantages, **kwargs):
        if torch.is_grad_enabled():
            passes.append((logps.detach().clone(), old_logps.detach().clone(), advantages.detach().clone()))
        return token_loss(logps, old_logps, ref_logps, advantages, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo, "grpo_token_loss", spied_token_loss)
        code, output = cli_invoke(*iterations_args(demo, sft_adapter, out))
    assert code == 0, output
    return out, output, passes


SAME_COMPLETIONS = ("reward", "reward_std", "completion_length", "completions", "completion_tokens")


def clipped_tokens(logps, old_logps, advantages, epsilon: float) -> int:
    """The completion tokens where the clip decides at ``epsilon``: ratio above 1 + e with A > 0, below 1 - e with
    A < 0 (TRL's count); the ratio ``exp(logp - logp_old)`` as the loss computes it, in its dtype. Positions that
    are not completion tokens hold 0 in both log-probabilities: ratio 1, never counted."""
    ratio, a = torch.exp(logps - old_logps), advantages.unsqueeze(1)
    return int((((ratio > 1 + epsilon) & (a > 0)) | ((ratio < 1 - epsilon) & (a < 0))).sum())


def test_num_iterations_trains_each_rollout_over_n_steps_and_the_clip_acts(grpo_run, iterations_run):
    """``--num-iterations 2``: step 1 is the N = 1 run's step 1 to the bit (the same rollout, trained under the
    weights that sampled it: ratio 1, nothing clipped); step 2 trains on step 1's completions again (the same
    rewards and lengths, no sampling time) against step 1's log-probabilities, so the updated policy's ratio
    leaves [1 - e, 1 + e] and ``clip_fraction`` is above 0, and its loss is not the N = 1 run's (which sampled
    new completions); step 3 samples again (ratio 1) and step 4 clips again. The plan shows the option.

    ``--clip-epsilon 0.001`` acts: each step's logged ``clip_fraction`` is the share of its completion tokens that
    the clip decides at e = 0.001, counted from the ratios and advantages the loss compared; at the default
    0.2 the count on steps 2 and 4 differs (fewer tokens leave the wider band), so a run that ignored the
    option would log another fraction."""
    out, output, passes = iterations_run
    once, twice = logged(grpo_run[0]), logged(out)
    assert [m["step"] for m in twice] == [1, 2, 3, 4]
    assert {k: twice[0][k] for k in ("loss", *GRPO_FIGURES) if "time" not in k} == {
        k: once[0][k] for k in ("loss", *GRPO_FIGURES) if "time" not in k
    }
    for first, again in ((twice[0], twice[1]), (twice[2], twice[3])):
        assert first["clip_fraction"] == 0 and first["generation_time_s"] > 0
        assert again["clip_fraction"] > 0, again
        assert {k: again[k] for k in SAME_COMPLETIONS} == {k: first[k] for k in SAME_COMPLETIONS}
        assert again["generation_time_s"] == 0 and again["reward_time_s"] == 0
    assert twice[1]["loss"] != once[1]["loss"]
    plan = json.loads((out / "plan.json").read_text())["objective"]
    assert plan["options"]["num_iterations"] == 2 and plan["options"]["clip_epsilon"] == float(ITERATIONS_EPSILON)
    assert "the first of every 2 steps samples (--num-iterations 2)" in output
    # --clip-epsilon: one trained pass a step (one micro-batch); the logged fraction is a float32 count of whole
    # tokens (exact below 2^24) over the step's completion tokens, the same division as here: equal, not close
    assert len(passes) == 4
    default = json.loads((grpo_run[0] / "plan.json").read_text())["objective"]["options"]["clip_epsilon"]
    for m, (logps, old_logps, advantages) in zip(twice, passes, strict=True):
        named = clipped_tokens(logps, old_logps, advantages, float(ITERATIONS_EPSILON))
        assert m["clip_fraction"] == named / m["completion_tokens"], (m, named)
    for m, (logps, old_logps, advantages) in ((twice[k], passes[k]) for k in (1, 3)):  # 11 and 12 against 3 and 2
        assert clipped_tokens(logps, old_logps, advantages, default) != clipped_tokens(
            logps, old_logps, advantages, float(ITERATIONS_EPSILON)
        ), m


def test_num_iterations_resumes_exactly_at_a_rollouts_end_and_samples_again_inside_one(
    iterations_run, demo, sft_adapter, tmp_path
):
    """The N = 2 run resumed from its step-2 checkpoint (a rollout's end: nothing kept is lost) draws and trains
    what it did uninterrupted; resumed from step 3's (inside the second rollout, whose kept completions no
    checkpoint holds) it says so and samples step 4's prompts again: a fresh rollout, ratio 1, nothing clipped.
    Each resume starts from a copy of the finished run with the newer checkpoints removed, as a run stopped
    after that checkpoint would have left it (the resume truncates metrics.jsonl to the checkpoint's step)."""
    import shutil

    uninterrupted = logged(iterations_run[0])

    def resumed_from(step: int) -> tuple[Path, str]:
        out = tmp_path / f"from-{step}"
        shutil.copytree(iterations_run[0], out)
        for checkpoint in (out / "checkpoints").glob("step-*"):
            if int(checkpoint.name.rpartition("-")[2]) > step:
                shutil.rmtree(checkpoint)
        code, output = cli_invoke(*iterations_args(demo, sft_adapter, out, "--resume"))
        assert code == 0, output
        assert f"resumed      from step {step}" in output and [m["step"] for m in logged(out)] == [1, 2, 3, 4]
        return out, output

    at_end, output = resumed_from(2)
    assert "resumed inside a rollout" not in output
    for a, b in zip(uninterrupted, logged(at_end), strict=True):
        assert {k: b[k] for k in ("loss", *GRPO_FIGURES) if "time" not in k} == {
            k: a[k] for k in ("loss", *GRPO_FIGURES) if "time" not in k
        }, (a, b)

    inside, output = resumed_from(3)
    assert "resumed inside a rollout (--num-iterations 2): the prompts of step 4 are sampled again" in output
    last = logged(inside)[3]
    assert last["clip_fraction"] == 0 and last["generation_time_s"] > 0  # a fresh rollout
    assert uninterrupted[3]["clip_fraction"] > 0


PLOTTED = ("reward", "reward_std", "kl", "clip_fraction", "completion_length", "generation_time_s")


def test_the_report_plots_grpos_figures_for_one_and_two_iterations(grpo_run, iterations_run, tmp_path):
    """``vlft report`` on the N = 1 and N = 2 runs: a chart per GRPO figure under the objective's heading
    (reward, its spread, KL, clip fraction, completion length, generation time and the rest the plan names),
    both runs on each, drawn from their metrics.jsonl: the clip fraction 0 at every step of one, above 0 at the
    second and fourth of the other."""
    from PIL import Image

    from vlft.commands.report import read_run, series

    out = tmp_path / "report"
    code, output = cli_invoke("report", grpo_run[0], iterations_run[0], "--output", out)
    assert code == 0, output
    md = (out / "report.md").read_text()
    figures = json.loads((grpo_run[0] / "plan.json").read_text())["objective"]["figures"]
    assert set(PLOTTED) <= set(figures) and "## grpo figures" in md
    for figure in figures:
        assert f"![{figure} (grpo)]({figure}.png)" in md and f"{figure}.png: no run logged" not in md
        with Image.open(out / f"{figure}.png") as img:
            img.verify()
    assert (out / "report.html").read_text().count('src="data:image/png;base64,') == 5 + len(figures)
    runs = [read_run(grpo_run[0], "once"), read_run(iterations_run[0], "twice")]
    for figure in PLOTTED:
        assert series(runs, figure) == [
            (name, [1, 2, 3, 4], [m[figure] for m in logged(path)])
            for name, path in (("once", grpo_run[0]), ("twice", iterations_run[0]))
        ]
    (_, _, once), (_, _, twice) = series(runs, "clip_fraction")
    assert once == [0, 0, 0, 0] and twice[0] == twice[2] == 0 and twice[1] > 0 and twice[3] > 0


def always_raises(completions, references, **context):
    raise RuntimeError("this reward is broken")


def raises_off_reference(completions, references, **context):
    """Scores the references (the check before step 1 passes), raises on anything else."""
    for c, r in zip(completions, references):
        if c != r:
            raise ValueError(f"cannot read {c!r}")
    return [1.0] * len(completions)


def test_a_reward_that_raises_stops_the_run_with_its_name_and_record(demo, sft_adapter, tmp_path):
    """Raising on the references: a file:line error per record before step 1, nothing written. Raising on a
    sampled completion: the run stops in step 1 naming the reward, the record and the completion, with no
    adapter, checkpoint or summary written."""
    out = tmp_path / "broken"
    args = [a if a != "fields" else f"{__name__}:always_raises" for a in grpo_args(demo, sft_adapter, out)]
    code, output = cli_invoke(*args)
    assert code != 0 and not out.exists(), output
    assert (
        "train.jsonl:1: reward 'always_raises' cannot score this record's reference 'colour: " in output
        and "(RuntimeError: this reward is broken)" in output
    ), output
    out = tmp_path / "picky"
    args = [a if a != "fields" else f"{__name__}:raises_off_reference" for a in grpo_args(demo, sft_adapter, out)]
    code, output = cli_invoke(*args)
    assert code != 0, output
    assert "reward 'raises_off_reference' raised ValueError: cannot read" in output, output
    # the first sampling is the validation before training (val.jsonl) where there are validation batches
    assert re.search(r"on record (train|val)\.jsonl:\d+ \(completion '", output), output
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "metrics.jsonl").exists() or not logged(out)  # no step was logged


def test_bad_data_and_options_stop_before_step_1(demo, tmp_path):
    data = Path(demo.root) / "bad-grpo.jsonl"  # beside the demo's imgs/
    good = json.loads(Path(demo.train).read_text().splitlines()[0])
    ends_with_user = {**good, "conversations": good["conversations"] + [{"from": "human", "value": "and?"}]}
    data.write_text("".join(json.dumps(r) + "\n" for r in (good, ends_with_user)))
    out = tmp_path / "run"
    base = ["run", "--objective", "grpo", "--backend", "cpu", "--output", out, "--steps", "1"]
    code, output = cli_invoke(*base, "--data", data)
    assert code != 0 and not out.exists(), output
    assert (
        "bad-grpo.jsonl:2: the last turn must be the assistant's reply" in output and "bad-grpo.jsonl:1" not in output
    )
    code, output = cli_invoke(*base, "--data", demo.train, "--val-data", demo.val, "--reward", "numeric")
    assert code != 0 and not out.exists()
    assert "train.jsonl:1: reward 'numeric' cannot score this record's reference 'colour: " in output
    assert "holds no number" in output and "56 problem(s) for the grpo objective" in output  # 48 + 8 records
    # vlft data check finds the same before any run: the objective's layout and its rewards' check
    code, output = cli_invoke("data", "check", "--objective", "grpo", "--reward", "numeric", demo.train)
    assert code != 0 and "48 problem(s) found" in output, output
    assert "train.jsonl:1: reward 'numeric' cannot score this record's reference 'colour: " in output
    code, output = cli_invoke("data", "check", "--objective", "grpo", data)
    assert code != 0 and "bad-grpo.jsonl:2: the last turn must be the assistant's reply" in output, output
    assert cli_invoke("data", "check", "--objective", "grpo", "--reward", "fields", demo.train)[0] == 0
    for flags, said in (
        (["--reward", "nosuch"], "--reward nosuch: no plugin offers a reward 'nosuch'"),
        (["--reward", "format=("], "--reward format=(: not a regular expression"),
        (["--num-generations", "1"], "--num-generations (grpo) must be at least 2"),
        (["--top-p", "0"], "--top-p (grpo) must be in (0, 1]"),
        (["--packing", "on"], "--packing on: the grpo objective cannot pack"),
    ):
        code, output = cli_invoke(*base, "--data", demo.train, "--val-data", demo.val, *flags)
        assert code != 0 and said in output and not out.exists(), (flags, output)


def test_vlft_objectives_lists_grpo_its_options_and_the_rewards(registry):
    code, output = cli_invoke("objectives")
    assert code == 0, output
    assert "grpo: group relative policy optimisation" in output
    assert "  --num-generations 8  # completions sampled per prompt" in output
    assert "  --grpo-norm 'token'  # loss normalisation" in output
    assert "logs: reward, reward_std, kl, clip_fraction, completion_length" in output
    assert "format=REGEX: 1 if the whole completion matches the regex" in output
    assert {"fields", "exact", "format", "numeric"} <= set(registry.rewards)
    import vlft_objectives.rewards
    from vlft.config import RunConfig
    from vlft.testing import check_plugin

    for plugin in (grpo, vlft_objectives.rewards):  # answers None for the names of others
        check_plugin(plugin)
    # the hook itself, as the core asks it: the rewards on offer passed in, the named ones built
    answer = registry.pm.hook.vlft_objective(
        objective="grpo",
        config=RunConfig(objective="grpo"),
        options=grpo.GrpoOptions(reward=["exact"]),
        rewards=registry.rewards,
    )
    assert answer.options.reward == ["exact"] and "reward_exact" not in answer.figures  # one reward: no split
    assert registry.pm.hook.vlft_objective(objective="ppo", config=RunConfig(), options=None, rewards={}) is None
    zero = registry.objective_for(RunConfig(objective="grpo", objective_options={"beta": 0.0, "grpo_norm": "sequence"}))
    assert zero.reference is False and "kl" not in zero.figures  # beta 0: no reference pass
    assert zero.average_over is Average.COMPLETIONS


def test_two_processes_sample_and_train(demo, sft_adapter, tmp_path):
    """2 data-parallel processes of 1 prompt each, on a set of one demo record written 4 times: each process
    takes its own lines (the data order shards them), so both sample the same prompt, from the same weights.
    Their completions differ (each process samples on its own random stream: with one stream for both they
    were the same, token for token), and the logged figures count both processes' completions: each step's
    ``completions`` and ``completion_tokens`` (per process) are the two processes' sums halved, its
    ``completion_length`` and ``reward`` their means over all 8 completions, as the test plugin
    ``grpo_samples`` saw each process's ``generate`` return them (the tokens counted up to the first end token,
    the rewards scored here with the fields reward)."""
    import os
    import subprocess

    from transformers import AutoTokenizer

    from helpers import vlft_command
    from vlft.models.embedded import embedded_model_dir

    record = json.loads(Path(demo.train).read_text().splitlines()[0])
    data = Path(demo.root) / "one-record.jsonl"  # beside the demo's imgs/
    data.write_text((json.dumps(record) + "\n") * 4)
    out, samples = tmp_path / "two", tmp_path / "samples"
    samples.mkdir()
    args = [str(a) for a in grpo_args(demo, sft_adapter, out, "--eval-batches", "0")]  # no validation rollouts
    for flag, value in (("--batch-size", "1"), ("--steps", "2"), ("--eval-samples", "0"), ("--data", str(data))):
        args[args.index(flag) + 1] = value
    tests = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLFT_PLUGINS": "grpo_samples",
        "VLFT_TEST_SAMPLES": str(samples),
        "PYTHONPATH": os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run(
        [*vlft_command(), *args, "--nproc-per-node", "2"], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = logged(out)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert all(math.isfinite(m[k]) for k in GRPO_FIGURES), m
    assert lines[0]["kl"] == 0 and (out / "adapter" / "adapter_model.safetensors").is_file()

    ends = set(_ends())
    fields = offered()["fields"].build(None)
    reference = record["conversations"][-1]["value"]
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir(installed())))

    def completion(tokens: list[int]) -> list[int]:  # up to and including the first end token
        n = next((i + 1 for i, t in enumerate(tokens) if t in ends), len(tokens))
        return tokens[:n]

    ranks = [[json.loads(x) for x in (samples / f"rank-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [len(r) for r in ranks] == [2, 2]  # one sampling call a step on each process
    for m, zero, one in zip(lines, *ranks, strict=True):
        assert zero["prompt"] == one["prompt"]  # the same record, the same weights
        assert zero["new"] != one["new"]  # drawn apart
        drawn = [completion(t) for t in zero["new"] + one["new"]]
        assert len(drawn) == 8
        texts = [t.strip() for t in tokenizer.batch_decode(drawn, skip_special_tokens=True)]
        rewards = fields(texts, [reference] * 8)
        tokens = sum(len(t) for t in drawn)
        # counts are whole numbers and rewards multiples of 1/2: their sums are exact in float32, the halving and
        # the division by 8 exact too, so each figure equals its hand value
        assert (m["completions"], m["completion_tokens"]) == (8 / 2, tokens / 2), (m, tokens)
        assert (m["completion_length"], m["reward"]) == (tokens / 8, sum(rewards) / 8), (m, rewards)


def test_the_chain_sft_dpo_grpo_runs_as_three_runs(demo, tmp_path):
    """README's chain at the default LoRA dropout (0.05): SFT, then DPO from it, then GRPO from the DPO
    adapter, each with --init-adapter. DPO and GRPO train with dropout off (``Objective.dropout``), so each run's
    step 1 computes its policy exactly as its reference: DPO's rewards are 0 and its loss log 2, GRPO's KL is 0.
    With dropout left on in the trained pass, DPO's step-1 chosen reward was -0.005 and GRPO's KL above 0."""
    from vlft.data.demo import write_demo_preferences

    pref = write_demo_preferences(tmp_path / "pref", n_train=8, n_val=2, seed=4)
    common = brief_flags(batch_size=2, steps=2, eval_samples=2, max_new_tokens=16)
    sft = tmp_path / "sft"
    code, output = cli_invoke(
        "run", "--data", demo.train, "--val-data", demo.val, "--output", sft, "--lr", "2e-3", *common
    )
    assert code == 0, output
    dpo = tmp_path / "dpo"
    code, output = cli_invoke(
        "run",
        "--objective",
        "dpo",
        "--rpo-alpha",
        "1",
        "--init-adapter",
        sft,
        "--data",
        pref.train,
        "--val-data",
        pref.val,
        "--output",
        dpo,
        *common,
    )
    assert code == 0, output
    assert "dropout: off in every pass" in output
    first = logged(dpo)[0]
    assert first["reward_chosen"] == 0 and first["reward_rejected"] == 0, first
    # the loss is the float32 mean over the step's 2 pairs of -logsigmoid(0) + nll_i, nll_chosen the mean of the
    # same nll_i: logsigmoid(0) within 2 ulp of log 2, one rounding adding nll_i (at most 2|loss|, loss_i >= 0),
    # one in each sum of two (the halving is exact), each at most 2^-24 of its magnitude
    rounding = 2.0**-24 * (2 * math.log(2) + 3 * first["loss"] + first["nll_chosen"])
    assert abs(first["loss"] - first["nll_chosen"] - math.log(2)) <= rounding, (first, rounding)
    out = tmp_path / "grpo"
    code, output = cli_invoke(
        "run",
        "--objective",
        "grpo",
        "--reward",
        "fields",
        "--init-adapter",
        dpo,
        "--data",
        demo.train,
        "--val-data",
        demo.val,
        "--output",
        out,
        *common,
    )
    assert code == 0, output
    lines = logged(out)
    assert [m["step"] for m in lines] == [1, 2] and lines[0]["kl"] == 0
    assert json.loads((out / "plan.json").read_text())["init_adapter"] == str(dpo / "adapter")
    assert json.loads((out / "plan.json").read_text())["objective"]["dropout"] is False


def test_no_hook_is_called_inside_a_grpo_step(demo, registry, tmp_path, monkeypatch):
    """Sampling, rewards and the loss run inside the step from what the plan resolved: no hook is asked."""
    from test_run import hook_calls_inside_steps

    config = brief_config(
        objective="grpo",
        data=demo.train,
        val_data=demo.val,
        output=tmp_path / "r",
        steps=2,
        batch_size=1,
        max_new_tokens=4,
        objective_options={"num_generations": 2},
    )
    assert hook_calls_inside_steps(registry, config, monkeypatch) == []
