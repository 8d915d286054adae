"""After training: `vlft predict`, `vlft eval`, `vlft export`, `vlft report`, `--report-to`, the progress bar.

One short LoRA run and one short OFT run are made per test session and shared by every test here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from helpers import cli_invoke, cli_result, run_flags
from vlft import hookimpl
from vlft.cli import cli


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(tmp_path_factory.mktemp("after") / "demo", n_train=16, n_val=4, seed=5)
    return ds.train, ds.val


class RecordingSink:
    """A plugin's metric sink (``vlft_metric_sink`` answers it for ``--report-to recording``): keeps what the
    training loop writes to it."""

    def __init__(self, folder):
        self.folder, self.records, self.closed = folder, [], False
        RecordingSinkPlugin.made.append(self)

    def write(self, record):
        self.records.append(dict(record))

    def close(self):
        self.closed = True


class RecordingSinkPlugin:
    made: ClassVar[list[RecordingSink]] = []

    @hookimpl
    def vlft_metric_sink(self, name, config):
        return RecordingSink if name == "recording" else None


def _short_run(tmp_path_factory, tiny_data, method, **over):
    """`vlft run` in this process (its progress bar on), with RecordingSinkPlugin beside the installed plugins:
    (run folder, its stderr, its stdout)."""
    from vlft.testing import registry_with

    train, val = tiny_data
    out = tmp_path_factory.mktemp(method) / "run"
    # lr 3e-3: three steps move the adapter far enough that its logits differ clearly from the base's
    values = dict(
        backend="cpu",
        method=method,
        data=str(train),
        val_data=str(val),
        output=str(out),
        steps=3,
        batch_size=2,
        log_every=1,
        eval_every=0,
        eval_samples=1,
        max_new_tokens=4,
        save_every=0,
        seed=1,
        lr=3e-3,
    )
    values.update(over)
    result = cli_result("run", *run_flags(values), registry=registry_with(RecordingSinkPlugin()))
    assert result.exit_code == 0, result.output
    return out, result.stderr, result.stdout


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory, tiny_data):
    """(run folder, its stderr, its stdout): validation loss and TensorBoard on, so every plot has data; a
    plugin's metric sink (RecordingSink) beside TensorBoard."""
    return _short_run(
        tmp_path_factory, tiny_data, "lora", eval_every=2, eval_batches=1, report_to="tensorboard,recording"
    )


@pytest.fixture(scope="session")
def oft_run(tmp_path_factory, tiny_data):
    # text towers only: OFT's per-step orthogonalisation on the vision blocks would triple the run's time
    return _short_run(tmp_path_factory, tiny_data, "oft", targets="text", steps=2)[0]


def vlft(*args) -> tuple[int, str]:
    return cli_invoke(*args)


# -- predict ---------------------------------------------------------------------------------------


def test_predict_writes_one_line_per_record_with_its_position_and_reference(lora_run, tiny_data, tmp_path):
    from vlft.data.records import read_records

    run, _, _ = lora_run
    _, val = tiny_data
    out = tmp_path / "pred.jsonl"
    code, output = vlft(
        "predict", "--adapter", run, "--data", val, "--output", out, "--max-new-tokens", 4, "--batch-size", 3, "--quiet"
    )
    assert code == 0, output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    records = read_records(val)
    assert len(lines) == len(records) == 4
    assert [p["where"] for p in lines] == [r.where for r in records] == [f"val.jsonl:{i}" for i in range(1, 5)]
    assert [p["reference"] for p in lines] == [r.reference for r in records]
    assert all(isinstance(p["prediction"], str) and "<image>" in p["prompt"] for p in lines)


def test_predict_reads_the_other_layout_and_answers_a_single_prompt(lora_run, tiny_data, tmp_path):
    run, _, _ = lora_run
    _, val = tiny_data
    # the same records as a JSON array in the messages layout (the demo file is JSONL, conversations layout)
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    converted = [
        {
            "messages": [
                {"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
                for t in r["conversations"]
            ],
            "images": [str((val.parent / r["image"]).resolve())],
        }
        for r in rows
    ]
    data = tmp_path / "val.json"
    data.write_text(json.dumps(converted))
    out = tmp_path / "pred.jsonl"
    # batch 1, as the single prompt is answered: the same computation, so the same greedy answer
    code, output = vlft(
        "predict",
        "--adapter",
        run / "adapter",
        "--data",
        data,
        "--output",
        out,
        "--max-new-tokens",
        4,
        "--batch-size",
        1,
        "--quiet",
    )
    assert code == 0, output
    jsonl = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["where"] for p in jsonl] == [f"val.json[{i}]" for i in range(4)]
    # the first record's question and image as --prompt and --image: its answer, alone on stdout
    question = converted[0]["messages"][0]["content"]
    assert question.startswith("<image>\n") and jsonl[0]["prediction"].strip()
    result = CliRunner().invoke(
        cli,
        [
            "predict",
            "--adapter",
            str(run),
            "--image",
            converted[0]["images"][0],
            "--prompt",
            question,
            "--max-new-tokens",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == jsonl[0]["prediction"] + "\n", (result.stdout, jsonl[0])


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- eval ------------------------------------------------------------------------------------------


def test_eval_gives_the_numbers_run_wrote_for_the_same_records(lora_run, tiny_data, tmp_path):
    run, _, _ = lora_run
    _, val = tiny_data
    out = tmp_path / "scores.json"
    code, output = vlft(
        "eval",
        "--adapter",
        run,
        "--data",
        val,
        "--samples",
        1,
        "--max-new-tokens",
        4,
        "--compare-base",
        "--output",
        out,
    )
    assert code == 0, output
    written = json.loads((run / "eval.json").read_text())
    got = json.loads(out.read_text())
    assert got["scores"] == written["after"]  # exact match, fields and the predictions themselves
    assert got["base"] == written["before"]
    assert "exact match" in output and got["samples"] == 1


def test_eval_writes_into_the_run_folder_beside_eval_json_and_says_where(lora_run, tiny_data, tmp_path, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run[0], run)  # a copy: the shared run stays as it was for the other tests
    _, val = tiny_data
    run_eval = (run / "eval.json").read_text()
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    code, output = vlft("eval", "--adapter", run, "--data", val, "--samples", 1, "--max-new-tokens", 4)
    assert code == 0, output
    out = run / f"eval-{val.stem}.json"
    assert json.loads(out.read_text())["samples"] == 1 and f"scores written to {out}" in output
    assert (run / "eval.json").read_text() == run_eval and not any(here.iterdir())
    # naming the run's own eval.json is refused, before anything is scored
    code, output = vlft("eval", "--adapter", run, "--data", val, "--output", run / "eval.json")
    assert code == 1 and "is the eval.json `vlft run` wrote" in output
    assert (run / "eval.json").read_text() == run_eval


# -- export ----------------------------------------------------------------------------------------

# Run in a fresh interpreter: plain transformers loads the exported folder, vlft is never imported.
PLAIN_LOAD = r"""
import sys, torch
from transformers import AutoModelForImageTextToText, AutoProcessor
folder, inputs_path, out_path = sys.argv[1:4]
model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(folder)
inputs = torch.load(inputs_path)
with torch.no_grad():
    logits = model(**inputs).logits
text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                     tokenize=False, add_generation_prompt=True)
assert not any(name == "vlft" or name.startswith("vlft.") for name in sys.modules), "vlft was imported"
torch.save({"logits": logits, "template": text}, out_path)
"""


def test_export_loads_with_plain_transformers_and_gives_the_adapter_logits(lora_run, tiny_data, tmp_path):
    import torch

    from vlft.data.batching import collator_for
    from vlft.data.records import read_records
    from vlft.evaluation.inference import LoadOptions, load_for_inference
    from vlft.registry import load_registry

    run, _, _ = lora_run
    _, val = tiny_data
    out = tmp_path / "merged"
    code, output = vlft("export", "--adapter", run, "--output", out, "--dtype", "fp32")
    assert code == 0, output
    assert (out / "model.safetensors").is_file() and (out / "chat_template.jinja").is_file()

    loaded = load_for_inference(
        load_registry(), str(run), None, LoadOptions(backend="cpu", precision="fp32", param_dtype="fp32")
    )
    records = read_records(val)[:2]
    collate = collator_for(loaded.processor, loaded.encoder.family)
    batch = collate([loaded.encoder.encode(r) for r in records])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        adapter_logits = loaded.model(**inputs).logits
        with loaded.model.disable_adapter():
            base_logits = loaded.model(**inputs).logits
    script = tmp_path / "plain_load.py"
    script.write_text(PLAIN_LOAD)
    subprocess.run(
        [sys.executable, str(script), str(out), str(tmp_path / "inputs.pt"), str(tmp_path / "o.pt")],
        check=True,
        cwd=tmp_path,
        timeout=120,
    )
    plain = torch.load(tmp_path / "o.pt")
    # fp32 merge and fp32 weights: only summation order differs (W x + B A x vs (W + B A) x)
    tolerance = 1e-4
    assert (plain["logits"] - adapter_logits).abs().max() < tolerance
    assert (adapter_logits - base_logits).abs().max() > 100 * tolerance  # the adapter changes the logits
    own = loaded.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert plain["template"] == own


def test_export_of_an_nf4_run_without_4bit_kernels_says_what_to_do_and_writes_nothing(lora_run, tmp_path, monkeypatch):
    """Where bitsandbytes cannot load 4-bit weights (here: its check made to say so), an nf4 run's default
    merge is refused before loading, with both ways out. (tests/test_qlora.py merges real nf4 runs.)"""
    import shutil

    import vlft.builtin.cpu as cpu

    run = shutil.copytree(lora_run[0], tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "param_dtype": "nf4"}))
    monkeypatch.setattr(cpu, "_four_bit", lambda: (False, "NF4 needs bitsandbytes, which is not installed"))
    code, output = vlft("export", "--adapter", run, "--output", tmp_path / "m")
    assert code != 0 and "trained on NF4 base weights" in output
    assert "pip install 'vlft[qlora]'" in output and "--merge-into original" in output
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m-*"))


def test_export_adapter_only_copies_peft_folder_with_a_model_card(oft_run, tmp_path):
    out = tmp_path / "adapter"
    code, output = vlft("export", "--adapter", oft_run, "--output", out, "--adapter-only")
    assert code == 0, output
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "method: oft" in card and "after training: exact match" in card


# -- report ----------------------------------------------------------------------------------------


def test_report_from_a_lora_and_an_oft_run(lora_run, oft_run, tmp_path):
    run, _, run_stdout = lora_run
    assert f"vlft report {run}" in run_stdout  # run says how to report on itself
    out = tmp_path / "report"
    code, output = vlft("report", run, oft_run, "--output", out)
    assert code == 0, output
    md = (out / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and "| cpu |" in line]
    assert len(table) == 2 and "| lora |" in table[0] and "| oft |" in table[1]
    assert '| method | "lora" | "oft" |' in md  # the settings that differ
    for name in ("loss", "val_loss", "lr", "step_time", "peak_memory"):
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name
        from PIL import Image

        with Image.open(out / f"{name}.png") as img:
            img.verify()
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5
    assert not re.search(r"(?:src|href)=\"(?!data:)", page) and "http" not in page
    assert "lora" in page and "oft" in page


def test_report_degrades_with_a_note_when_files_are_missing(lora_run, tmp_path):
    import shutil

    run, _, _ = lora_run
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(run / "plan.json", partial / "plan.json")  # a run that stopped early: no metrics, eval, summary
    code, output = vlft("report", partial, run, "--output", tmp_path / "rep")
    assert code == 0, output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "metrics.jsonl is missing" in md and "summary.json is missing" in md
    assert (tmp_path / "rep" / "loss.png").is_file()


# -- bad input -------------------------------------------------------------------------------------


def test_bad_inputs_give_one_clear_error_each(lora_run, tiny_data, tmp_path):

    from vlft.models.embedded import tokenizer_corpus
    from vlft_models.qwen2_vl import RECIPE_2_5, build_tiny_2_5

    run, _, _ = lora_run
    _, val = tiny_data
    code, output = vlft("report", tiny_data[0].parent, "--output", tmp_path / "r")
    assert code == 1 and "not a run folder" in output and not (tmp_path / "r").exists()
    code, output = vlft("predict", "--adapter", tiny_data[0].parent, "--data", val, "--output", tmp_path / "p")
    assert code == 1 and "not a run folder or an adapter folder" in output and not (tmp_path / "p").exists()
    code, output = vlft("predict", "--adapter", run, "--image", tmp_path / "missing.png", "--prompt", "hi")
    assert code == 1 and "missing.png: file not found" in output
    # a base of another shape (more key/value heads): the adapter's k_proj update does not fit it
    other = tmp_path / "other-base"
    build_tiny_2_5(
        other, dict(RECIPE_2_5, text=dict(RECIPE_2_5["text"], num_key_value_heads=4)), corpus=tokenizer_corpus()
    )
    code, output = vlft("export", "--adapter", run, "--model", other, "--output", tmp_path / "m")
    assert code == 1 and "does not fit the model" in output and not (tmp_path / "m").exists()
    assert [line for line in output.splitlines() if line.startswith("Error")] == [
        output[output.index("Error") :].strip()
    ]


# -- live logging and the progress bar ------------------------------------------------------------


def test_an_unknown_metric_sink_stops_the_run_before_anything_is_written(tmp_path):
    code, output = vlft("run", "--backend", "cpu", "--report-to", "tensorboard,nosuchsink", "--output", tmp_path / "r")
    assert code == 1 and "--report-to nosuchsink: no plugin offers this metric sink" in output
    assert not (tmp_path / "r").exists()


def test_tensorboard_gets_the_scalars_of_metrics_jsonl(lora_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, _ = lora_run
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    metrics = _rows(run / "metrics.jsonl")
    for key in ("loss", "lr", "val_loss", "step_time_s"):
        logged = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in logged] and logged, key
        assert [v for _, v in got] == pytest.approx([v for _, v in logged], rel=1e-6), key


def test_progress_bar_writes_no_line_per_logged_step_when_stderr_is_not_a_terminal(lora_run):
    _, stderr, _ = lora_run
    draws = [d for d in re.split(r"[\r\n]", stderr) if d.startswith("train:")]
    # three logged steps; a bar that redraws on each draws five times (start, 3 logs, close)
    assert 1 <= len(draws) <= 3, draws


def test_the_training_loop_feeds_a_plugins_metric_sink(lora_run):
    """A real run with ``--report-to tensorboard,recording``: the plugin's sink gets every record of
    metrics.jsonl as the loop logs it (steps 1-3, the validation loss at steps 2 and 3), and is closed once."""
    run, _, _ = lora_run
    sinks = [s for s in RecordingSinkPlugin.made if s.folder == run]
    assert len(sinks) == 1, [s.folder for s in RecordingSinkPlugin.made]
    sink = sinks[0]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sink.records == logged and sink.closed
    assert [r["step"] for r in sink.records if "loss" in r] == [1, 2, 3]
    # --eval-every 2 of 3 steps: at step 2 and at the last step
    assert [r["step"] for r in sink.records if "val_loss" in r] == [2, 3]
    assert all(r["val_loss"] > 0 for r in sink.records if "val_loss" in r)
    assert all(r["loss"] > 0 for r in sink.records if "loss" in r)


def test_a_plugins_metric_sink_receives_what_metrics_jsonl_receives(tmp_path):
    """``--report-to NAME`` asks ``vlft_metric_sink`` once; the loop then writes to the sink without hooks."""
    from vlft import MetricSink, hookimpl
    from vlft.commands.run import metric_sinks
    from vlft.config import build_config
    from vlft.errors import ConfigError
    from vlft.registry import load_registry
    from vlft.training.metrics import MetricsLog

    class ListSink(MetricSink):
        def __init__(self, folder):
            self.folder, self.records, self.closed = folder, [], False

        def write(self, record):
            self.records.append(record)

        def close(self):
            self.closed = True

    class SinkPlugin:
        @hookimpl
        def vlft_metric_sink(self, name, config):
            return ListSink if name == "list" else None

    registry = load_registry(plugins=(SinkPlugin(),))
    asked = registry.pm.hook.vlft_metric_sink(name="list", config=build_config({}, {}))
    assert asked is ListSink
    factories = metric_sinks(registry, build_config({}, {"report_to": "list"}))
    sink = factories[0](tmp_path)
    log = MetricsLog(tmp_path / "metrics.jsonl", [sink])
    log.write({"step": 1, "loss": 2.5})
    log.close()
    assert sink.folder == tmp_path and sink.records == [{"step": 1, "loss": 2.5}] and sink.closed
    assert (tmp_path / "metrics.jsonl").read_text().strip() == '{"step": 1, "loss": 2.5}'
    with pytest.raises(ConfigError, match="--report-to nowhere: no plugin offers this metric sink"):
        metric_sinks(registry, build_config({}, {"report_to": "nowhere"}))
