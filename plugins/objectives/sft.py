"""sft: supervised fine-tuning, the next-token loss on the assistant replies.

The objective every run had before objectives were plugins: conversation records, one row each, the
cross-entropy summed over the replies' tokens and averaged over the step's label tokens (over every
micro-batch and process). Its ``Objective`` is the base class as it is, the core's own supervised path, so its
numbers are those of before, bit for bit.
"""

from __future__ import annotations

from vlft import Objective, ObjectiveInfo, hookimpl

NAME = "sft"
DESCRIPTION = "supervised fine-tuning: next-token cross-entropy on the assistant replies, averaged over their tokens"


@hookimpl
def vlft_objectives():
    return [ObjectiveInfo(NAME, DESCRIPTION)]


@hookimpl
def vlft_objective(objective):
    if objective != NAME:
        return None
    return Objective(NAME, DESCRIPTION)
