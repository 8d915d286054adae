"""Evaluation: greedy generation on the validation split, and validation loss.

Scores: exact match (after trimming and collapsing white space) and, for
answers made of ``field: value`` pairs (``colour: red, defect: none``),
per-field accuracy and macro F1 over the values each field takes.
"""

from __future__ import annotations

import re
from collections import defaultdict
from contextlib import nullcontext

import torch

from .data import Record

from .encoding import Collator, SampleEncoder
from .sharding import root_gathered
from .train import autocast_context, label_count, model_inputs, to_device, token_loss_sum

FIELD = re.compile(r"^\s*([A-Za-z][\w \-]*?)\s*:\s*(.*?)\s*$")


def normalise(text: str) -> str:
    return " ".join(text.strip().split())


def parse_fields(text: str) -> dict[str, str]:
    """``"colour: red, defect: none"`` -> ``{"colour": "red", "defect": "none"}`` ({} when not in that form)."""
    out: dict[str, str] = {}
    for part in re.split(r"[,\n;]", text):
        if not part.strip():
            continue
        m = FIELD.match(part)
        if not m:
            return {}
        out[m.group(1).strip().lower()] = m.group(2).strip().lower()
    return out


def macro_f1(pairs: list[tuple[str | None, str]]) -> float:
    """Macro F1 over the reference values; a missing prediction counts as wrong."""
    labels = sorted({ref for _, ref in pairs})
    scores = []
    for label in labels:
        tp = sum(1 for p, r in pairs if p == label and r == label)
        fp = sum(1 for p, r in pairs if p == label and r != label)
        fn = sum(1 for p, r in pairs if p != label and r == label)
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores) if scores else 0.0


def score(predictions: list[str], references: list[str]) -> dict:
    n = len(references)
    exact = sum(normalise(p) == normalise(r) for p, r in zip(predictions, references))
    fields: dict[str, list[tuple[str | None, str]]] = defaultdict(list)
    for pred, ref in zip(predictions, references):
        ref_fields = parse_fields(ref)
        pred_fields = parse_fields(pred)
        for name, value in ref_fields.items():
            fields[name].append((pred_fields.get(name), value))
    return {
        "samples": n,
        "exact_match": exact / n if n else 0.0,
        "fields": {
            name: {"accuracy": sum(p == r for p, r in pairs) / len(pairs), "f1": macro_f1(pairs)}
            for name, pairs in sorted(fields.items())
        },
    }


@torch.no_grad()
def generate_answers(model, encoder: SampleEncoder, records: list[Record], device, batch_size: int = 16,
                     max_new_tokens: int = 32, autocast_dtype=None, sampling: dict | None = None,
                     on_batch=None, synced: bool = False) -> list[str]:
    """Answers to ``records`` (greedy unless ``sampling`` holds ``generate`` options such as
    ``temperature``/``top_p``); ``on_batch(n)`` is told after each batch of ``n``. ``synced``: the model is
    sharded, so every process keeps taking decoding steps until all are done (``synced_gpus``)."""
    tokenizer = encoder.tokenizer
    collate = Collator(tokenizer.pad_token_id, encoder.processor.image_token_id, padding_side="left",
                       video_token_id=getattr(encoder.processor, "video_token_id", None))
    was_training = model.training
    model.eval()
    answers: list[str] = []
    with root_gathered(model) if synced else nullcontext():
        for i in range(0, len(records), batch_size):
            chunk = records[i:i + batch_size]
            batch = to_device(collate([encoder.encode_prompt(r) for r in chunk]), device)
            with autocast_context(device, autocast_dtype):
                out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     synced_gpus=synced,
                                     **(dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)))
            answers += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            if on_batch is not None:
                on_batch(len(chunk))
    model.train(was_training)
    return [a.strip() for a in answers]


def evaluate_generation(model, encoder, records, device, max_new_tokens=32, autocast_dtype=None,
                        rank: int = 0, world_size: int = 1, synced: bool = False) -> dict:
    """Score greedy answers on ``records``; with several processes each does a share and rank 0 gathers.

    ``synced`` (a sharded model, whose every forward pass gathers weights from all processes): the shares
    are padded to the same length with repeats of a record, whose answers are dropped, and every process
    decodes until all are done, so all take the same number of forward passes. Slower than unsharded
    generation (each decoding step gathers every block), but the same answers."""
    mine = records[rank::world_size]
    n_mine = len(mine)
    if synced and records:
        mine += [records[0]] * (-(-len(records) // world_size) - n_mine)
    answers = generate_answers(model, encoder, mine, device, max_new_tokens=max_new_tokens,
                               autocast_dtype=autocast_dtype, synced=synced)[:n_mine]
    pairs = list(zip(range(rank, len(records), world_size), answers))
    if world_size > 1:
        gathered: list = [None] * world_size
        torch.distributed.all_gather_object(gathered, pairs)
        pairs = sorted(p for part in gathered for p in part)
    predictions = [a for _, a in pairs]
    references = [records[i].reference for i, _ in pairs]
    result = score(predictions, references)
    result["examples"] = [
        {"where": records[i].where, "reference": records[i].reference, "prediction": a} for i, a in pairs[:5]
    ]
    return result


@torch.no_grad()
def validation_loss(model, loader_batches: list[dict], device, autocast_dtype=None) -> float:
    """Mean token loss over fixed validation batches."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for host_batch in loader_batches:
        tokens += label_count(host_batch)
        batch = to_device(host_batch, device)
        with autocast_context(device, autocast_dtype):
            logits = model(**model_inputs(batch)).logits
        total += float(token_loss_sum(logits, batch["labels"]))
    model.train(was_training)
    return total / max(tokens, 1)


def format_table(before: dict | None, after: dict) -> str:
    """A short before/after table for the terminal."""
    rows = [("exact match", "exact_match", None)]
    for name in after.get("fields", {}):
        rows.append((f"{name} accuracy", name, "accuracy"))
        rows.append((f"{name} F1", name, "f1"))

    def value(result, key, sub):
        if result is None:
            return "-"
        if sub is None:
            return f"{result[key]:.1%}"
        f = result.get("fields", {}).get(key)
        return f"{f[sub]:.1%}" if f else "-"

    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric'.ljust(width)}  {'before':>8}  {'after':>8}", "-" * (width + 20)]
    for label, key, sub in rows:
        lines.append(f"{label.ljust(width)}  {value(before, key, sub):>8}  {value(after, key, sub):>8}")
    lines.append(f"({after['samples']} validation samples, greedy decoding)")
    return "\n".join(lines)
