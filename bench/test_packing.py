"""Group ``packing``: ``--packing on`` and ``--group-by-length`` against padding, as a user runs them.

Each variant is a real ``vlft run`` (``vlft.testing.run``: the CLI's path, with its data check, plan,
collator, loop and step) on the embedded model, LoRA, fp32, eager (the CPU's; the segments path when packed),
over one epoch of a variable-length set shaped like real fine-tuning data (``vlft.data.demo.write_varied_dataset``:
0-2 images at dynamic resolution capped at 448x448, 1-3 turns, answers of 3-90 words: 100 to 900 tokens).
The variants run one after another, round by round; the figures are read from each run's own metrics
(``metrics.jsonl``, logged every step): the time of its steps (data loading and collation included, as the
loop counts it), leaving out the first step (the allocator's warm-up) in every variant.

- ``padded``: ``--packing off`` (each micro-batch padded to its longest sample), the default;
- ``packed``: ``--packing on`` (one row per micro-batch, attended sample by sample);
- ``grouped``: ``--group-by-length`` (micro-batches of similar lengths, padded).

Figures (real tokens/s, the same samples in every variant):

- packed/padded: the speed-up of packing; the padding-free ceiling beside it is what it would be if time
  followed the positions computed (padded positions / real positions of the same micro-batches); the
  target is at least 0.9 of that ceiling;
- packed/grouped: packing against the other way to pad less (target > 1).

Padding lengthens only the text model's rows: the vision tower encodes each image's patches alone in every
variant. The share of a padded step its forward and backward take (clocked in the run by ``VisionClock``) is
reported beside the figures. A ceiling weighted by it (vision seconds kept, the rest shrunk by real/padded
positions) was tried and dropped: packed beat it (1.39x against 1.25x), because attention over a padded row
costs more than its positions (its square), so no linear model of the rest bounds packing.
"""

from __future__ import annotations

import statistics

import pytest

from bench.support.figures import figure, record
from bench.support.runs import rates, run_steps
from vlft.hookspecs import hookimpl

ROUNDS = 3
RECORDS = 32  # 8 steps of 4: one epoch per variant and round
BATCH = 4
MAX_PIXELS = 448 * 448
VARIANTS = {
    "padded": {"packing": "off"},
    "packed": {"packing": "on"},
    "grouped": {"packing": "off", "group_by_length": True},
}


@pytest.fixture(scope="session")
def varied_train(tmp_path_factory):
    from vlft.data.demo import write_varied_dataset

    return write_varied_dataset(
        tmp_path_factory.mktemp("bench-varied"), n=RECORDS, seed=7, max_images=2, answer_words=(3, 90)
    )


# The embedded model's vision tower (Qwen2.5-VL's layout): the bench runs on the embedded default.
VISION_TOWER = "model.visual"


class VisionClock:
    """A bench plugin: seconds of the vision tower in each training step, forward and backward.

    Forward: from the tower's forward pre-hook to its forward hook. Backward: from the gradient's arrival at the
    tower's output to the last gradient accumulated into the tower's trainable weights (nothing runs after it in
    a step's backward: the tower is the first thing the forward runs). The CPU runs synchronously, so the host
    clock times the work. Passes without gradients (the plan's trace, evaluation) are not steps."""

    def __init__(self):
        self.steps: list[float] = []
        self._forward = self._arrived = self._last = None

    def _close_step(self) -> None:
        if self._forward is not None:
            backward = (self._last - self._arrived) if self._arrived is not None and self._last is not None else 0.0
            self.steps.append(self._forward + backward)
        self._forward = self._arrived = self._last = None

    def _watch(self, tower) -> None:
        import time

        import torch

        def before(module, args):
            if not (module.training and torch.is_grad_enabled()):  # the plan's trace, evaluation: not a step
                return
            self._close_step()
            module._vlft_clock_start = time.perf_counter()

        def arrived(grad):
            self._arrived = self._arrived or time.perf_counter()

        def after(module, args, output):
            if not (module.training and torch.is_grad_enabled()):
                return
            self._forward = time.perf_counter() - module._vlft_clock_start
            tensors = output if isinstance(output, (tuple, list)) else getattr(output, "values", lambda: [output])()
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(arrived)
            if not getattr(module, "_vlft_clock_params", False):
                for p in module.parameters():
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(lambda _: setattr(self, "_last", time.perf_counter()))
                module._vlft_clock_params = True

        tower.register_forward_pre_hook(before)
        tower.register_forward_hook(after)

    @hookimpl
    def vlft_patch_model(self, model):
        self._watch(model.get_submodule(VISION_TOWER))
        return None

    def finish(self) -> list[float]:
        self._close_step()
        return self.steps


def _run(backend: str, folder, data, steps: int, **options) -> list[dict]:
    """One ``vlft run``; its per-step metrics, each with the seconds its vision tower took (``vision_s``)."""
    from vlft.registry import load_registry

    clock = VisionClock()
    metrics = run_steps(
        load_registry(plugins=(clock,)),
        steps,
        backend=backend,
        data=str(data),
        output=str(folder),
        batch_size=BATCH,
        max_pixels=MAX_PIXELS,
        **options,
    )
    vision = clock.finish()
    assert len(vision) == steps, len(vision)  # one tower pass a step
    return [{**m, "vision_s": v} for m, v in zip(metrics, vision)]


def _rates(steps: list[dict]) -> dict:
    """``rates`` over the steps after the first, with the vision tower's seconds in them."""
    return {**rates(steps), "vision_seconds": sum(m["vision_s"] for m in steps[1:])}


@pytest.mark.benchmark(group="packing")
def test_packing(benchmark, env, tmp_path, varied_train):
    rounds, steps = (1, 2) if benchmark.disabled else (ROUNDS, RECORDS // BATCH)
    variants = {"padded": VARIANTS["padded"], "packed": VARIANTS["packed"]} if benchmark.disabled else VARIANTS
    seen: dict[str, list[dict]] = {name: [] for name in variants}

    def one_round():
        for name, options in variants.items():
            seen[name].append(
                _rates(_run(env.backend, tmp_path / f"{name}-{len(seen[name])}", varied_train, steps, **options))
            )

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)

    def ratio(num: str, den: str) -> float:
        """Median over rounds of the paired tokens/s ratio."""
        return statistics.median(a["real_tokens_per_s"] / b["real_tokens_per_s"] for a, b in zip(seen[num], seen[den]))

    padded = seen["padded"][0]
    ceiling = padded["positions"] / padded["real_tokens"]
    assert seen["packed"][0]["positions"] == pytest.approx(seen["packed"][0]["real_tokens"])  # one row, no pad
    assert seen["packed"][0]["real_tokens"] == pytest.approx(padded["real_tokens"])  # the same samples
    packed = ratio("packed", "padded")
    vision_share = statistics.median(r["vision_seconds"] / r["seconds"] for r in seen["padded"])
    figures = {
        "packed/padded real tokens/s": figure(packed),
        "padding-free ceiling (padded/real positions)": figure(ceiling),
        "packed/padded as a share of the ceiling": figure(packed / ceiling, ">= 0.9"),
        "vision tower's share of a padded step": figure(vision_share, unit=""),
    }
    if "grouped" in seen:
        figures["packed/grouped real tokens/s"] = figure(ratio("packed", "grouped"), ">= 1")
        figures["grouped/padded real tokens/s"] = figure(ratio("grouped", "padded"))
    summary = {
        name: {
            "real_tokens_per_s": [r["real_tokens_per_s"] for r in runs],
            "step_seconds": [r["seconds"] for r in runs],
        }
        for name, runs in seen.items()
    }
    record(
        benchmark,
        env,
        None,
        "packing",
        figures,
        summary,
        notes=[
            f"{RECORDS} varied records (0-2 images capped at {MAX_PIXELS} px, 1-3 turns, answers 3-90 "
            f"words), micro-batches of {BATCH}, one epoch per variant and round, {rounds} round(s); real "
            f"`vlft run`s (LoRA, fp32, eager; packed: the segments path), step times from each run's "
            f"metrics, the first step left out"
        ],
    )
