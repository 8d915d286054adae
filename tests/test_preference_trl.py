"""vlft's SimPO, ORPO and KTO losses against TRL 1.16's (installed beside the project for these comparisons
only: trl is no dependency of vlft, and the module skips without it). TRL 1.16 keeps ORPOTrainer and
CPOTrainer (SimPO is its ``loss_type="simpo"``) in ``trl.experimental``; KTOTrainer is in ``trl`` itself.

One KTO session on the demo task's unpaired records gives the model; its adapter is moved off zero by seeded
noise (at a fresh LoRA the policy equals the reference, and KTO's loss is 0.5 whatever the code). Its pair
batches (chosen rows, then rejected rows, the images once) come from the same records' preference pairs.

- SimPO: TRL's CPO trainer has no vision path (its forward passes no images), so its own loss function
  (``cpo_loss``, ``loss_type="simpo"``, ``cpo_alpha`` 0) is given the per-token mean log-probabilities its
  own ``get_batch_logps`` takes from the model's full logits on vlft's batch; the loss is the same formula, so
  vlft's first-step loss (the loss before any update) equals it.
- ORPO: likewise, its ``odds_ratio_loss``. TRL adds the chosen rows' NLL over every token, prompt and image
  tokens included, as one token mean over the batch; vlft's (the paper's) is each chosen reply's mean token
  NLL, averaged over pairs. So the odds-ratio terms are compared (vlft's loss less its logged NLL), and the
  log odds ratio.
- KTO: TRL's KTOTrainer itself (its vision collator's layout, given vlft's rows: each record's row, and the
  record's prompt with the previous record's reply as TRL cycles them), on the same model and adapter:
  the loss equals vlft's. The reference is the fresh adapter in both: vlft switches it off, TRL copies the
  adapter it is given into a frozen "ref" adapter (as vlft's ``--init-adapter`` reference), so the noise is
  added after TRL made that copy (before, TRL's reference would be the noisy policy itself: loss 0.5).

Tolerances: float32 sums of ~10 token log-probabilities of size ~10 (|error| ~ 1e-5 on a sum); each loss is
a bounded smooth function of such sums with slope <= beta (2.0 at most): 1e-5 is allowed.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

if os.environ.get("VLFT_REQUIRE_TRL") != "1":
    pytest.importorskip(
        "trl", reason="trl is not importable here; `make test` runs this module again with it (.venv/trl-site)"
    )
import trl  # noqa: F401 - after the skip: trl is optional, imported to fail loudly under VLFT_REQUIRE_TRL

NOISE = 0.05


def _noise(model) -> dict:
    generator = torch.Generator().manual_seed(3)
    return {
        n: torch.randn(p.shape, generator=generator) * NOISE for n, p in model.named_parameters() if p.requires_grad
    }


def _add(model, noise: dict) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in noise:
                p.add_(noise[n])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the KTO session, its host batch of 4 records, a pair batch of the same 4 prompts, the noise)."""
    from vlft.config import build_config
    from vlft.contracts.objective import Layout
    from vlft.data.demo import write_demo_unpaired
    from vlft.data.layouts import record_format
    from vlft.data.records import read_records
    from vlft.registry import load_registry
    from vlft.training.setup import training_collator
    from vlft.training.trainer import build_trainer

    tmp = tmp_path_factory.mktemp("trl-prefs")
    ds = write_demo_unpaired(tmp / "demo", n_train=8, n_val=4, seed=11)
    config = build_config(
        {},
        dict(
            backend="cpu",
            objective="kto",
            data=str(ds.train),
            val_data=str(ds.val),
            output=str(tmp / "run"),
            steps=1,
            batch_size=4,
            adapter={"lora_dropout": 0.0},
            objective_options={"desirable_weight": 1.5, "undesirable_weight": 0.5},
            seed=0,
        ),
    )
    registry = load_registry()
    s = build_trainer(registry, config)
    noise = _noise(s.model)
    _add(s.model, noise)
    host = s.collate([s.dataset[i] for i in range(4)])
    pairs_format = record_format(Layout.PREFERENCE_PAIRS)
    pair_records = read_records(ds.root / "preferences-train.jsonl", parse=pairs_format.parse)[:4]
    encoder = pairs_format.encoder(s.plan.encoder.base)
    pair_host = pairs_format.collate(training_collator(s.plan, None, s.plan.processor))(
        [encoder.encode(r) for r in pair_records]
    )
    return types.SimpleNamespace(s=s, registry=registry, host=host, pair_host=pair_host, noise=noise, config=config)


def _pair_logps(setup, trainer_class):
    """TRL's per-token mean log-probabilities of the pair batch's rows, from the model's full logits."""
    from vlft.data.batching import to_device
    from vlft.models.rows import row_inputs

    s = setup.s
    batch = to_device(setup.pair_host, s.device)
    with torch.no_grad():
        logits = s.model(**row_inputs(s.model, batch, 2)).logits
    return trainer_class.get_batch_logps(logits, batch["labels"], average_log_prob=True)


def _vlft_pair_loss(setup, name: str, options: dict):
    from vlft.config import RunConfig
    from vlft.data.batching import to_device, with_label_positions
    from vlft.models.passes import StepPasses

    s = setup.s
    objective = setup.registry.objective_for(RunConfig(objective=name, objective_options=options))
    batch = to_device(with_label_positions(setup.pair_host), s.device)
    with torch.no_grad():
        loss, figures = objective.loss(s.model, batch, StepPasses(s.device))
    n = int(setup.pair_host["records"])
    return float(loss) / n, {k: float(v) / n for k, v in figures.items()}


def test_simpos_loss_equals_trls_cpo_simpo(setup):
    from trl.experimental.cpo import CPOTrainer

    beta, gamma = 2.0, 1.0
    logps = _pair_logps(setup, CPOTrainer)
    n = len(logps) // 2
    stub = types.SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=0.0,
        accelerator=types.SimpleNamespace(device=setup.s.device),
    )
    losses, chosen, rejected = CPOTrainer.cpo_loss(stub, logps[:n], logps[n:])
    mine, figures = _vlft_pair_loss(setup, "simpo", {"beta": beta, "simpo_gamma": gamma})
    print(f"SimPO: vlft {mine:.9f}, TRL {float(losses.mean()):.9f}, margin {figures['reward_margin']:.4f}")
    assert mine == pytest.approx(float(losses.mean()), abs=1e-5)
    assert figures["reward_margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-5)
    assert abs(figures["reward_margin"]) > 1e-2  # not the trivial point


def test_orpos_odds_ratio_term_equals_trls(setup):
    from trl.experimental.orpo import ORPOTrainer

    lam = 0.1
    logps = _pair_logps(setup, ORPOTrainer)
    n = len(logps) // 2
    stub = types.SimpleNamespace(beta=lam, accelerator=types.SimpleNamespace(device=setup.s.device))
    losses, _, _, _, log_odds = ORPOTrainer.odds_ratio_loss(stub, logps[:n], logps[n:])
    mine, figures = _vlft_pair_loss(setup, "orpo", {"orpo_lambda": lam})
    print(f"ORPO odds-ratio term: vlft {mine - figures['nll_chosen']:.9f}, TRL {-float(losses.mean()):.9f}")
    assert mine - figures["nll_chosen"] == pytest.approx(-float(losses.mean()), abs=1e-5)
    assert figures["log_odds_ratio"] == pytest.approx(float(log_odds), abs=1e-5)
    assert figures["nll_chosen"] == pytest.approx(-float(logps[:n].mean()), abs=1e-5)


def test_ktos_loss_equals_trls_ktotrainer(setup, tmp_path):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from vlft import OWN, SHARED
    from vlft.data.batching import to_device
    from vlft.models.loading import load_model
    from vlft.models.passes import StepPasses
    from vlft.models.reference import Reference
    from vlft.training.step import seed_everything

    s, host = setup.s, setup.host
    desirable = host[OWN]["desirable"]
    assert 0 < int(desirable.sum()) < 4  # both kinds of record in the batch
    batch = to_device(StepPasses(s.device).with_positions(host), s.device)
    with torch.no_grad():
        mine, figures = s.plan.objective.loss(s.model, batch, StepPasses(s.device, None, Reference(s.model)))
    mine = float(mine) / 4

    plan = s.plan
    base = load_model(plan.model_path, plan.attention, plan.precision, family=plan.family)
    seed_everything(setup.config.seed)
    model = setup.registry.first(
        "vlft_apply_adapter",
        method="lora",
        model=base,
        targets=plan.targets,
        config=setup.config,
        target_parameters=[],
        family=plan.family,
    )
    kl, shared = host[OWN]["kl"], host[SHARED]
    layout = {
        "input_ids": host["input_ids"],
        "attention_mask": host["attention_mask"],
        "completion_mask": (host["labels"] != -100).long(),
        "KL_input_ids": kl["input_ids"],
        "KL_attention_mask": kl["attention_mask"],
        "KL_completion_mask": (kl["labels"] != -100).long(),
        "label": desirable,
        "pixel_values": shared["pixel_values"],
        "image_grid_thw": shared["image_grid_thw"],
        "mm_token_type_ids": host["mm_token_type_ids"],
        "KL_mm_token_type_ids": kl["mm_token_type_ids"],
    }
    args = KTOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        beta=0.1,
        desirable_weight=1.5,
        undesirable_weight=0.5,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    rows = Dataset.from_list([{"images": [], "prompt": "", "completion": "", "label": True}] * 4)
    trainer = KTOTrainer(
        model=model, args=args, train_dataset=rows, processing_class=s.plan.processor, data_collator=lambda _: layout
    )
    # the noise after the trainer is built: given a PEFT model, KTOTrainer copies its adapter as it finds it into a
    # frozen "ref" adapter, the reference (the fresh LoRA here: the adapter off, vlft's reference)
    assert "ref" in model.peft_config
    _add(model, setup.noise)
    with torch.no_grad():
        theirs = float(trainer._compute_loss(trainer.model.eval(), layout, False))
    print(f"KTO: vlft {mine:.9f}, TRL {theirs:.9f}, kl {figures['kl'] / 4:.5f}")
    assert abs(mine - 0.5 * (1.5 * 2 + 0.5 * 2) / 4) > 1e-3  # not the trivial point
    assert mine == pytest.approx(theirs, abs=1e-5)
