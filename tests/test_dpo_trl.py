"""vlft's DPO against TRL's DPOTrainer (trl 1.16, installed beside the project for this comparison only: trl is
no dependency of vlft, and the module skips without it).

The same embedded model, the same LoRA (r 32, alpha 64, dropout 0, on text attention and the last 6 vision
blocks, initialised with the same seed), the same 4 preference pairs of the demo task as one batch, the same
AdamW (lr 1e-3, no decay, cosine without warm-up, clipping at 1.0), beta 0.1, fp32. TRL's collator renders the
template itself and counts the newline after each reply's end token as a reply token, which vlft never
trains (the replies end at the template's end token, as in SFT); so TRL is given vlft's batch, laid out as
its collator lays one out (chosen rows then rejected rows, the images repeated, ``completion_mask`` on the
reply tokens), and the loss, the gradients and the optimizer are TRL's own.

Tolerances come from float32 arithmetic: each log-probability is a sum of about 8 token terms of size ~7
(|error| <= 8 x 7 x 2^-24 ~ 3e-6 for each of the four sums of a pair), so the margin is within ~1e-5 and the
sigmoid loss, whose derivative in the margin is beta/2 = 0.05, within 5e-7; 1e-6 is allowed. The adapters
after three steps are compared as a whole: AdamW's step is lr x m / (sqrt(v) + 1e-8), about lr per element
whatever the gradient's size, so an element whose gradient is within float32 noise of 0 (LoRA A's at step 2,
with B still near 0) can move by up to lr differently in the two; the distance between the two adapters is
held under 1e-3 of the distance they travelled (measured: 2.9e-5 of 0.54, one element).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("VLFT_REQUIRE_TRL") != "1":
    pytest.importorskip(
        "trl", reason="trl is not importable here; `make test` runs this module again with it (.venv/trl-site)"
    )

LR, BETA, STEPS = 1e-3, 0.1, 3


def _trl_layout(host: dict) -> dict:
    """vlft's pair batch as TRL's vision collator lays one out."""
    shared = host["shared"]
    return {
        "input_ids": host["input_ids"],
        "attention_mask": host["attention_mask"],
        "mm_token_type_ids": host["mm_token_type_ids"],
        "completion_mask": (host["labels"] != -100).long(),
        "pixel_values": torch.cat([shared["pixel_values"]] * 2),
        "image_grid_thw": torch.cat([shared["image_grid_thw"]] * 2),
    }


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(vlft's session, TRL's trainer, the batch, vlft's and TRL's per-step losses, and the initial adapter)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from vlft.config import build_config
    from vlft.data.demo import write_demo_preferences
    from vlft.models.loading import load_model
    from vlft.registry import load_registry
    from vlft.training.step import seed_everything
    from vlft.training.trainer import build_trainer

    tmp = tmp_path_factory.mktemp("trl")
    ds = write_demo_preferences(tmp / "demo", n_train=8, n_val=4, seed=11)
    registry = load_registry()
    config = build_config(
        {},
        dict(
            backend="cpu",
            objective="dpo",
            data=str(ds.train),
            val_data=str(ds.val),
            output=str(tmp / "run"),
            steps=STEPS,
            batch_size=4,
            lr=LR,
            warmup_ratio=0.0,
            objective_options={"beta": BETA},
            adapter={"lora_dropout": 0.0},
            seed=0,
        ),
    )
    s = build_trainer(registry, config)
    initial = {n: p.detach().clone() for n, p in s.model.named_parameters() if p.requires_grad}
    host = s.collate([s.dataset[i] for i in range(4)])

    # TRL's model: the same base, the same adapter with the same seed (as vlft's session applies it)
    plan = s.plan
    base = load_model(plan.model_path, plan.attention, plan.precision, family=plan.family)
    seed_everything(config.seed)
    model = registry.first(
        "vlft_apply_adapter",
        method="lora",
        model=base,
        targets=plan.targets,
        config=config,
        target_parameters=[],
        family=plan.family,
    )
    theirs = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert theirs.keys() == initial.keys() and all(torch.equal(theirs[n], initial[n]) for n in initial)

    ours = []
    for _ in range(STEPS):
        out = s.train_step([host])
        ours.append(float(out.loss_sum) / 4)

    pairs = {int(i): s.dataset[int(i)] for i in range(4)}

    class Recording(DPOTrainer):
        losses: list = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(float(loss.detach()))
            return loss

    rows = Dataset.from_list([{"idx": i, "images": [], "prompt": "", "chosen": "", "rejected": ""} for i in range(4)])
    args = DPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=BETA,
        loss_type=["sigmoid"],
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        optim="adamw_torch",
        gradient_checkpointing=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    trainer = Recording(
        model=model,
        args=args,
        train_dataset=rows,
        processing_class=s.plan.processor,
        data_collator=lambda batch: _trl_layout(s.collate([pairs[r["idx"]] for r in batch])),
    )
    trainer.train()
    return s, trainer, host, ours, list(Recording.losses), initial


def test_the_first_steps_losses_and_the_trained_adapter_equal_trls(both):
    s, trainer, _, ours, theirs, initial = both
    assert len(theirs) == STEPS
    print(f"per-step loss, vlft {ours}, TRL {theirs}")
    # step 1: the fresh adapter (B = 0) is the reference in both, so both give ln 2
    assert ours[0] == pytest.approx(math.log(2), abs=1e-7) and theirs[0] == pytest.approx(math.log(2), abs=1e-7)
    # steps 2 and 3 follow from each one's gradients and AdamW
    assert ours == pytest.approx(theirs, abs=1e-6), (ours, theirs)
    assert ours[2] < ours[0]  # and they trained
    mine = dict(s.model.named_parameters())
    pairs = [
        (mine[n].detach(), p.detach(), initial[n])
        for n, p in trainer.model.named_parameters()
        if p.requires_grad and ".default." in n
    ]
    assert len(pairs) == len(initial)
    apart = torch.cat([(a - b).flatten() for a, b, _ in pairs])
    moved = torch.cat([(a - w0).flatten() for a, _, w0 in pairs])
    print(
        f"adapters after {STEPS} steps: moved {float(moved.norm()):.3e} (max {float(moved.abs().max()):.3e}), "
        f"apart {float(apart.norm()):.3e} (max {float(apart.abs().max()):.3e})"
    )
    assert float(apart.norm()) < 1e-3 * float(moved.norm())


def test_a_trained_adapters_loss_against_the_base_equals_trls(both):
    """Past step 1 the policy differs from the reference: the loss of the trained adapter (policy) against the
    base model (reference, the adapter off in vlft, TRL's frozen copy of the zero-initialised adapter) on the
    same batch, a margin far from 0."""
    from vlft.data.batching import to_device, with_label_positions
    from vlft.models.passes import StepPasses
    from vlft.models.reference import Reference

    s, trainer, host, _, _, _ = both
    batch = to_device(with_label_positions(host), s.device)
    with torch.no_grad():
        mine, figures = s.plan.objective.loss(s.model.eval(), batch, StepPasses(s.device, None, Reference(s.model)))
        theirs = trainer._compute_loss(trainer.model.eval(), _trl_layout(host), False)
    print(
        f"trained adapter against the base: vlft {float(mine) / 4:.9f}, TRL {float(theirs):.9f}, mean margin "
        f"{float(figures['reward_margin']) / 4:.4f}"
    )
    assert abs(float(figures["reward_margin"])) / 4 > 1e-3  # the margin is not 0: the loss is not ln 2
    assert float(mine) / 4 == pytest.approx(float(theirs), abs=1e-6)
