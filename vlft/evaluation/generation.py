"""Greedy generation on validation records, and its scores (the chosen scorers: ``vlft.planning.scorers``).

Under ``--shard fsdp`` every forward pass gathers every block, so every
process takes the same number of passes: the shares are padded to one length
and generation runs with ``synced_gpus``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from vlft.data.batching import collator_for, to_device
from vlft.data.encoding import SampleEncoder
from vlft.data.records import Record
from vlft.evaluation.scoring import score
from vlft.models.loss import autocast_context
from vlft.planning.scorers import scoring_context
from vlft.training.fsdp import root_gathered


@dataclass(frozen=True)
class Decoding:
    """How answers are generated: greedy unless ``sampling`` holds ``generate`` options such as
    ``temperature``/``top_p``. ``synced``: the model is sharded, so every process keeps taking decoding steps
    until all are done (``synced_gpus``)."""

    max_new_tokens: int = 32
    batch_size: int = 16
    autocast_dtype: torch.dtype | None = None
    sampling: dict | None = None
    synced: bool = False


@torch.no_grad()
def generate_answers(
    model, encoder: SampleEncoder, records: list[Record], device, decoding: Decoding = Decoding(), on_batch=None
) -> list[str]:
    """Answers to ``records``, as ``decoding`` says; ``on_batch(n)`` is told after each batch of ``n``."""
    batch_size, max_new_tokens, sampling, synced = (
        decoding.batch_size,
        decoding.max_new_tokens,
        decoding.sampling,
        decoding.synced,
    )
    tokenizer = encoder.tokenizer
    collate = collator_for(encoder.processor, encoder.family, padding_side="left")
    was_training = model.training
    model.eval()
    answers: list[str] = []
    with root_gathered(model) if synced else nullcontext():
        for i in range(0, len(records), batch_size):
            chunk = records[i : i + batch_size]
            batch = to_device(collate([encoder.encode_prompt(r) for r in chunk]), device)
            with autocast_context(device, decoding.autocast_dtype):
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    synced_gpus=synced,
                    **(dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)),
                )
            answers += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            if on_batch is not None:
                on_batch(len(chunk))
    model.train(was_training)
    return [a.strip() for a in answers]


def evaluate_generation(
    model,
    encoder,
    records,
    device,
    decoding: Decoding = Decoding(),
    share: tuple[int, int] = (0, 1),
    on_batch=None,
    *,
    scorers: list,
) -> dict:
    """Score greedy answers on ``records``; with several processes (``share``: this one's rank and their
    number) each does a share and rank 0 gathers. ``on_batch(n)`` is told after each batch of ``n`` answers (a
    progress bar). ``scorers``: ``[(label, Scorer)]`` as ``choose_scorers`` chose them (at plan time, from the
    run's plugins).

    ``decoding.synced`` (a sharded model, whose every forward pass gathers weights from all processes): the
    shares are padded to the same length with repeats of a record, whose answers are dropped, and every process
    decodes until all are done, so all take the same number of forward passes. Slower than unsharded
    generation (each decoding step gathers every block), but the same answers."""
    rank, world_size = share
    mine = list(records[rank::world_size])  # this process's share, built (columnar rows: data.lazy)
    n_mine = len(mine)
    if decoding.synced and records:
        mine += [records[0]] * (-(-len(records) // world_size) - n_mine)
    answers = generate_answers(model, encoder, mine, device, decoding, on_batch=on_batch)[:n_mine]
    pairs = list(zip(range(rank, len(records), world_size), answers))
    if world_size > 1:
        gathered: list = [None] * world_size
        torch.distributed.all_gather_object(gathered, pairs)
        pairs = sorted(p for part in gathered for p in part)
    predictions = [a for _, a in pairs]
    scored = [records[i] for i, _ in pairs]
    references = [r.reference for r in scored]
    context = scoring_context(scored, getattr(encoder, "family", None))
    result = score(predictions, references, scorers, **context)
    result["examples"] = [
        {"where": records[i].where, "reference": records[i].reference, "prediction": a} for i, a in pairs[:5]
    ]
    return result
