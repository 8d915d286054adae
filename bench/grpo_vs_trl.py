"""Seconds per step: vlft's GRPO against TRL's GRPOTrainer on the embedded model, generation apart.

    python bench/grpo_vs_trl.py [--steps 10] [--rounds 3] [--threads N]

The demo task's conversations (the prompt up to the answer, which the ``fields`` reward reads), 4 prompts a
step x G=4 completions of at most 16 new tokens, temperature 1, beta 0.04, token-level normalisation (vlft's
``--grpo-norm token``, TRL's ``loss_type="dapo"``), LoRA r 32 on text attention and the last 6 vision blocks
from a fresh adapter, fp32 on the CPU. Each timed step includes its data and its sampling; the sampling
seconds are counted apart (vlft: ``generation_time_s``; TRL: its ``_generate`` timed from outside). The two are
timed in turns, ``--rounds`` times, so a busy machine slows both alike; the figures are the medians per step.
TRL (not a vlft dependency) must be installed: ``pip install trl -c constraints`` with the project's torch,
transformers, peft, accelerate and datasets pinned (trl 1.16 installs beside transformers 5.24).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/<this>.py`
    sys.path.insert(1, str(REPO))

from bench.support.versus import interleaved, options, trl_messages, trl_model  # noqa: E402 - after the repository is on the path

G, PROMPTS, NEW_TOKENS, BETA = 4, 4, 16, 0.04


def vlft_stepper(data, registry):
    """A function taking ``n`` steps of a prepared vlft GRPO run; returns the generation seconds among them."""
    from vlft.config import build_config
    from vlft.training.trainer import build_trainer

    train, val = data
    config = build_config(
        {},
        dict(
            backend="cpu",
            objective="grpo",
            data=str(train),
            val_data=str(val),
            output=tempfile.mkdtemp(),
            steps=100_000,
            batch_size=PROMPTS,
            max_new_tokens=NEW_TOKENS,
            objective_options=dict(num_generations=G, temperature=1.0, beta=BETA, reward=["fields"]),
        ),
    )
    s = build_trainer(registry, config)
    groups = s.batches()

    def steps(n: int) -> float:
        generating = 0.0
        for _ in range(n):
            out = s.train_step(next(groups))
            generating += float(out.figures["generation_time_s"])
        return generating

    return steps


def trl_stepper(data, registry, folder: Path):
    """A function taking ``n`` steps of TRL's GRPOTrainer on the same prompts, model, LoRA and reward."""
    from datasets import Dataset
    from PIL import Image
    from trl import GRPOConfig, GRPOTrainer

    from vlft.data.records import read_records
    from vlft_scorers.fields import fields_score  # the fields reward vlft GRPO uses (a scorer, seen as a reward)

    plan, model = trl_model(registry, "grpo", data, batch_size=PROMPTS)

    rows = [
        {
            "image": Image.open(r.images[0]).convert("RGB"),
            "prompt": trl_messages(r.turns[:-1]),
            "reference": r.reference,
        }
        for r in read_records(data[0])
    ]

    def fields(prompts, completions, reference, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return fields_score([t.strip() for t in texts], reference)

    args = GRPOConfig(
        output_dir=str(folder / "trl"),
        per_device_train_batch_size=PROMPTS * G,
        num_generations=G,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_k=0,
        beta=BETA,
        loss_type="dapo",
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
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[fields],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=plan.processor,
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=100_000)
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
    model.train()
    clock = {"s": 0.0}
    generate = trainer._generate

    def timed_generate(*a, **k):  # TRL's sampling (prompts to completion ids), timed apart
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            clock["s"] += time.perf_counter() - t0

    trainer._generate = timed_generate

    def epochs():
        while True:  # epoch after epoch, as vlft's sampler goes on
            yield from trainer.get_train_dataloader()

    loader = epochs()

    def steps(n: int) -> float:
        clock["s"] = 0.0
        for _ in range(n):
            trainer.training_step(model, next(loader), None)
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        return clock["s"]

    return steps


def main(argv=None) -> int:
    opts = options(__doc__.splitlines()[0], 10, argv)
    import torch

    from vlft.data.demo import write_demo_dataset
    from vlft.registry import load_registry

    if opts.threads:
        torch.set_num_threads(opts.threads)
    folder = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    ds = write_demo_dataset(folder / "demo", n_train=400, n_val=8, seed=0)
    registry = load_registry()
    runs = {"vlft grpo": vlft_stepper((ds.train, ds.val), registry)}
    try:
        runs["trl grpo"] = trl_stepper((ds.train, ds.val), registry, folder)
    except ImportError as e:
        print(f"trl not installed ({e}); timing vlft only", file=sys.stderr)
    times, generating, median = interleaved(runs, opts.rounds, opts.steps)
    print(
        f"threads {torch.get_num_threads()}, {opts.rounds} rounds of {opts.steps} steps, {PROMPTS} prompts x G={G}, "
        f"{NEW_TOKENS} new tokens"
    )
    for name, t in times.items():
        gen = statistics.median(generating[name])
        print(
            f"{name:9} {median[name]:.4f} s/step, generating {gen:.4f} ({gen / median[name]:.0%}), training "
            f"{median[name] - gen:.4f} (rounds: {', '.join(f'{x:.4f}' for x in t)})"
        )
    if "trl grpo" in median:
        print(f"vlft grpo / trl grpo: {median['vlft grpo'] / median['trl grpo']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
