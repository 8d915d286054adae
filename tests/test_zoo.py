"""A handful of the zoo (bench/zoo.py, table in docs/zoo.md): model types built tiny by the zoo's generic
builder (a shrunk config, a tiny tokenizer holding the processor's tokens, the processor class sized down, a
ChatML-style template) train 2 steps through ``vlft run`` on mixed text-only and image records, each through
the family vlft picks; one shared build and run per type (module-scoped)."""

from __future__ import annotations

import json
import re
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
    out["data"] = data
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


def _dry_run(runs, model_type: str, data, *extra: str) -> str:
    code, output = cli_invoke(
        "run", "--backend", "cpu", "--model", runs[model_type][2].parent / "ckpt", "--data", data,
        "--dry-run", "--max-length", "4096", *extra,
    )  # fmt: skip
    assert code == 0, output
    return output


def test_packing_and_max_pixels_follow_what_the_checkpoint_is(runs, tmp_path):
    """Read from each checkpoint, not from a list of names. EXAONE 4.5 keeps rope deltas (3-D positions):
    ``--packing on`` is refused before step 1 with that reason. LFM2-VL's processor sizes an image by its own size
    (64 tokens up to 256 at 512x512 here): under ``--max-pixels`` each image is scaled down before it, and the plan counts fewer image tokens; the description says what the cap means."""
    code, output = cli_invoke(
        "run", "--backend", "cpu", "--model", runs["exaone4_5"][2].parent / "ckpt", "--data", runs["data"],
        "--dry-run", "--max-length", "4096", "--packing", "on",
    )  # fmt: skip
    assert code != 0 and "the generic family cannot pack: its positions are not 1-D" in output, output
    assert "rope_deltas" in output and "Traceback" not in output

    def counted(output: str) -> tuple[int, int]:
        longest = int(re.search(r"longest (\d+) tokens", output).group(1))
        return longest, int(re.search(r"(\d+) image patches", output).group(1))

    from vlft.data.demo import write_varied_dataset

    large = write_varied_dataset(tmp_path / "large", n=3, seed=1, min_side=480, max_side=640, max_images=1)
    whole, capped = _dry_run(runs, "lfm2_vl", large), _dry_run(runs, "lfm2_vl", large, "--max-pixels", "784")
    assert "max pixels a pixel budget per image: scaled down first" in whole
    (long_whole, tokens_whole), (long_capped, tokens_capped) = counted(whole), counted(capped)
    assert tokens_capped < tokens_whole and long_capped < long_whole, (counted(whole), counted(capped))


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
