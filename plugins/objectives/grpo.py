"""grpo: group relative policy optimisation (Shao et al., 2024, DeepSeekMath) on sampled completions and
their rewards.

Each step (with ``--num-iterations N``, the first of every N), for every prompt of its micro-batches, G completions
are sampled from the policy (the adapted model, in evaluation mode, without gradients, with the KV cache;
``--num-generations``, ``--temperature``, ``--top-p``, ``--max-new-tokens``; image and video tokens suppressed),
all prompts of a micro-batch in one ``generate`` call, each data-parallel process on a random stream of its
own (``process_stream``: two processes given the same prompt draw different completions). Every log-probability
below (policy, old policy, reference) is taken under that sampling distribution: the logits divided by the
temperature, the suppressed tokens out of the softmax (``Passes.token_logps``); dropout is off in every pass
(``Objective.dropout``). Each completion is scored by the reward functions (``--reward``: the rewards add up)
against its record's reference, the last assistant reply of an ordinary SFT record. The advantage of a
completion is its reward against its group's: ``A = (r - mean_group) / (std_group + 1e-4)`` (``--scale-rewards
group``; ``batch``: the batch's std; ``none``: no division, Dr. GRPO). Per completion token, with
``ratio = exp(logp - logp_old)``:

    loss_t = -min(ratio A, clip(ratio, 1 - e, 1 + e) A) + beta KL_t,   KL_t = exp(ref - logp) - (ref - logp) - 1

(``--clip-epsilon e``; ``--beta``, 0 skips the reference pass; the reference is the adapter off, or the
``--init-adapter`` weights as loaded). The step's loss (``--grpo-norm``): ``token`` sums loss_t over every
completion token of the step (every micro-batch and process) and divides by their number (DAPO; Dr. GRPO
and TRL's ``loss_type="dapo"`` do the same), so long completions weigh by their tokens; ``sequence`` takes
each completion's token mean and averages over completions (the original GRPO). The completions are sampled
by the weights being trained. ``--num-iterations N`` (TRL's ``num_iterations``, the paper's mu) trains each
rollout on N optimizer steps: the data order gives N consecutive steps the same prompts and the core keeps
the rollout's batches for the N - 1 steps after the one that sampled them (``vlft.training.rollouts``). A
rollout's first step trains under the weights that sampled it, so the sampling policy's ``logp_old`` is the
model's own: the ratio is 1, nothing is clipped (``clip_fraction`` logs 0) and the gradient is the policy
gradient ``-A grad logp``. With N above 1 the rollout takes ``logp_old`` once, in a pass without gradients of
the same model and inputs as the trained pass (as TRL's GRPOTrainer does; not ``generate``'s scores, whose
other kernels would move the ratio off 1 by rounding alone); steps 2..N compare the updated policy with it, so
the ratio departs from 1 and the clip acts (``clip_fraction`` above 0). With N = 1 (the default) every rollout
is trained on once and ``logp_old`` is the trained pass's own, detached: the ratio is always 1. The reference's
log-probabilities are taken in the rollout too (the reference is frozen): one reference pass per rollout. The
rollout builds each batch whole, and the loss only reads it.
A run resumed from a checkpoint inside a rollout samples its prompts afresh for the steps it has left (the
kept batches are not checkpointed; see ``vlft.training.rollouts``); one resumed at a rollout's end draws what
the uninterrupted run draws.

Logged per step: ``reward`` (mean over completions) and ``reward_std`` (the mean of the groups' std), each
reward function's mean (``reward_<name>``), ``kl`` and ``clip_fraction`` (means over completion tokens),
``completion_length`` (mean tokens), ``completions`` and ``completion_tokens`` (per process), and
``generation_time_s`` and ``reward_time_s`` (per step; ``step_time_s`` holds them, the rest is training; 0 on
the steps that train on a kept rollout, which sample nothing). A kept rollout's steps log its reward again:
the figures describe the completions trained on.

A reward function that raises stops the run naming the reward, the record and the completion. Every reward
runs on every record's reference before step 1 (``check``), so a reference it cannot score is a ``file:line``
error before anything is written.

Imports inside functions: torch, transformers and the core's batch and row helpers load when a run is
planned or steps, so listing the objectives (``vlft objectives``) stays light.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from vlft import (
    OWN,
    PER_STEP,
    SHARED,
    Average,
    ConfigError,
    Generation,
    Objective,
    ObjectiveInfo,
    Prepared,
    VlftError,
    hookimpl,
    non_negative,
    option,
    positive,
    user_attribute,
)

NAME = "grpo"
DESCRIPTION = (
    "group relative policy optimisation: G sampled completions per prompt, rewarded against the "
    "record's reply, pushed toward the better ones of their group"
)
LAYOUT = (
    "conversations (the SFT layouts): the prompt up to the last assistant reply, which is the reference "
    "the rewards read"
)


@dataclass(frozen=True)
class GrpoOptions:
    reward: list[str] = option(
        ["fields"],
        "a reward function, repeatable (the rewards add up): a plugin's NAME or "
        "NAME=ARGUMENT (built in: format=REGEX, numeric, and every scorer: fields, "
        "exact, anls, relaxed, iou, ...; see `vlft objectives`) or your "
        "MODULE:FUNCTION",
        metavar="NAME[=ARG]|MODULE:FUNCTION",
    )
    num_generations: int = option(
        8,
        "completions sampled per prompt (the group whose rewards are compared), at least 2",
        check=lambda v: "" if v >= 2 else "must be at least 2 (a group's rewards are compared)",
    )
    temperature: float = option(1.0, "sampling temperature of the completions", check=positive)
    top_p: float = option(
        1.0,
        "nucleus sampling of the completions (1: off; no top-k either)",
        check=lambda v: "" if 0 < v <= 1 else "must be in (0, 1]",
    )
    beta: float = option(
        0.04,
        "the weight of the KL term to the reference (DeepSeekMath's; 0 skips the reference pass)",
        check=non_negative,
    )
    clip_epsilon: float = option(0.2, "the policy ratio is clipped to [1 - e, 1 + e] (PPO's clip)", check=positive)
    num_iterations: int = option(
        1,
        "optimizer steps trained on each rollout (TRL's num_iterations, the GRPO "
        "paper's mu): the prompts of N consecutive steps are sampled once, their "
        "completions trained on N times against the sampling policy's "
        "log-probabilities, so the ratio leaves 1 and --clip-epsilon clips (1: each "
        "rollout once)",
        check=lambda v: "" if v >= 1 else "must be at least 1 (each rollout trained on once)",
    )
    scale_rewards: str = option(
        "group",
        "advantages: (r - group mean) divided by the group's reward std (group), "
        "the batch's (batch), or not at all (none: Dr. GRPO)",
        choices=("group", "batch", "none"),
    )
    grpo_norm: str = option(
        "token",
        "loss normalisation: token (the sum over every completion token of the step, "
        "divided by their number: DAPO, Dr. GRPO, TRL's 'dapo') or sequence (each "
        "completion's token mean, averaged over completions: the original GRPO)",
        choices=("token", "sequence"),
    )


EPS = 1e-4  # added to the std of the rewards (TRL's value)
# what each logged figure is a mean over (the loss's own unit, completion tokens or completions, is not used)
FIGURE_UNITS = {
    "reward": "completions",
    "reward_std": "completions",
    "completion_length": "completions",
    "kl": "completion_tokens",
    "clip_fraction": "completion_tokens",
    "completions": PER_STEP,
    "completion_tokens": PER_STEP,
    "generation_time_s": PER_STEP,
    "reward_time_s": PER_STEP,
}


@hookimpl
def vlft_objectives():
    return [ObjectiveInfo(NAME, DESCRIPTION, GrpoOptions)]


@hookimpl
def vlft_objective(objective, config, options, rewards):
    if objective != NAME:
        return None
    o = options
    chosen = tuple(resolve_rewards(list(o.reward), rewards))
    figures = (
        "reward",
        "reward_std",
        *[f"reward_{label}" for label, _ in chosen if len(chosen) > 1],
        *(("kl",) if o.beta else ()),
        "clip_fraction",
        "completion_length",
        "completions",
        "completion_tokens",
        "generation_time_s",
        "reward_time_s",
    )
    units = {**FIGURE_UNITS, **{f"reward_{label}": "completions" for label, _ in chosen}}
    return Grpo(
        NAME,
        DESCRIPTION,
        options=o,
        layout=PromptRecords(config.max_new_tokens),
        rows_per_record=o.num_generations,
        average_over=Average.COMPLETION_TOKENS if o.grpo_norm == "token" else Average.COMPLETIONS,
        iterations=o.num_iterations,
        figures=figures,
        figure_units=units,
        reference=bool(o.beta),
        dropout=False,  # sampled in evaluation mode, so trained without dropout: the policy gradient is the sampler's
        generation=Generation(o.num_generations, config.max_new_tokens),
        demo_epochs=1.25,  # 500 steps of 4 prompts x G 8 on the demo set: what raised the reward from an SFT adapter
        packing_refusal="the completions are sampled in the step and trained as padded rows; packed rows are not "
        "built for them",
        notes=(plan_note(o, o.num_generations, sharded=config.shard == "fsdp"),),
        new_tokens=config.max_new_tokens,
        rewards=chosen,
    )


def plan_note(o: GrpoOptions, g: int, sharded: bool = False) -> str:
    """The plan's line on what a step samples and trains (``sharded``: --shard fsdp)."""
    n = o.num_iterations
    when = "each step samples" if n == 1 else f"the first of every {n} steps samples (--num-iterations {n})"
    trained = (
        "trains on them once"
        if n == 1
        else f"trains on them for {n} steps, the ratio to the sampling policy clipped to [1 - "
        f"{o.clip_epsilon}, 1 + {o.clip_epsilon}] (a checkpoint at a multiple of {n} steps resumes "
        f"exactly, another samples its rollout's prompts again)"
    )
    loss = (
        "summed over completion tokens and divided by the step's count (DAPO)"
        if o.grpo_norm == "token"
        else "each completion's token mean, averaged over completions"
    )
    generate = "generate with the KV cache, one call per micro-batch" + (
        ", every process decoding in step" if sharded else ""
    )
    vision = (
        "once per row in the trained pass (inside the sharded forward)"
        if sharded
        else "once per prompt in the trained pass (its features shared by the G rows)"
    )
    return (
        f"grpo: {when} {g} completions per prompt ({generate}), scores them, then {trained}: the loss is {loss}; "
        f"the vision tower runs {vision}"
    )


# -- rewards -----------------------------------------------------------------------------------------------


class RewardError(VlftError):
    """A reward function raised, or answered something that is not one finite number per completion."""


def resolve_rewards(specs: list[str], offered: dict) -> list[tuple[str, object]]:
    """[(label, function)] for ``--reward`` specs: NAME or NAME=ARGUMENT of a plugin's reward, or a user's
    MODULE:FUNCTION (a spec with '=' is always a plugin's, so a regex may hold ':')."""
    out, labels = [], set()
    for spec in specs:
        if "=" not in spec and ":" in spec:
            label, function = spec.rsplit(":", 1)[1], _user_function(spec)
        else:
            name, _, argument = spec.partition("=")
            if name not in offered:
                raise ConfigError(
                    f"--reward {spec}: no plugin offers a reward '{name}'; offered: "
                    f"{', '.join(sorted(offered)) or 'none'} (`vlft objectives`), or give your "
                    f"MODULE:FUNCTION"
                )
            label, function = name, offered[name].build(argument if "=" in spec else None)
        if label in labels:
            raise ConfigError(f"--reward {spec}: a reward named '{label}' is given twice")
        labels.add(label)
        out.append((label, function))
    return out


def _user_function(spec: str):
    module_name, attr, function = user_attribute(spec, "--reward")
    if not callable(function):
        raise ConfigError(f"--reward {spec}: {module_name} has no function '{attr}'")
    return function


def score(rewards, completions: list[str], references: list[str], where: list[str]):
    """(each completion's summed reward, {label: its rewards}); a reward that raises or answers badly stops the
    run with its name, the record and the completion (the first one it fails on)."""
    per_reward = {}
    for label, function in rewards:
        try:
            values = list(function(completions, references, where=where))
        except Exception as e:
            raise _culprit(label, function, completions, references, where, e) from e
        bad = next((i for i, v in enumerate(values) if not _finite_number(v)), None)
        if len(values) != len(completions) or bad is not None:
            i = bad if bad is not None else 0
            what = (
                f"{len(values)} values for {len(completions)} completions"
                if len(values) != len(completions)
                else f"{values[i]!r}, not a finite number"
            )
            raise RewardError(
                f"reward '{label}' answered {what} for record {where[i]} (completion "
                f"{completions[i]!r}); the run stops here, nothing of this step is written"
            )
        per_reward[label] = [float(v) for v in values]
    totals = [sum(vs) for vs in zip(*per_reward.values())]
    return totals, per_reward


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _culprit(label, function, completions, references, where, error) -> RewardError:
    """The first completion ``function`` raises on alone, or the batch's first where none does alone."""
    for i in range(len(completions)):
        try:
            function(completions[i : i + 1], references[i : i + 1], where=where[i : i + 1])
        except Exception as e:  # noqa: BLE001 - the one it fails on
            error = e
            break
    else:
        i = 0
    return RewardError(
        f"reward '{label}' raised {error.__class__.__name__}: {error} on record {where[i]} "
        f"(completion {completions[i]!r}, reference {references[i]!r}); the run stops here, nothing "
        f"of this step is written"
    )


def parse_prompt(obj, add_placeholders=False):
    """The SFT layouts, checked for what GRPO reads: the record ends with the assistant's reply (the
    reference the rewards read; FormatProblem: file:line)."""
    from vlft import ROLE_ALIASES, FormatProblem, parse_record  # the core's layouts, loaded at plan time only

    parsed = parse_record(obj, add_placeholders)
    if not parsed.turns or ROLE_ALIASES.get(parsed.turns[-1].role) != "assistant":
        raise FormatProblem(
            "the last turn must be the assistant's reply: grpo prompts with the turns before it "
            "and its rewards compare the completions with it"
        )
    return parsed


def check_references(records, *, rewards) -> list[str]:
    """Every reward on every record's reference, as a completion of itself: ['file:line: problem'] for each
    record one cannot score (it raises, or answers other than one finite number). Run by the core every run,
    outside the cached data check: a user's reward can change while the data does not."""
    references, where = [r.reference for r in records], [r.where for r in records]
    problems = []
    for label, function in rewards:
        try:  # all at once; one by one only to find the records it fails on
            values = list(function(references, references, where=where))
            if len(values) == len(references) and all(_finite_number(v) for v in values):
                continue
        except Exception:  # noqa: BLE001 - the user's code: found below, record by record
            pass
        for i, reference in enumerate(references):
            try:
                values = list(function([reference], [reference], where=[where[i]]))
            except Exception as e:  # noqa: BLE001 - whatever it raised, reported at this record
                problems.append(
                    f"{where[i]}: reward '{label}' cannot score this record's reference {reference!r} "
                    f"({e.__class__.__name__}: {e})"
                )
                continue
            if len(values) != 1 or not _finite_number(values[0]):
                problems.append(
                    f"{where[i]}: reward '{label}' answered {values!r} for this record's reference "
                    f"{reference!r}, not one finite number"
                )
    return problems


# -- data: prompts and their references ----------------------------------------------------------------------


class PromptEncoder:
    """A record as its prompt (encoded as for generation) with its reference and place; its measure is the
    prompt plus ``new_tokens`` sampled ones (the length check and the memory plan)."""

    def __init__(self, encoder, new_tokens: int):
        self.base, self.new_tokens = encoder, new_tokens

    def __getattr__(self, name):
        return getattr(self.base, name)

    def measure_labelled(self, record):
        tokens, grids, labelled = self.base.measure_labelled(record)
        return tokens - labelled + self.new_tokens, grids, self.new_tokens

    def encode(self, record) -> dict:
        return {**self.base.encode_prompt(record), "reference": record.reference, "where": record.where}


class PromptCollator:
    """Prompts padded on the left (as generation wants), their images, and on the host their references and
    places (``references``, ``where``) and count (``records``)."""

    def __init__(self, rows):
        self.rows = copy.copy(rows)
        self.rows.padding_side = "left"

    def __call__(self, samples: list[dict]) -> dict:
        batch = self.rows([{k: v for k, v in s.items() if k not in ("reference", "where")} for s in samples])
        batch["references"] = [s["reference"] for s in samples]
        batch["where"] = [s["where"] for s in samples]
        batch["records"] = len(samples)
        return batch


# -- the rollout: sample, score, advantages, the rows to train -------------------------------------------------


@dataclass(frozen=True)
class PromptRecords:
    """GRPO's record layout (``vlft.contracts.objective.RecordFormat``): the SFT layouts read as prompts with
    their reference replies, encoded for generation and measured with ``new_tokens`` sampled tokens."""

    new_tokens: int
    description: str = LAYOUT

    def parse(self, obj, add_placeholders=False):
        return parse_prompt(obj, add_placeholders)

    def encoder(self, sample_encoder):
        return PromptEncoder(sample_encoder, self.new_tokens)

    def collate(self, row_collator):
        return PromptCollator(row_collator)


def suppressed_tokens(processor) -> tuple[int, ...]:
    """The image and video tokens: a sampled one would ask the model for pictures the row does not have."""
    return tuple(
        t
        for t in (getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None))
        if t is not None
    )


@dataclass(frozen=True)
class Grpo(Objective):
    """GRPO on the objective contract: ``prepare`` is the rollout (sample, score, the rows to train, and what
    the loss compares with), ``loss`` the clipped policy-gradient loss on its rows (see the module docstring)."""

    new_tokens: int = 32
    rewards: tuple = field(default=(), compare=False)  # ((label, function), ...), resolved at plan time

    def check(self, records) -> list[str]:
        return check_references(records, rewards=self.rewards)

    def prepare(self, model, host_batches: list[dict], passes) -> Prepared:
        """The step's completions, sampled and scored (every micro-batch's prompts, one ``generate`` call
        each), laid out as rows to train, with the reference's log-probabilities (``--beta`` above 0) and, for a
        rollout trained on over several steps, the sampling policy's; and the units the loss is averaged over."""
        import torch  # the step runs torch already; the plugin module itself stays light

        net = passes.sampler(model)  # generate is the PEFT model's, not DDP's
        tokenizer, suppress = passes.encoder.tokenizer, suppressed_tokens(passes.encoder.processor)
        t0 = time.perf_counter()
        was_training = net.training
        net.eval()  # no dropout while sampling (nor in the trained pass: Objective.dropout)
        try:
            with torch.no_grad(), passes.autocast, process_stream(passes.device):
                sampled = [self._sample(net, b, passes, tokenizer, suppress) for b in host_batches]
        finally:
            net.train(was_training)
        generation_s = time.perf_counter() - t0  # the decoding below waited for the device
        batches, units, reward_s = [], 0, 0.0
        for host, prompt, sequences in sampled:
            batch, n, seconds = self._rows(host, prompt, sequences, tokenizer, suppress)
            batch = passes.with_positions(batch)
            reward_s += seconds
            batches.append(self._compared(net, batch, passes))
            units += n
        device = batches[0]["input_ids"].device
        return Prepared(
            batches,
            units,
            {
                "generation_time_s": torch.tensor(generation_s, device=device),
                "reward_time_s": torch.tensor(reward_s, device=device),
            },
        )

    def _sample(self, net, host: dict, passes, tokenizer, suppress):
        o = self.options
        prompt = passes.to_device(host)  # the references and places stay on the host
        sequences = passes.generate(
            net,
            prompt,
            do_sample=True,
            temperature=o.temperature,
            top_p=o.top_p,
            top_k=0,
            max_new_tokens=self.new_tokens,
            num_return_sequences=o.num_generations,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,
            **({"suppress_tokens": list(suppress)} if suppress else {}),
        )
        return host, prompt, sequences

    def _rows(self, host: dict, prompt: dict, sequences, tokenizer, suppress):
        """(the rows of one micro-batch's completions with their advantages and figures, its units, the seconds
        decoding and scoring them took)."""
        import torch

        from vlft import IGNORE_INDEX  # with the layouts: loaded when a step runs, not with the plugin

        g, b = self.options.num_generations, host["records"]
        length = prompt["input_ids"].shape[1]
        completion = sequences[:, length:]  # [b * g, T], prompt-major (generate's order)
        eos = torch.tensor(_eos_ids(tokenizer), device=completion.device)
        is_eos = torch.isin(completion, eos)
        mask = (torch.cumsum(is_eos, 1) - is_eos.long()) == 0  # up to and including the first end token
        t0 = time.perf_counter()
        ids = [row[m].tolist() for row, m in zip(completion, mask)]
        texts = [t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        references = [r for r in host["references"] for _ in range(g)]
        where = [w for w in host["where"] for _ in range(g)]
        totals, per_reward = score(self.rewards, texts, references, where)
        reward_s = time.perf_counter() - t0
        rewards = torch.tensor(totals, dtype=torch.float32, device=completion.device)
        advantages, spread = group_advantages(rewards, g, self.options.scale_rewards)

        def group_major(t):  # prompt-major [b * g, ...] -> [g * b, ...]: row j * b + i is prompt i's j-th
            return t.reshape(b, g, *t.shape[1:]).transpose(0, 1).reshape(b * g, *t.shape[1:])

        completion, mask = group_major(completion), group_major(mask)
        rows = {
            "input_ids": group_major(sequences),
            "attention_mask": torch.cat([prompt["attention_mask"].repeat(g, 1), mask.long()], 1),
        }
        shared = {}
        for key, value in prompt.items():
            if key in rows:
                continue
            if value.dim() >= 2 and tuple(value.shape[:2]) == (b, length):  # per-token inputs: rows of their own
                tail = torch.zeros(
                    (b * g, completion.shape[1], *value.shape[2:]), dtype=value.dtype, device=value.device
                )
                rows[key] = torch.cat([value.repeat(g, *[1] * (value.dim() - 1)), tail], 1)
            else:  # the prompts' images, given once (the core repeats their features for the g groups)
                shared[key] = value
        labels = torch.full_like(rows["input_ids"], IGNORE_INDEX)
        labels[:, length:] = torch.where(mask, completion, torch.full_like(completion, IGNORE_INDEX))
        rows["labels"] = labels
        batch = {**rows, SHARED: shared}
        lengths = mask.sum(1)
        n_tokens = int(lengths.sum())
        figures = {
            "reward": rewards.sum(),
            "reward_std": spread.sum(),
            **(
                {f"reward_{k}": torch.tensor(sum(v), device=rewards.device) for k, v in per_reward.items()}
                if len(per_reward) > 1
                else {}
            ),
            "completion_length": lengths.sum().float(),
            "completions": torch.tensor(float(b * g), device=rewards.device),
            "completion_tokens": torch.tensor(float(n_tokens), device=rewards.device),
        }
        batch[OWN] = {"advantages": group_major(advantages), "groups": g, "suppressed": suppress, "figures": figures}
        return batch, (n_tokens if self.options.grpo_norm == "token" else b * g), reward_s

    def _compared(self, net, batch: dict, passes) -> dict:
        """``batch`` with what the loss compares the trained pass with, taken once per rollout without
        gradients: the reference's log-probabilities (``--beta`` above 0), and the sampling policy's where the
        rollout is trained on over several steps (the weights that sampled it are the model's now)."""
        import torch

        o, own = self.options, batch[OWN]
        kept = {}
        with torch.no_grad():
            if o.beta and passes.has_reference:
                kept["ref_logps"], _ = passes.reference_token_logps(
                    batch, own["groups"], o.temperature, own["suppressed"]
                )
            if self.iterations > 1:
                kept["old_logps"], _ = passes.token_logps(net, batch, own["groups"], o.temperature, own["suppressed"])
        return {**batch, OWN: {**own, **kept}}

    def loss(self, model, batch: dict, passes):
        """(the batch's summed loss, {figure: sum}) for a rolled-out batch: summed over completion tokens
        (``--grpo-norm token``) or over completions of their token means (``sequence``), the log-probabilities
        under the sampling distribution (``Passes.token_logps``)."""
        o, own = self.options, batch[OWN]
        logps, mask = passes.token_logps(model, batch, own["groups"], o.temperature, own["suppressed"])
        old = own["old_logps"] if "old_logps" in own else logps.detach()  # a rollout's only pass: the sampler's
        per_token, kl, clipped = grpo_token_loss(
            logps, old, own.get("ref_logps"), own["advantages"], epsilon=o.clip_epsilon, beta=o.beta
        )
        m = mask.to(per_token.dtype)
        figures = dict(own["figures"])
        figures["clip_fraction"] = (clipped.to(m.dtype) * m).sum()
        if kl is not None:
            figures["kl"] = (kl.detach() * m).sum()
        return reduce_loss(per_token, m, o.grpo_norm), figures


@contextmanager
def process_stream(device):
    """Sampling on this process's own random stream. Every process seeds the run's generators alike
    (``--seed``), so two data-parallel processes would draw with the same random numbers (two given the same
    prompt would sample the same completions; TRL's GRPOTrainer seeds each device apart for the same reason).
    Rank 0 (and a single process) samples on the run's generators, as it always has; every other process on
    generators seeded with one number drawn from the run's CPU generator plus its rank, the run's generators
    put back after. Only rank 0's generator state is checkpointed: resumed, rank 0 draws what it drew
    uninterrupted, the others draw afresh (their generators followed their own completions' lengths before
    too)."""
    import torch

    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,))) + rank
    module = None if device.type == "cpu" else torch.get_device_module(device.type)
    cpu_state = torch.get_rng_state()
    device_state = module.get_rng_state() if module is not None else None
    try:
        torch.manual_seed(seed)
        if module is not None:
            module.manual_seed(seed)
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if module is not None:
            module.set_rng_state(device_state)


def _eos_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in ids:
        ids.append(tokenizer.pad_token_id)  # generate pads finished rows with it: never part of a completion
    return [i for i in ids if i is not None]


def group_advantages(rewards, groups: int, scale: str):
    """(advantages, each completion's group std), both ``[n]`` in the order of ``rewards`` (prompt-major: a
    prompt's ``groups`` completions side by side): ``(r - group mean) / (std + EPS)`` with the group's std
    (``group``, torch's unbiased std as TRL's) or the whole batch's (``batch``), or ``r - group mean``
    (``none``)."""
    r = rewards.reshape(-1, groups)
    mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)
    centred = r - mean
    if scale == "group":
        centred = centred / (std + EPS)
    elif scale == "batch":
        centred = centred / (rewards.std() + EPS)
    return centred.reshape(-1), std.expand_as(r).reshape(-1)


# -- the loss ----------------------------------------------------------------------------------------------


def grpo_token_loss(logps, old_logps, ref_logps, advantages, *, epsilon: float, beta: float):
    """(per-token loss, per-token KL or None, per-token clipped flags), all ``[n, T]``, from per-token
    log-probabilities of the completions under the policy, the policy that sampled them and the reference
    (None: no KL term) and each completion's advantage ``[n]``:
    ``-min(ratio A, clip(ratio, 1 - e, 1 + e) A) + beta (exp(ref - logp) - (ref - logp) - 1)``. A token counts
    as clipped where the clip decides (ratio above 1 + e with A > 0, below 1 - e with A < 0), as TRL counts."""
    import torch

    ratio = torch.exp(logps - old_logps)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * a)
    kl = None
    if ref_logps is not None and beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    clipped = ((ratio > 1 + epsilon) & (a > 0)) | ((ratio < 1 - epsilon) & (a < 0))
    return per_token, kl, clipped


def reduce_loss(per_token, mask, norm: str):
    """The batch's summed loss from per-token losses ``[n, T]`` and their mask: over every completion token
    (``token``: the core then divides by the step's completion tokens) or over completions of each one's token
    mean (``sequence``: divided by the step's completions)."""
    if norm == "token":
        return (per_token * mask).sum()
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum()
