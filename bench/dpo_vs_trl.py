"""Seconds per step: vlft's DPO against vlft's SFT and TRL's DPOTrainer, on the embedded model.

    python bench/dpo_vs_trl.py [--steps 20] [--rounds 3] [--threads N]

The demo task (its preference pairs for DPO, its conversations for SFT), LoRA r 32 on text attention and the
last 6 vision blocks, batch 4 (pairs for DPO), fp32 on the CPU. Each timed step includes its data: vlft's
sampler encodes the records and collates them (images processed once per pair), TRL's collator renders the
template and processes the images of every row. The three are timed in turns, ``--rounds`` times, so a busy
machine slows each alike; the figures are the median per step of each. TRL (trl 1.16, not a vlft dependency)
must be installed: ``pip install trl -c constraints`` with the project's torch and transformers pinned.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/<this>.py`
    sys.path.insert(1, str(REPO))

from bench.support.versus import interleaved, options, trl_messages, trl_model  # noqa: E402 - after the repository is on the path


def vlft_stepper(objective: str, data, registry):
    """A function taking ``n`` steps of a prepared vlft run (data included)."""
    from vlft.config import build_config
    from vlft.training.trainer import build_trainer

    train, val = data
    config = build_config(
        {},
        dict(
            backend="cpu",
            objective=objective,
            data=str(train),
            val_data=str(val),
            output=tempfile.mkdtemp(),
            steps=100_000,
            batch_size=4,
        ),
    )
    s = build_trainer(registry, config)
    groups = s.batches()

    def steps(n: int) -> None:
        for _ in range(n):
            s.train_step(next(groups))

    return steps


def trl_stepper(pairs, registry, folder: Path):
    """A function taking ``n`` steps of TRL's DPOTrainer on the same pairs, model and LoRA."""
    from datasets import Dataset
    from PIL import Image
    from trl import DPOConfig, DPOTrainer

    from vlft.data.layouts import record_format
    from vlft.data.records import read_records

    plan, model = trl_model(registry, "dpo", pairs, batch_size=4)

    rows = [
        {
            "images": [Image.open(r.images[0]).convert("RGB")],
            "prompt": trl_messages(r.turns[:-1]),
            "chosen": trl_messages(r.turns[-1:]),
            "rejected": trl_messages(r.rejected[-1:]),
        }
        for r in read_records(pairs[0], parse=record_format(plan.objective.layout).parse)
    ]
    args = DPOConfig(
        output_dir=str(folder / "trl"),
        per_device_train_batch_size=4,
        max_steps=100_000,
        learning_rate=plan.lr,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_steps=1_000_000,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=plan.processor)
    trainer.create_optimizer_and_scheduler(num_training_steps=100_000)
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
    model.train()

    def epochs():
        while True:  # epoch after epoch, as vlft's sampler goes on
            yield from trainer.get_train_dataloader()

    loader = epochs()

    def steps(n: int) -> None:
        for _ in range(n):
            trainer.training_step(model, next(loader))
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            trainer.optimizer.zero_grad(set_to_none=True)

    return steps


def main(argv=None) -> int:
    opts = options(__doc__.splitlines()[0], 20, argv)
    import torch

    from vlft.data.demo import write_demo_preferences
    from vlft.registry import load_registry

    if opts.threads:
        torch.set_num_threads(opts.threads)
    folder = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    ds = write_demo_preferences(folder / "demo", n_train=400, n_val=8, seed=0)
    registry = load_registry()
    runs = {
        "vlft sft": vlft_stepper("sft", (ds.root / "train.jsonl", ds.root / "val.jsonl"), registry),
        "vlft dpo": vlft_stepper("dpo", (ds.train, ds.val), registry),
    }
    try:
        runs["trl dpo"] = trl_stepper((ds.train, ds.val), registry, folder)
    except ImportError as e:
        print(f"trl not installed ({e}); timing vlft only", file=sys.stderr)
    times, _, median = interleaved(runs, opts.rounds, opts.steps)
    print(f"threads {torch.get_num_threads()}, {opts.rounds} rounds of {opts.steps} steps, batch 4")
    for name, t in times.items():
        print(f"{name:9} {median[name]:.4f} s/step (rounds: {', '.join(f'{x:.4f}' for x in t)})")
    print(f"dpo / sft (vlft): {median['vlft dpo'] / median['vlft sft']:.2f}")
    if "trl dpo" in median:
        print(f"vlft dpo / trl dpo: {median['vlft dpo'] / median['trl dpo']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
