"""An objective's rollout trained on over several steps (``Objective.iterations``: GRPO's ``--num-iterations``).

The first step of a rollout samples and scores its prompts; the next ``iterations - 1`` steps, which the data
order gives the same prompts (``DataOrder.repeat``), train on the batches it kept, as TRL's GRPOTrainer
reuses its ``_buffered_inputs``. What the loss needs of the sampling policy (GRPO's old log-probabilities)
it keeps on those batches itself, on their first pass.

The kept batches are not checkpointed: a run resumed inside a rollout has none, and samples that rollout's
prompts afresh for the steps it has left (TRL does the same: its buffer is None after a resume). Saving them
would mean every process's completions, images and log-probabilities in the checkpoint, which rank 0 writes
alone; instead a checkpoint at a rollout's end (a step that is a multiple of ``iterations``) holds no
rollout, and resuming from it continues exactly as the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable


class KeptRollout:
    """``StepPolicy.rollout`` for an objective whose rollouts are trained on ``iterations`` steps: the wrapped
    rollout runs on a rollout's first step (the step count a multiple of ``iterations``) or when nothing is
    kept (a run resumed inside a rollout); the other steps get its batches and units again."""

    def __init__(self, rollout: Callable[..., tuple[list[dict], int]], iterations: int, start_step: int):
        self.rollout, self.iterations, self.step = rollout, iterations, start_step
        self.kept: tuple[list[dict], int] | None = None

    def __call__(self, model, host_batches: list[dict], device, autocast) -> tuple[list[dict], int]:
        if self.kept is None or self.step % self.iterations == 0:
            self.kept = None  # the last rollout's tensors freed before the next one is sampled
            self.kept = self.rollout(model, host_batches, device, autocast)
        self.step += 1
        return self.kept
