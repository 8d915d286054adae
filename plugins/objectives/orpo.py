"""orpo: odds ratio preference optimisation (Hong et al., 2024) on chosen and rejected replies, without a
reference model.

Per pair, from each reply's mean token log-probability ``p`` (the log of its per-token probability), the log
odds ``log(p / (1 - p))`` of the chosen reply against the rejected one's:

    loss = NLL(chosen) - lambda * log sigmoid(log odds(chosen) - log odds(rejected))

``NLL(chosen)``: the chosen reply's mean token negative log-likelihood (the paper's SFT term, on the reply's
tokens); ``lambda``: ``--orpo-lambda`` (the paper's lambda, TRL's ``beta``, 0.1). Averaged over the step's
pairs. Logged: ``nll_chosen``, ``log_odds_ratio`` (the margin of log odds) and ``preference_accuracy`` (the
share of pairs whose chosen reply has the higher mean token log-probability).

This module is the guide's example of an objective plugin (docs/writing-plugins.md, "An objective plugin"): it
imports only ``vlft`` and declares an option of its own. The core reads the preference layouts, runs both rows
of a pair on one vision pass and averages over pairs (``vlft.PairedPreference``); the plugin writes one pair's
loss.

Imports inside functions: torch loads when a step runs, so listing the objectives stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlft import ObjectiveInfo, PairedPreference, Side, hookimpl, option, positive

NAME = "orpo"
DESCRIPTION = (
    "odds ratio preference optimisation: the chosen reply's NLL plus its odds over the rejected one's, no reference"
)


@dataclass(frozen=True)
class OrpoOptions:
    orpo_lambda: float = option(
        0.1,
        "weight of the odds-ratio term beside the chosen reply's NLL (the paper's lambda, TRL's beta)",
        check=positive,
    )


@dataclass(frozen=True)
class Orpo(PairedPreference):
    def pair_loss(self, chosen: Side, rejected: Side):
        import torch.nn.functional as F  # loaded when a step runs

        c, r = chosen.mean_logps, rejected.mean_logps
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        nll = -c
        losses = nll - self.options.orpo_lambda * F.logsigmoid(log_odds)
        return losses, {
            "nll_chosen": nll.detach(),
            "log_odds_ratio": log_odds.detach(),
            "preference_accuracy": (c > r).to(c.dtype),
        }


def log1mexp(x):
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (as TRL computes it)."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@hookimpl
def vlft_objectives():
    return [ObjectiveInfo(NAME, DESCRIPTION, OrpoOptions)]


@hookimpl
def vlft_objective(objective, options):
    if objective != NAME:
        return None
    return Orpo(NAME, DESCRIPTION, options=options, figures=("nll_chosen", "log_odds_ratio", "preference_accuracy"))
