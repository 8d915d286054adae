"""Training pieces as a run builds them: optimizer and scheduler, step policy, and a ``Trainer`` that takes one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bench.support.env import BenchEnv


def optimizer_for(model, lr: float = 1e-4):
    from vlft.training.step import cosine_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    return optimizer, cosine_with_warmup(optimizer, 0, 1_000_000)


def step_policy(env: BenchEnv, scaler=None, as_on_a_device: bool = False):
    """The step policy a run on ``env`` resolves; ``as_on_a_device``: the accelerator's (the non-finite flag
    stays on the device), for counting the syncs a step would make there."""
    from vlft.training.step import StepPolicy

    if scaler is None and env.precision.loss_scaling:
        scaler = env.precision.make_scaler()
    return StepPolicy(
        env.device,
        env.autocast_dtype,
        scaler,
        max_grad_norm=1.0,
        grad_accum=1,
        world_size=1,
        flags_on_host=env.device.type == "cpu" and not as_on_a_device,
    )


@dataclass
class Trainer:
    """A model, its optimizer and scheduler, and one ``vlft.train.train_step`` on a batch."""

    model: Any
    optimizer: Any
    scheduler: Any
    policy: Any

    def step(self, host_batch: dict, device_batch: dict):
        from vlft.data.batching import label_count

        # as in vlft.training.trainer.Trainer.train_step: labels counted on the host, before the batch moved
        return self.step_counted(label_count(host_batch), device_batch)

    def step_counted(self, local_tokens: int, device_batch: dict):
        from vlft.training.step import train_step

        return train_step(self.model, self.optimizer, self.scheduler, [device_batch], self.policy, local_tokens)

    def host_state(self) -> list:
        """Optimizer state that stays on the host on every backend (AdamW's step counters)."""
        return [
            s["step"]
            for s in self.optimizer.state.values()
            if isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "cpu"
        ]


def trainer(env: BenchEnv, model, as_on_a_device: bool = False) -> Trainer:
    model.train()
    optimizer, scheduler = optimizer_for(model)
    return Trainer(model, optimizer, scheduler, step_policy(env, as_on_a_device=as_on_a_device))
