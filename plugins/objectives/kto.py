"""kto: Kahneman-Tversky optimisation (Ethayarajh et al., 2024) on unpaired replies, each marked desirable or
undesirable.

Each record is a prompt (with its images) and one reply (LLaMA-Factory's ``kto_tag``, TRL's ``label``). With
the log-ratio ``r`` of a reply (the policy's summed log-probability of its tokens minus the reference's: the
adapter off, or the ``--init-adapter`` weights) and a reference point ``z``, per record:

    desirable:    w_d (1 - sigmoid(beta (r - z)))
    undesirable:  w_u (1 - sigmoid(beta (z - r)))

averaged over the step's records (``--beta``, ``--desirable-weight``, ``--undesirable-weight``; TRL's names).
``z`` estimates the KL divergence of the policy from the reference as TRL's KTOTrainer does: over the
micro-batch's mismatched pairs (record i's prompt with record i-1's reply, the first with the last's), the mean
of their log-ratios, averaged over the data-parallel processes, clamped at 0, without gradients. So a
micro-batch needs at least 2 records (``--batch-size``).

Logged: ``kl`` (``z``, a mean over the records), ``reward_desirable`` and ``reward_undesirable`` (``beta r``,
means over the desirable and the undesirable records), ``logps_desirable`` and ``logps_undesirable`` (the
policy's), and ``desirable`` and ``undesirable`` (per step, the records of each). While the policy is the
reference, every reward is 0 and the loss is 0.5 (with both weights 1).

Imports inside functions: torch loads when a step runs, so listing the objectives stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlft import (
    OWN,
    PER_STEP,
    SHARED,
    Average,
    ConfigError,
    Layout,
    Objective,
    ObjectiveInfo,
    hookimpl,
    non_negative,
    option,
    positive,
)

NAME = "kto"
DESCRIPTION = (
    "Kahneman-Tversky optimisation: unpaired replies marked desirable or not, against a reference and "
    "the batch's KL estimate"
)
FIGURES = (
    "kl",
    "reward_desirable",
    "reward_undesirable",
    "logps_desirable",
    "logps_undesirable",
    "desirable",
    "undesirable",
)
UNITS = {
    "reward_desirable": "desirable",
    "logps_desirable": "desirable",
    "reward_undesirable": "undesirable",
    "logps_undesirable": "undesirable",
    "desirable": PER_STEP,
    "undesirable": PER_STEP,
}


@dataclass(frozen=True)
class KtoOptions:
    beta: float = option(
        0.1, "how strongly the policy is held to the reference (the reward is beta x the log-ratio)", check=positive
    )
    desirable_weight: float = option(
        1.0, "weight of a desirable record's loss (raise it where desirable records are fewer)", check=non_negative
    )
    undesirable_weight: float = option(1.0, "weight of an undesirable record's loss", check=non_negative)


@dataclass(frozen=True)
class Kto(Objective):
    def loss(self, model, batch: dict, passes):
        """The reference's passes first, then the policy's KL pass (no gradients), then its trained pass."""
        import torch  # loaded when a step runs

        o, own = self.options, batch[OWN]
        mismatched = {**own["kl"], SHARED: batch[SHARED]}
        ref, _ = passes.reference_sequence_logps(batch)
        ref_kl, _ = passes.reference_sequence_logps(mismatched)
        with torch.no_grad():
            kl_logps, _ = passes.sequence_logps(model, mismatched)
        logps, _ = passes.sequence_logps(model, batch)
        z = _mean_over_processes((kl_logps - ref_kl).mean()).clamp(min=0)
        ratio = logps - ref
        desirable = own["desirable"]
        losses = torch.where(
            desirable,
            o.desirable_weight * (1 - torch.sigmoid(o.beta * (ratio - z))),
            o.undesirable_weight * (1 - torch.sigmoid(o.beta * (z - ratio))),
        )
        d = desirable.to(ratio.dtype)
        rewards, logps = o.beta * ratio.detach(), logps.detach()
        figures = {
            "kl": z * len(d),
            "reward_desirable": (rewards * d).sum(),
            "reward_undesirable": (rewards * (1 - d)).sum(),
            "logps_desirable": (logps * d).sum(),
            "logps_undesirable": (logps * (1 - d)).sum(),
            "desirable": d.sum(),
            "undesirable": (1 - d).sum(),
        }
        return losses.sum(), figures


def _mean_over_processes(value):
    """``value`` averaged over the data-parallel processes (each process's micro-batch mean, then their mean),
    as TRL's KTOTrainer and the paper's code (HALOs) take the KL point: every process then shifts its rewards by
    the same ``z``. Every process runs the same micro-batches in training and the same validation batches, so
    each reaches this collective alike."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


@hookimpl
def vlft_objectives():
    return [ObjectiveInfo(NAME, DESCRIPTION, KtoOptions)]


@hookimpl
def vlft_objective(objective, config, options):
    if objective != NAME:
        return None
    if config.batch_size < 2:
        raise ConfigError(
            f"--objective kto needs --batch-size 2 or more (got {config.batch_size}): its reference "
            f"point pairs each record's prompt with another record's reply in the micro-batch"
        )
    return Kto(
        NAME,
        DESCRIPTION,
        options=options,
        layout=Layout.UNPAIRED_PREFERENCES,
        rows_per_record=2,  # the record's row and its mismatched row (the KL estimate's)
        average_over=Average.RECORDS,
        figures=FIGURES,
        figure_units=UNITS,
        reference=True,
        dropout=False,  # TRL's default (disable_dropout): the trained pass computes what the reference's does
        demo_epochs=2,
        packing_refusal="a record's row and its mismatched row are scored row by row; packed rows are not built "
        "for them",
        notes=(
            "kto: each step runs the reference on the records' rows and their mismatched rows, the policy on "
            "the mismatched rows without gradients (the KL estimate), then the policy's trained pass",
        ),
    )
