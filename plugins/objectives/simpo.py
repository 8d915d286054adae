"""simpo: simple preference optimisation (Meng et al., 2024) on chosen and rejected replies, without a
reference model.

The reward of a reply is ``beta`` x its mean token log-probability (length-normalised, so a longer reply earns
nothing by its length); per pair, with a target margin ``gamma``:

    loss = -log sigmoid(reward(chosen) - reward(rejected) - gamma)

TRL's CPOTrainer with ``loss_type="simpo"`` and ``cpo_alpha=0`` computes the same loss (its ``simpo_gamma`` is
``gamma``). ``--beta`` (2.0) and ``--simpo-gamma`` (1.0: the paper's gamma / beta of 0.5). Averaged over the
step's pairs. Logged as DPO logs them: ``reward_chosen``, ``reward_rejected``, ``reward_margin``,
``preference_accuracy`` (the share of pairs whose chosen reward is strictly higher).

Imports inside functions: torch loads when a step runs, so listing the objectives stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlft import ObjectiveInfo, PairedPreference, Side, hookimpl, non_negative, option, positive

NAME = "simpo"
DESCRIPTION = (
    "simple preference optimisation: length-normalised rewards, the chosen over the rejected by a margin, no reference"
)
FIGURES = ("reward_chosen", "reward_rejected", "reward_margin", "preference_accuracy")


@dataclass(frozen=True)
class SimpoOptions:
    beta: float = option(
        2.0, "scale of the reward, beta x the reply's mean token log-probability (the paper's 2 to 2.5)", check=positive
    )
    simpo_gamma: float = option(
        1.0, "target margin between the chosen and the rejected reward (TRL's simpo_gamma)", check=non_negative
    )


@dataclass(frozen=True)
class Simpo(PairedPreference):
    def pair_loss(self, chosen: Side, rejected: Side):
        import torch.nn.functional as F  # loaded when a step runs

        o = self.options
        c, r = chosen.mean_logps, rejected.mean_logps
        losses = -F.logsigmoid(o.beta * (c - r) - o.simpo_gamma)  # as TRL's CPO computes it (rounding alike)
        reward_c, reward_r = o.beta * c.detach(), o.beta * r.detach()
        return losses, {
            "reward_chosen": reward_c,
            "reward_rejected": reward_r,
            "reward_margin": reward_c - reward_r,
            "preference_accuracy": (reward_c > reward_r).to(reward_c.dtype),
        }


@hookimpl
def vlft_objectives():
    return [ObjectiveInfo(NAME, DESCRIPTION, SimpoOptions)]


@hookimpl
def vlft_objective(objective, options):
    if objective != NAME:
        return None
    return Simpo(NAME, DESCRIPTION, options=options, figures=FIGURES)
