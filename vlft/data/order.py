"""The data order: every process's share of a seeded shuffle, epoch after epoch, resumable mid-epoch.

Every process shuffles with ``seed + epoch`` and takes every
``world_size``-th sample, so 2 processes of batch 4 see exactly the samples 1
process of batch 8 sees, and the memory plan can list in advance every batch
a run will draw.

With ``--group-by-length`` (``DataOrder.lengths``) the same shuffle is cut into windows of
``GROUP_SPAN`` global batches (``batch_size x world_size`` samples); each window is sorted by length and
cut into global batches, whose order is then shuffled with the same seed (the last, partial one stays
last). Each process still takes every ``world_size``-th sample, so within a global batch every process
draws samples of similar length: less padding, with the same guarantees (one shuffle shared by every
process, the global batches independent of how they are split over processes, resumable mid-epoch).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DataOrder:
    """What decides which samples each step draws: the sampler's settings (the loop's settings extend it)."""

    batch_size: int
    grad_accum: int
    seed: int
    rank: int = 0
    world_size: int = 1
    loader_kwargs: dict = field(default_factory=dict)  # the backend's DataLoader options (pin_memory, workers)
    # --group-by-length: each sample's length (tokens), which groups samples of similar length into batches
    lengths: Sequence[int] | None = None
    # consecutive steps that draw each group of batches: an objective that trains on one rollout over several
    # updates (GRPO's --num-iterations) draws its prompts once per rollout, so an epoch takes that many more steps
    repeat: int = 1


class EpochSampler(torch.utils.data.Sampler):
    """This process's share of a seeded shuffle, for one epoch, from a given offset.

    Every process shuffles with ``seed + epoch`` and takes every
    ``world_size``-th index, so 2 processes of batch 4 see exactly the
    samples one process of batch 8 sees. ``start`` skips samples already
    trained on, which is how ``--resume`` continues mid-epoch.
    """

    def __init__(
        self,
        n: int,
        seed: int,
        epoch: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        lengths: Sequence[int] | None = None,
        batch_size: int = 1,
    ):
        self.n, self.seed, self.epoch, self.rank, self.world_size, self.start = n, seed, epoch, rank, world_size, start
        self.lengths, self.batch_size = lengths, batch_size

    def order(self) -> np.ndarray:
        """This process's indices for the epoch, as an int64 array: a Python list would hold 36 bytes a sample
        (a pointer and an int object) for the whole epoch, more than a columnar set keeps per row."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)
        usable = self.n - self.n % self.world_size
        if self.lengths is not None:
            perm = torch.tensor(
                grouped_by_length(perm[:usable].tolist(), self.lengths, self.batch_size * self.world_size, g),
                dtype=torch.int64,
            )
        return perm[self.rank : usable : self.world_size][self.start :].numpy()

    def indices(self) -> list[int]:
        return self.order().tolist()

    def __iter__(self):
        return map(int, self.order())

    def __len__(self) -> int:
        usable = self.n - self.n % self.world_size
        return max(0, len(range(self.rank, usable, self.world_size)) - self.start)


GROUP_SPAN = 64  # global batches per window sorted by length: wider pads less, narrower mixes more


def grouped_by_length(order: list[int], lengths: Sequence[int], global_batch: int, generator) -> list[int]:
    """``order`` with samples of similar length brought together into global batches (see the module)."""
    span = global_batch * GROUP_SPAN
    full, partial = [], []
    for i in range(0, len(order), span):
        window = sorted(order[i : i + span], key=lambda j: -lengths[j])  # stable: ties keep the shuffle's order
        for k in range(0, len(window), global_batch):
            (full if len(window) - k >= global_batch else partial).append(window[k : k + global_batch])
    shuffled = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
    return [j for batch in shuffled + partial for j in batch]


def worker_init(worker_id: int) -> None:
    # DataLoader seeds torch per worker; give Python and NumPy the same stream
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def steps_per_epoch(n_samples: int, batch_size: int, grad_accum: int, world_size: int) -> int:
    per_rank = n_samples // world_size
    return max(1, per_rank // (batch_size * grad_accum))


def batches(dataset, collate, settings: DataOrder, start_step: int):
    """Yield lists of ``grad_accum`` micro-batches from ``start_step`` on, epoch after epoch: each group
    ``settings.repeat`` times in a row (the same list), a run resumed inside a group's repeats drawing it for
    the steps it has left."""
    group_index, drawn = divmod(start_step, settings.repeat)
    for group in _groups(dataset, collate, settings, group_index):
        for _ in range(settings.repeat - drawn):
            yield group
        drawn = 0


def _groups(dataset, collate, settings: DataOrder, start_group: int):
    """Lists of ``grad_accum`` micro-batches from the ``start_group``-th on, epoch after epoch."""
    per_epoch = steps_per_epoch(len(dataset), settings.batch_size, settings.grad_accum, settings.world_size)
    epoch, step_in_epoch = divmod(start_group, per_epoch)
    micro = settings.batch_size
    # fewer samples per process than one step: keep the incomplete batch, or an epoch would yield nothing
    short = len(dataset) // settings.world_size < micro * settings.grad_accum
    while True:
        sampler = EpochSampler(
            len(dataset),
            settings.seed,
            epoch,
            settings.rank,
            settings.world_size,
            start=step_in_epoch * micro * settings.grad_accum,
            lengths=settings.lengths,
            batch_size=micro,
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=micro,
            sampler=sampler,
            collate_fn=collate,
            drop_last=not short,
            worker_init_fn=worker_init,
            generator=torch.Generator().manual_seed(settings.seed + epoch),
            **settings.loader_kwargs,
        )
        group: list[dict] = []
        for batch in loader:
            group.append(batch)
            if len(group) == settings.grad_accum:
                yield group
                group = []
                step_in_epoch += 1
                if step_in_epoch >= per_epoch:
                    break
        if short and group and step_in_epoch < per_epoch:
            yield group  # the whole (small) epoch as one step of fewer samples
            step_in_epoch += 1
        if step_in_epoch == 0:
            raise RuntimeError(
                f"an epoch of {len(dataset)} samples gave no batch (batch {micro} x accumulation "
                f"{settings.grad_accum} x {settings.world_size} processes)"
            )
        epoch += 1
        step_in_epoch = 0


DEFAULT_EPOCHS = 3


def total_steps_for(
    n_samples: int,
    steps: int | None,
    epochs: float | None,
    batch_size: int,
    grad_accum: int,
    world_size: int,
    repeat: int = 1,
) -> int:
    """``steps``, or the steps of ``epochs`` passes (each group of batches drawn for ``repeat`` steps)."""
    if steps is not None:
        return steps
    per_epoch = steps_per_epoch(n_samples, batch_size, grad_accum, world_size) * repeat
    return max(1, math.ceil(per_epoch * (epochs if epochs is not None else DEFAULT_EPOCHS)))


def step_indices(n_samples: int, settings: DataOrder, step: int) -> list[int]:
    """The dataset indices this process trained on in optimizer step ``step`` (1-based): the same order
    ``batches`` draws, recomputed on the host so naming a batch needs nothing from the device."""
    per_epoch = steps_per_epoch(n_samples, settings.batch_size, settings.grad_accum, settings.world_size)
    epoch, step_in_epoch = divmod((step - 1) // settings.repeat, per_epoch)
    span = settings.batch_size * settings.grad_accum
    order = EpochSampler(
        n_samples,
        settings.seed,
        epoch,
        settings.rank,
        settings.world_size,
        lengths=settings.lengths,
        batch_size=settings.batch_size,
    ).indices()
    return order[step_in_epoch * span : (step_in_epoch + 1) * span]


def run_micro_batches(n_samples: int, settings: DataOrder, total_steps: int, max_epochs: int = 64):
    """Every micro-batch (sample indices) every process draws in a run of ``total_steps``, epoch by epoch (at
    most ``max_epochs``: beyond a few no new batch shapes appear). The sampler is seeded, so this is what the
    run will draw; for planning (memory, packing) before the first step. A group of batches trained on for
    several steps (``settings.repeat``) is drawn once."""
    per_epoch = steps_per_epoch(n_samples, settings.batch_size, settings.grad_accum, settings.world_size)
    groups = math.ceil(total_steps / settings.repeat)
    for epoch in range(min(math.ceil(groups / per_epoch), max_epochs)):
        for rank in range(settings.world_size):
            order = EpochSampler(
                n_samples,
                settings.seed,
                epoch,
                rank,
                settings.world_size,
                lengths=settings.lengths,
                batch_size=settings.batch_size,
            ).indices()
            usable = min(len(order) // settings.batch_size, per_epoch * settings.grad_accum) * settings.batch_size
            for i in range(0, usable, settings.batch_size):
                yield order[i : i + settings.batch_size]
