"""An objective's prepared batches trained on over several steps (``Objective.iterations``: GRPO's
``--num-iterations``).

The first step of a rollout prepares its batches (GRPO: samples and scores its prompts, and takes the sampling
policy's log-probabilities on them); the next ``iterations - 1`` steps, which the data order gives the same
prompts (``DataOrder.repeat``), train on the batches it kept, as TRL's GRPOTrainer reuses its
``_buffered_inputs``. What preparing measured (``Prepared.figures``: the sampling time) is 0 on those steps,
which prepare nothing.

The kept batches are not checkpointed: a run resumed inside a rollout has none, and samples that rollout's
prompts afresh for the steps it has left (TRL does the same: its buffer is None after a resume). Saving them
would mean every process's completions, images and log-probabilities in the checkpoint, which rank 0 writes
alone; instead a checkpoint at a rollout's end (a step that is a multiple of ``iterations``) holds no
rollout, and resuming from it continues exactly as the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vlft.contracts.objective import Prepared


class KeptRollout:
    """``StepPolicy.prepare`` for an objective whose batches are trained on ``iterations`` steps: the
    objective's ``prepare`` runs on a rollout's first step (the step count a multiple of ``iterations``) or when
    nothing is kept (a run resumed inside a rollout); the other steps get its batches and units again."""

    def __init__(self, prepare: Callable[..., Prepared], iterations: int, start_step: int):
        self.prepare, self.iterations, self.step = prepare, iterations, start_step
        self.kept: Prepared | None = None

    def __call__(self, model, host_batches: list[dict], passes: Any) -> Prepared:
        if self.kept is None or self.step % self.iterations == 0:
            self.kept = None  # the last rollout's tensors freed before the next one is sampled
            self.kept = self.prepare(model, host_batches, passes)
            out = self.kept
        else:
            out = replace(self.kept, figures={k: v.new_zeros(()) for k, v in self.kept.figures.items()})
        self.step += 1
        return out
