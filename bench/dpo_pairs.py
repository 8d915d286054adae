"""DPO on held-back pairs: which validation pairs a trained adapter gets wrong, and why.

Issue 41 measured DPO's validation preference accuracy at 0.72-0.78 on pairs whose rejected answer has its
colour or its defect changed at random (LLaMA-Factory's layout, 1,600 pairs, two epochs at the defaults),
against 0.90 on the built-in demo pairs (``vlft.data.demo.write_demo_preferences``: the colour changed on even
records, the defect on odd ones). Two commands:

    python bench/dpo_pairs.py pairs DEMO_DIR
        the demo data set in DEMO_DIR (written if missing), its built-in pairs, and ``random-train.jsonl`` /
        ``random-val.jsonl``: the same records, each rejected answer's field (colour or defect) and its
        wrong value drawn at random;
    python bench/dpo_pairs.py margins ADAPTER_DIR PAIRS.jsonl [PAIRS.jsonl ...]
        each pair's DPO margin (the chosen reply's log-ratio minus the rejected one's; the policy is the
        adapter, a run's ``adapter/`` or a checkpoint's, the reference the base model, as in the run), and the
        preference accuracy (margin > 0) by what the rejected answer changed: the field, the right and the
        wrong value, the product's colour.

``docs/preference-training.md`` ("Held-back pairs") reports what these gave.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections import defaultdict
from pathlib import Path

from vlft.data.demo import COLOURS, write_demo_preferences, wrong_answer

BATCH = 8


def write_random_pairs(root: Path, seed: int = 2) -> None:
    """``random-{train,val}.jsonl`` beside the demo data: each record's rejected answer with its colour or its
    defect (drawn at random) changed to another value (drawn at random)."""
    ds = write_demo_preferences(root)
    rng = random.Random(seed)
    for split in ("train", "val"):
        lines = []
        for line in (ds.root / f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            *prompt, reply = rec["conversations"]
            rejected = wrong_answer(reply["value"], rng, rng.choice(("colour", "defect")))
            lines.append(
                json.dumps(
                    {
                        "id": rec["id"],
                        "images": [rec["image"]],
                        "conversations": prompt,
                        "chosen": reply,
                        "rejected": {"from": reply["from"], "value": rejected},
                    }
                )
            )
        (ds.root / f"random-{split}.jsonl").write_text("".join(x + "\n" for x in lines), encoding="utf-8")


def fields(answer: str) -> dict[str, str]:
    return dict(part.split(": ", 1) for part in answer.split(", "))


def colour_distance(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(COLOURS[a], COLOURS[b])) ** 0.5


def pair_margins(adapter: Path, pairs: Path) -> list[tuple[dict, float]]:
    """(each pair's record, its margin) under ``adapter`` against the base model, in evaluation mode."""
    import torch

    from vlft.config import build_config
    from vlft.models.passes import StepPasses
    from vlft.models.reference import Reference
    from vlft.registry import load_registry
    from vlft.training.trainer import build_trainer

    config = build_config(
        {},
        dict(
            backend="cpu",
            objective="dpo",
            data=str(pairs),
            val_data=str(pairs),
            output=tempfile.mkdtemp(prefix="dpo-margins-"),
            steps=1,
            batch_size=BATCH,
            init_adapter=str(adapter),
        ),
    )
    trainer = build_trainer(load_registry(), config, progress=False)
    passes = StepPasses(trainer.device, None, Reference(trainer.model))  # the adapter off: the run's reference
    plan, model = trainer.plan, trainer.model
    lines = pairs.read_text(encoding="utf-8").splitlines()
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(plan.val_records), BATCH):
            chunk = plan.val_records[i : i + BATCH]
            batch = passes.to_device(trainer.collate([plan.encoder.encode(r) for r in chunk]))
            ref, _ = passes.reference_sequence_logps(batch, 2)
            logps, _ = passes.sequence_logps(model, batch, 2)
            n = len(chunk)
            margins = (logps[:n] - ref[:n]) - (logps[n:] - ref[n:])
            for r, m in zip(chunk, margins.tolist()):
                out.append((json.loads(lines[int(r.where.rsplit(":", 1)[1]) - 1]), m))
    return out


def groups_of(rec: dict) -> list[str]:
    chosen, rejected = fields(rec["chosen"]["value"]), fields(rec["rejected"]["value"])
    changed = "colour" if chosen["colour"] != rejected["colour"] else "defect"
    right, wrong = chosen[changed], rejected[changed]
    keys = [
        "all",
        f"changed={changed}",
        f"changed={changed} product={chosen['colour']}",
        f"changed={changed} right={right}",
        f"changed={changed} wrong={wrong}",
        f"changed={changed} {right}->{wrong}",
    ]
    if changed == "colour":
        keys.append(f"changed=colour distance={'near' if colour_distance(right, wrong) < 200 else 'far'}")
    return keys


def report(results: list[tuple[dict, float]], first: int = 100) -> None:
    groups: dict[str, list[float]] = defaultdict(list)
    for rec, m in results:
        for key in groups_of(rec):
            groups[key].append(m)
    head = [m for _, m in results[:first]]
    print(f"first {len(head)} pairs (what --eval-batches 25 x 4 evaluates): {sum(m > 0 for m in head) / len(head):.3f}")
    print(f"{'group':44s} {'accuracy':>8s} {'n':>4s} {'mean margin':>11s}")
    for key in sorted(groups):
        ms = groups[key]
        print(f"{key:44s} {sum(m > 0 for m in ms) / len(ms):8.3f} {len(ms):4d} {sum(ms) / len(ms):11.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pairs")
    p.add_argument("root", type=Path)
    m = sub.add_parser("margins")
    m.add_argument("adapter", type=Path)
    m.add_argument("pairs", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "pairs":
        write_random_pairs(args.root)
        print("written", args.root)
        return
    for pairs in args.pairs:
        print(f"== {args.adapter} on {pairs}")
        report(pair_margins(args.adapter, pairs))


if __name__ == "__main__":
    main()
