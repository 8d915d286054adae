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

Imports inside functions: the core's preference data, pairs, loss and torch load when a run is planned or
steps, so listing the objectives (``vlft objectives``, ``vlft plugins``) stays light.
"""

from __future__ import annotations

from functools import partial

from vlft import ConfigError, Objective, ObjectiveInfo, hookimpl

NAME = "dpo"
DESCRIPTION = ("direct preference optimisation: the chosen reply over the rejected one, against a reference (the "
               "adapter off, or the --init-adapter weights)")
FIGURES = ("reward_chosen", "reward_rejected", "reward_margin", "preference_accuracy", "logps_chosen",
           "logps_rejected")
HELP = {
    "beta": "--beta: how strongly the policy is held to the reference (the reward is beta x the log-ratio)",
    "loss": "--dpo-loss: sigmoid, ipo or hinge",
    "label_smoothing": "--label-smoothing: sigmoid only, the share of pairs taken as mislabelled (cDPO)",
    "rpo_alpha": "--rpo-alpha: weight of the chosen reply's mean token NLL added to each pair's loss (RPO)",
}
LAYOUT = ("preferences: a prompt and its images with a chosen and a rejected reply (LLaMA-Factory: "
          "conversations/messages + chosen + rejected + images; TRL: prompt + chosen + rejected + images)")


@hookimpl
def vlft_objectives():
    return [ObjectiveInfo(NAME, DESCRIPTION)]


@hookimpl
def vlft_objective(objective, config):
    if objective != NAME:
        return None
    beta = 0.1 if config.beta is None else config.beta  # --beta's DPO default
    if beta <= 0:
        raise ConfigError(f"--beta must be positive for dpo (the margin is scaled by it), got {beta}")
    if config.label_smoothing and config.dpo_loss != "sigmoid":
        raise ConfigError(f"--label-smoothing applies to --dpo-loss sigmoid (conservative DPO); {config.dpo_loss} "
                          f"takes none")
    # the core's preference data and pairs (imported here, when a run is planned: the module stays light)
    from vlft.data.pairs import PairCollator, PairEncoder
    from vlft.data.preferences import parse_preference

    reference = ("the adapter as --init-adapter loaded it (kept frozen)" if config.init_adapter
                 else "the base model (the adapter switched off)")
    return Objective(
        NAME, DESCRIPTION, layout=LAYOUT, help=HELP,
        options={"beta": beta, "loss": config.dpo_loss, "label_smoothing": config.label_smoothing,
                 "rpo_alpha": config.rpo_alpha},
        parse=parse_preference, encoder=PairEncoder, collate=PairCollator, rows_per_record=2,
        average_over="records", figures=FIGURES + (("nll_chosen",) if config.rpo_alpha else ()),
        reference=reference,
        dropout=False,  # TRL's DPOConfig default (disable_dropout): the policy pass computes what the reference's does
        loss=partial(dpo_loss, beta=beta, kind=config.dpo_loss, smoothing=config.label_smoothing,
                     rpo_alpha=config.rpo_alpha),
        demo_data=_demo, demo_epochs=2,
        packing_refusal="the chosen and rejected rows of a pair are scored row by row; packed rows are not "
                        "built for them",
        sharding_refusal="the reference pass switches the adapter off (or swaps in the --init-adapter weights) "
                         "and the shared vision pass calls the vision tower outside the sharded root's forward; "
                         "neither is built for FSDP's sharded parameters yet (data parallel works: leave out "
                         "--shard)",
        notes=("each image is encoded once per pass: one vision pass feeds the chosen and the rejected row "
               "(where the model takes precomputed features), once for the policy and once for the reference",),
    )


def _demo(folder):
    """The demo task as preference pairs: chosen the right answer, rejected a wrong colour or defect."""
    from vlft.data.demo import write_demo_preferences  # the core's data floor, loaded when a run needs it

    ds = write_demo_preferences(folder)
    return ds.train, ds.val


def dpo_loss(model, batch, autocast, reference, *, beta: float, kind: str, smoothing: float, rpo_alpha: float = 0.0):
    """(the pairs' summed loss, {figure: sum over the pairs}) for a batch of pairs on the device: the B chosen
    rows, then the B rejected rows (``data.pairs``)."""
    import torch  # the step runs torch already; the plugin module itself stays light
    import torch.nn.functional as F

    from vlft.models.loss import sequence_logps
    from vlft.models.rows import row_inputs

    n = batch["input_ids"].shape[0] // 2
    with reference() as ref:
        with autocast:
            ref_inputs = row_inputs(ref, batch, 2)
        ref_logps, _ = sequence_logps(ref, ref_inputs, batch, autocast)
    with autocast:
        inputs = row_inputs(model, batch, 2)
    logps, tokens = sequence_logps(model, inputs, batch, autocast)
    chosen, rejected = logps[:n] - ref_logps[:n], logps[n:] - ref_logps[n:]
    if kind == "ipo":
        margin = chosen / tokens[:n].clamp(min=1) - rejected / tokens[n:].clamp(min=1)
        losses = (margin - 1 / (2 * beta)) ** 2
    elif kind == "hinge":
        losses = torch.relu(1 - beta * (chosen - rejected))
    else:
        margin = beta * (chosen - rejected)
        losses = -(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)
    reward_c, reward_r = beta * chosen.detach(), beta * rejected.detach()
    figures = {"reward_chosen": reward_c.sum(), "reward_rejected": reward_r.sum(),
               "reward_margin": (reward_c - reward_r).sum(),
               "preference_accuracy": (reward_c > reward_r).to(reward_c.dtype).sum(),
               "logps_chosen": logps[:n].detach().sum(), "logps_rejected": logps[n:].detach().sum()}
    if rpo_alpha:
        nll = -logps[:n] / tokens[:n].clamp(min=1)
        losses = losses + rpo_alpha * nll
        figures["nll_chosen"] = nll.detach().sum()
    return losses.sum(), figures
