"""dpo: direct preference optimisation (Rafailov et al., 2023) on chosen and rejected replies.

Each record is a prompt (with its images) and two replies; the policy is the adapted model, the reference
the same model with the adapter off (or, with ``--init-adapter``, the adapter the run started from). For each
reply, the log-ratio is the policy's summed log-probability of the reply's tokens minus the reference's;
``margin = ratio(chosen) - ratio(rejected)``. Losses (``--dpo-loss``), per pair, averaged over the step's
pairs (every micro-batch and process):

- ``sigmoid``: ``-(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)`` (``eps = --label-smoothing``:
  conservative DPO; 0 is the original loss, TRL's ``sigmoid``);
- ``ipo``: ``(m' - 1 / (2 beta))^2`` with ``m'`` the margin of per-token means (each ratio divided by its
  reply's token count, as TRL's ``ipo``);
- ``hinge``: ``relu(1 - beta m)``.

``--rpo-alpha a`` adds ``a x`` the chosen reply's mean token negative log-likelihood to each pair's loss (RPO,
Pang et al., 2024; TRL's ``rpo_alpha``, LLaMA-Factory's ``pref_ftx``): plain DPO may lower both replies'
likelihoods while their margin grows (measured on the demo after SFT: the chosen answer's log-probability
fell from -3.2 to -33.8 and greedy answers broke), the NLL term holds the chosen one up; logged as
``nll_chosen``.

Logged (means over the pairs): the loss, ``reward_chosen`` and ``reward_rejected`` (``beta x`` each ratio),
``reward_margin``, ``preference_accuracy`` (the share of pairs whose chosen reward is strictly higher: 0 while
the policy still equals the reference) and the policy's ``logps_chosen`` and ``logps_rejected``; validation
logs each as ``val_<name>``.

The core reads the pairs, runs both rows on one vision pass and the reference's pass before the policy's
(``vlft.PairedPreference``); this module writes the loss of a pair.

Imports inside functions: torch loads when a step runs, so listing the objectives (``vlft objectives``, ``vlft
plugins``) stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlft import ConfigError, ObjectiveInfo, PairedPreference, Side, hookimpl, non_negative, option, positive

NAME = "dpo"
DESCRIPTION = (
    "direct preference optimisation: the chosen reply over the rejected one, against a reference (the "
    "adapter off, or the --init-adapter weights)"
)
FIGURES = ("reward_chosen", "reward_rejected", "reward_margin", "preference_accuracy", "logps_chosen", "logps_rejected")


@dataclass(frozen=True)
class DpoOptions:
    beta: float = option(
        0.1,
        "how strongly the policy is held to the reference (the implicit reward is beta x "
        "the log-ratio of policy to reference)",
        check=positive,
    )
    dpo_loss: str = option(
        "sigmoid",
        "sigmoid (-log sigmoid(beta x margin)), ipo (squared distance of the "
        "per-token margin to 1/(2 beta)) or hinge (relu(1 - beta x margin))",
        choices=("sigmoid", "ipo", "hinge"),
    )
    label_smoothing: float = option(
        0.0,
        "sigmoid loss only: the share of pairs taken as mislabelled (conservative DPO), in [0, 0.5)",
        check=lambda v: "" if 0 <= v < 0.5 else "must be in [0, 0.5)",
    )
    rpo_alpha: float = option(
        0.0,
        "weight of the chosen reply's mean token negative log-likelihood added to each "
        "pair's loss (RPO; TRL's rpo_alpha, LLaMA-Factory's pref_ftx): keeps the chosen "
        "answers likely while the margin grows (0: plain DPO)",
        check=non_negative,
    )

    def __post_init__(self):
        if self.label_smoothing and self.dpo_loss != "sigmoid":
            raise ConfigError(
                f"--label-smoothing applies to --dpo-loss sigmoid (conservative DPO); {self.dpo_loss} takes none"
            )


@dataclass(frozen=True)
class Dpo(PairedPreference):
    def pair_loss(self, chosen: Side, rejected: Side):
        import torch  # the step runs torch already; the plugin module itself stays light
        import torch.nn.functional as F

        o = self.options
        c, r = chosen.logps - chosen.reference, rejected.logps - rejected.reference
        if o.dpo_loss == "ipo":
            margin = c / chosen.tokens.clamp(min=1) - r / rejected.tokens.clamp(min=1)
            losses = (margin - 1 / (2 * o.beta)) ** 2
        elif o.dpo_loss == "hinge":
            losses = torch.relu(1 - o.beta * (c - r))
        else:
            margin = o.beta * (c - r)
            losses = -(1 - o.label_smoothing) * F.logsigmoid(margin) - o.label_smoothing * F.logsigmoid(-margin)
        reward_c, reward_r = o.beta * c.detach(), o.beta * r.detach()
        figures = {
            "reward_chosen": reward_c,
            "reward_rejected": reward_r,
            "reward_margin": reward_c - reward_r,
            "preference_accuracy": (reward_c > reward_r).to(reward_c.dtype),
            "logps_chosen": chosen.logps.detach(),
            "logps_rejected": rejected.logps.detach(),
        }
        if o.rpo_alpha:
            nll = -chosen.mean_logps
            losses = losses + o.rpo_alpha * nll
            figures["nll_chosen"] = nll.detach()
        return losses, figures


@hookimpl
def vlft_objectives():
    return [ObjectiveInfo(NAME, DESCRIPTION, DpoOptions)]


@hookimpl
def vlft_objective(objective, options):
    if objective != NAME:
        return None
    return Dpo(
        NAME,
        DESCRIPTION,
        options=options,
        reference=True,
        figures=FIGURES + (("nll_chosen",) if options.rpo_alpha else ()),
    )
