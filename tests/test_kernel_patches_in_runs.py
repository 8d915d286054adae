"""Kernel patches in real ``vlft run``s: applied once, they run at every step, before and after an evaluation,
even where transformers re-kernelizes the model at each ``train()``/``eval()``; one undone after set-up stops
the run, named.

transformers 5.25 turns hub kernels on by default (``use_kernels``) and then pops every ``forward`` bound on a
hub-kernel layer's instance (RMSNorm) at each ``train()``/``eval()``: the Ascend plugin's ``npu-rms-norm`` binds
its forward exactly so. vlft loads with ``use_kernels=False``; these runs load with it True, as a model
loaded by other code would be, to show the patches survive it anyway (``models.patching``).
"""

from __future__ import annotations

import json
import types

import pytest
import transformers

import vlft.models.loading
import vlft.registry
import vlft.training.trainer
from helpers import cli_invoke
from vlft.models.patching import KERNEL, patch_states

KERNELS = ("npu-rms-norm", "linear-patch-embed")


@pytest.fixture
def kernel_plugin(monkeypatch):
    import kernel_patch_plugin

    monkeypatch.setenv("VLFT_PLUGINS", "kernel_patch_plugin")
    monkeypatch.setattr(vlft.registry, "_default", None)  # the CLI's registry is loaded anew, with the plugin
    kernel_patch_plugin.OP_CALLS[0] = 0
    return kernel_patch_plugin


@pytest.fixture
def hub_kernels_on(monkeypatch):
    """The model loaded with transformers' default ``use_kernels=True``, so every ``train()``/``eval()``
    re-kernelizes it (``kernels``' ``kernelize``, which pops instance-bound forwards)."""
    real = transformers.AutoModelForImageTextToText

    class Loader:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return real.from_pretrained(*args, **{**kwargs, "use_kernels": True})

    monkeypatch.setattr(vlft.models.loading, "AutoModelForImageTextToText", Loader)


@pytest.fixture
def steps_seen(monkeypatch):
    """Per training step: whether the model re-kernelizes, and how often each patch's code ran in it (the pinned
    counters, and the stand-in op's own count)."""
    import kernel_patch_plugin

    real_step, seen = vlft.training.trainer.train_step_on, []

    def watched_step(model, *args, **kwargs):
        root = getattr(model, "module", model)
        before = {k: s.calls for k, s in patch_states(root, set(KERNELS)).items()}
        op_before = kernel_patch_plugin.OP_CALLS[0]
        out = real_step(model, *args, **kwargs)
        after = patch_states(root, set(KERNELS))
        seen.append(
            {
                "use_kernels": root.get_base_model().use_kernels,
                "calls": {k: after[k].calls - before[k] for k in KERNELS},
                "op_calls": kernel_patch_plugin.OP_CALLS[0] - op_before,
            }
        )
        return out

    monkeypatch.setattr(vlft.training.trainer, "train_step_on", watched_step)
    return seen


def _run(small_data, out, *extra):
    train, val = small_data
    return cli_invoke(
        "run",
        "--backend",
        "cpu",
        "--data",
        train,
        "--val-data",
        val,
        "--output",
        out,
        "--steps",
        4,
        "--batch-size",
        2,
        "--log-every",
        1,
        "--eval-every",
        2,
        "--eval-batches",
        1,
        "--eval-samples",
        0,
        "--seed",
        3,
        "--kernels",
        "auto,npu-rms-norm,linear-patch-embed",
        *extra,
    )


def test_kernel_patches_run_at_every_step_before_and_after_an_evaluation(
    kernel_plugin, hub_kernels_on, steps_seen, small_data, tmp_path
):
    code, output = _run(small_data, tmp_path / "run")
    assert code == 0, output
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [k["name"] for k in plan["kernels"]["chosen"]] == list(KERNELS)
    lines = [line for line in plan["model_patches"] if line.startswith("kernel ")]
    assert any("npu_rms_norm in" in line and "pinned" in line for line in lines), lines
    assert any("matmul over the same weight" in line and "pinned" in line for line in lines), lines
    assert len(steps_seen) == 4  # evaluations after steps 2 and 4: steps 3 and 4 come after an eval()/train()
    for step, seen in enumerate(steps_seen, 1):
        assert seen["use_kernels"], "the model does not re-kernelize: this run would not show the pin survives it"
        assert seen["op_calls"] > 0, f"step {step}: the stand-in npu_rms_norm did not run ({seen})"
        assert all(n > 0 for n in seen["calls"].values()), f"step {step}: a patch did not run ({seen})"


def _undo_after(monkeypatch, steps: int):
    """Once ``steps`` training steps have run, each ``train()`` of the model binds each RMSNorm's own class
    forward on the instance afterwards, as ``kernelize`` does where it finds a hub kernel for the layer: what
    a patch bound before is no longer called."""
    real_train, real_step, done = transformers.PreTrainedModel.train, vlft.training.trainer.train_step_on, [0]

    def counted_step(*args, **kwargs):
        done[0] += 1
        return real_step(*args, **kwargs)

    def train(self, mode=True):
        result = real_train(self, mode)
        if mode and done[0] >= steps and type(self).__name__.endswith("ForConditionalGeneration"):
            for module in self.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    original = next(c for c in type(module).__mro__ if not hasattr(c, KERNEL))
                    module.forward = types.MethodType(original.forward, module)
        return result

    monkeypatch.setattr(vlft.training.trainer, "train_step_on", counted_step)
    monkeypatch.setattr(transformers.PreTrainedModel, "train", train)


@pytest.mark.parametrize(
    "undone_at, where", [(0, "the first step"), (2, "the first step after the evaluation at step 2")]
)
def test_a_kernel_patch_undone_after_set_up_stops_the_run_naming_it(
    kernel_plugin, monkeypatch, small_data, tmp_path, undone_at, where
):
    _undo_after(monkeypatch, undone_at)
    out = tmp_path / "run"
    code, output = _run(small_data, out)
    assert code != 0
    assert (
        f"({where}) did not run kernel patch(es) the plan lists as applied: npu-rms-norm: a forward was bound "
        "over it" in output
    ), output
    assert "linear-patch-embed" not in output.split("did not run", 1)[1].split(".", 1)[0]  # only the lost one
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped: kernel patch lost" and "npu-rms-norm" in summary["error"]
    assert not (out / "adapter").exists()
