"""A handful of the zoo (bench/zoo.py, table in docs/zoo.md): model types built tiny by the zoo's generic
builder (a shrunk config, a tiny tokenizer holding the processor's tokens, the processor class sized down, a
ChatML-style template) train 2 steps through ``vlft run`` on mixed text-only and image records, each through
the family vlft picks; one shared build and run per type (module-scoped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import cli_invoke

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a package of the repository, not an installed one
    sys.path.insert(0, str(ROOT))

from bench import zoo  # noqa: E402 - after the repository is on sys.path

# generic family; fast; four processor styles, and two inputs the generic reader must find: Cosmos3-Edge's
# per-token modality ids (asked of the processor; its 3-D rope reads them) and Step-3.7's local crops (returned
# only for a large or elongated image: the wide probe finds them)
TYPES = ("idefics2", "lfm2_vl", "lighton_ocr", "exaone4_5", "cosmos3_edge", "step3p7")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("zoo")
    data = zoo.write_data(root)
    out = {}
    for model_type in TYPES:
        folder = root / model_type / "ckpt"
        zoo.build(model_type, folder)
        run = root / model_type / "run"
        code, output = cli_invoke(
            "run", "--quiet", "--backend", "cpu", "--model", folder, "--data", data, "--output", run,
            "--steps", "2", "--batch-size", "2", "--max-length", "4096", "--save-every", "0", "--eval-every", "0",
            "--max-new-tokens", "2", "--log-every", "1",
        )  # fmt: skip
        out[model_type] = (code, output, run)
    return out


@pytest.mark.parametrize("model_type", TYPES)
def test_a_zoo_type_trains_two_steps_through_the_cli(runs, model_type):
    code, output, run = runs[model_type]
    assert code == 0, output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    plan = json.loads((run / "plan.json").read_text())
    assert model_type in plan["model_family"]["model_types"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logged if "loss" in m]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)
    # every step held an image: the tower's adapters moved (the generic family adapts both towers)
    from safetensors.torch import load_file

    vision = plan["model_family"]["description"].split("vision ", 1)[1].split(" ", 1)[0]
    weights = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    moved = [float(v.abs().max()) for k, v in weights.items() if "lora_B" in k and vision in k]
    assert moved and max(moved) > 0, vision


def test_an_encoder_decoder_type_is_refused_before_step_one_with_the_reason(tmp_path):
    """T5Gemma 2 (an image-text-to-text type whose prompt goes to an encoder): the generic family says so, in
    vlft's own error, instead of a failure inside the model's forward."""
    folder = tmp_path / "t5gemma2"
    zoo.build("t5gemma2", folder)
    code, output = cli_invoke(
        "run", "--quiet", "--backend", "cpu", "--model", folder, "--data", zoo.write_data(tmp_path),
        "--output", tmp_path / "run", "--steps", "2", "--max-length", "4096",
    )  # fmt: skip
    assert code != 0
    assert "encoder-decoder model" in output and "decoder-only" in output, output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
