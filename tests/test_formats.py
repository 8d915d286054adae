"""Record layouts as users already have them, each read to the same turns, images and tokens as plain messages.

Fixtures are written from each format's own documentation:
- transformers chat templates / TRL / axolotl: ``content`` lists of ``{"type": "text", "text"}`` and
  ``{"type": "image"}`` parts, images in the record's ``images`` column (transformers "Multimodal chat templates";
  TRL "Vision datasets"); ``{"type": "image", "url" | "path"}`` and OpenAI's ``{"type": "image_url",
  "image_url": {"url"}}`` inline.
- LLaMA-Factory data/README.md "sharegpt": ``conversations`` of ``{"from": "human" | "gpt", "value"}``, a
  ``system`` column, ``images`` relative to its media dir (``--image-root``); its newer content parts
  ``{"type": "text" | "image", "value"}``.
- ms-swift "Custom dataset": ``messages`` with ``images``, ``loss: false`` per message, and the
  ``query``/``response``/``history``/``system`` layout.
- official Qwen2.5-VL fine-tuning code (qwen-vl-finetune): ``{"image", "conversations": [{"from": "human",
  "value": "<image>\\n..."}]}``, images relative to the data path; ``{"video", ...}`` with ``<video>``.
- LLaVA: ``{"id", "image", "conversations"}`` with the image relative to the image folder.
- Qwen-VL: ``Picture 1: <img>assets/a.png</img>`` inline in the user's text.
"""

from __future__ import annotations

import base64
import io
import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import embedded_family
from vlft.data.encoding import SampleEncoder
from vlft.data.records import read_records
from vlft.errors import DataError

Q, A = "What colour is it?", "colour: red"


def _png(path: Path, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buf, format="PNG")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _write(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


PLAIN = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"<image>{Q}"},
        {"role": "assistant", "content": A},
    ],
    "images": ["imgs/a.png"],
}

LAYOUTS = {
    "content list, image column (transformers/TRL)": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": Q}]},
            {"role": "assistant", "content": [{"type": "text", "text": A}]},
        ],
        "images": ["imgs/a.png"],
    },
    "content list, inline path": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": "imgs/a.png"}, {"type": "text", "text": Q}]},
            {"role": "assistant", "content": A},
        ]
    },
    "content list, LLaMA-Factory value parts": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "value": "imgs/a.png"}, {"type": "text", "value": Q}]},
            {"role": "assistant", "content": A},
        ]
    },
    "Qwen-VL inline tag": {
        "conversations": [
            {"from": "user", "value": f"Picture 1: <img>imgs/a.png</img>{Q}"},
            {"from": "assistant", "value": A},
        ],
        "system": "Be brief.",
    },
    "sharegpt with system column": {
        "conversations": [{"from": "human", "value": f"<image>{Q}"}, {"from": "gpt", "value": A}],
        "system": "Be brief.",
        "images": ["imgs/a.png"],
    },
    "conversation (singular)": {
        "conversation": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"<image>{Q}"},
            {"role": "assistant", "content": A},
        ],
        "image": "imgs/a.png",
    },
    "swift query/response": {"system": "Be brief.", "query": f"<image>{Q}", "response": A, "images": ["imgs/a.png"]},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_reads_as_its_plain_messages_equivalent_token_for_token(tmp_path, processor, layout):
    _png(tmp_path / "imgs" / "a.png")
    [plain] = read_records(_write(tmp_path / "plain.jsonl", [PLAIN]))
    [rec] = read_records(_write(tmp_path / "other.jsonl", [LAYOUTS[layout]]))
    assert [(t.role, t.text, t.trained) for t in rec.turns] == [(t.role, t.text, t.trained) for t in plain.turns]
    assert rec.images == plain.images
    enc = SampleEncoder(processor, embedded_family())
    a, b = enc.encode(plain), enc.encode(rec)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_image_url_data_uri_and_swift_history(tmp_path):
    raw = _png(tmp_path / "imgs" / "a.png")
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    rec_a = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": Q}],
            },
            {"role": "assistant", "content": A},
        ]
    }
    rec_b = {"query": "and now?", "response": "still red", "history": [[f"<image>{Q}", A]], "images": [uri]}
    a, b = read_records(_write(tmp_path / "d.jsonl", [rec_a, rec_b]))
    assert a.images == [raw] and a.turns[0].text == f"<image>{Q}"
    assert [t.text for t in b.turns] == [f"<image>{Q}", A, "and now?", "still red"] and b.reference == "still red"


def test_image_root_is_where_relative_paths_start(tmp_path):
    _png(tmp_path / "media" / "coco" / "a.png")
    path = _write(
        tmp_path / "data" / "llava.jsonl",
        [
            {
                "id": "x",
                "image": "coco/a.png",
                "conversations": [{"from": "human", "value": f"<image>\n{Q}"}, {"from": "gpt", "value": A}],
            }
        ],
    )
    with pytest.raises(DataError, match=r"llava.jsonl:1: image 'coco/a.png' not found .*pass --image-root DIR"):
        read_records(path)
    [rec] = read_records(path, image_root=tmp_path / "media")
    assert rec.images == [str((tmp_path / "media" / "coco" / "a.png").resolve())]


def _user(text):
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": A}], "images": []}


@pytest.mark.parametrize(
    "record, message",
    [
        (_user(f"<|image_pad|>{Q}"), "turn 0: '<|image_pad|>' looks like an image marker vlft does not read"),
        (_user(f"<|vision_start|>{Q}"), "turn 0: '<|vision_start|>' looks like an image marker"),
        (_user(f"<img>imgs/a.png{Q}"), "turn 0: '<img>' looks like an image marker"),
        (_user(f"<video>{Q}"), "1 <video> placeholder(s) but 0 video(s)"),
        (
            {
                "messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": A}],
                "images": ["imgs/a.png"],
            },
            "0 <image> placeholder(s) but 1 image(s) in 'images'; put one <image> in the text for each image (or pass "
            "--add-placeholders",
        ),
        (
            {
                "messages": [{"role": "user", "content": "<image>" + Q}, {"role": "assistant", "content": A}],
                "images": ["https://example.com/a.png"],
            },
            "image 'https://example.com/a.png' is a URL and vlft reads nothing from the network",
        ),
        (
            {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": A, "loss": False}]},
            "every assistant turn has loss: false",
        ),
        (
            {"messages": [{"role": "user", "content": Q, "loss": True}, {"role": "assistant", "content": A}]},
            "turn 0: 'loss' is only read on assistant turns",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                    {"role": "assistant", "content": A},
                ]
            },
            "turn 0, part 0: unknown content part",
        ),
        ({"instruction": Q, "output": A}, "record has neither 'conversations' nor 'messages'"),
        (
            {
                "messages": [{"role": "user", "content": "<image>" + Q}, {"role": "assistant", "content": A}],
                "images": ["imgs/a.png"],
                "video": "clip.mp4",
            },
            "0 <video> placeholder(s) but 1 video(s)",
        ),
    ],
)
def test_every_failure_names_file_and_line(tmp_path, record, message):
    _png(tmp_path / "imgs" / "a.png")
    path = _write(tmp_path / "train.jsonl", [PLAIN, record])
    with pytest.raises(DataError) as err:
        read_records(path)
    assert f"train.jsonl:2: {message}" in str(err.value)


def test_add_placeholders_puts_them_at_the_start_of_the_first_user_turn(tmp_path):
    _png(tmp_path / "imgs" / "a.png")
    path = _write(tmp_path / "t.jsonl", [{"system": "Be brief.", "query": Q, "response": A, "images": ["imgs/a.png"]}])
    [rec] = read_records(path, add_placeholders=True)
    assert [t.text for t in rec.turns] == ["Be brief.", f"<image>{Q}", A]


def test_a_url_is_read_from_its_download_under_the_image_root(tmp_path):
    _png(tmp_path / "root" / "example.com" / "pics" / "a.png")
    path = _write(
        tmp_path / "t.jsonl",
        [
            {
                "messages": [{"role": "user", "content": "<image>" + Q}, {"role": "assistant", "content": A}],
                "images": ["https://example.com/pics/a.png"],
            }
        ],
    )
    [rec] = read_records(path, image_root=tmp_path / "root")
    assert rec.images == [str((tmp_path / "root" / "example.com" / "pics" / "a.png").resolve())]


def test_loss_false_keeps_a_reply_in_the_context_and_out_of_the_loss(tmp_path, processor):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": Q},
        {"role": "assistant", "content": A},
    ]
    off = json.loads(json.dumps(msgs))
    off[1]["loss"] = False
    both, first_off = read_records(_write(tmp_path / "t.jsonl", [{"messages": msgs}, {"messages": off}]))
    enc = SampleEncoder(processor, embedded_family())
    a, b = enc.encode(both), enc.encode(first_off)
    assert torch.equal(a["input_ids"], b["input_ids"])
    trained = lambda e: processor.tokenizer.decode(e["input_ids"][e["labels"] != -100])  # noqa: E731 - a one-line helper
    assert "hello there" in trained(a) and "hello there" not in trained(b) and A in trained(b)


def test_system_turns_follow_the_qwen25vl_template(tmp_path, processor):
    # Qwen2.5-VL's published template: a system turn as given, else "You are a helpful assistant."
    with_sys, without = read_records(
        _write(
            tmp_path / "t.jsonl",
            [
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": Q},
                        {"role": "assistant", "content": A},
                    ]
                },
                {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": A}]},
            ],
        )
    )
    enc = SampleEncoder(processor, embedded_family())
    assert enc.render(with_sys.turns, False).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    assert enc.render(without.turns, False).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


def _mp4(path: Path, frames=8, fps=4) -> Path:
    # PyAV is a dependency, but a device machine's own Python may lack it: skip there, as the device tests do
    av = pytest.importorskip("av", reason="writing a test video needs PyAV (pip install av), not installed here")

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for i in range(frames):
            arr = np.full((64, 64, 3), (i * 30) % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def test_video_goes_through_the_processors_video_path(tmp_path, processor):
    _mp4(tmp_path / "clips" / "a.mp4")
    (tmp_path / "clips" / "bad.mp4").write_bytes(b"not a video")
    good = {
        "video": "clips/a.mp4",
        "conversations": [{"from": "human", "value": f"<video>\n{Q}"}, {"from": "gpt", "value": A}],
    }
    path = _write(tmp_path / "v.jsonl", [good, dict(good, video="clips/bad.mp4")])
    with pytest.raises(DataError, match=r"v.jsonl:2: video 'clips/bad.mp4' cannot be read"):
        read_records(path)
    [rec] = read_records(_write(tmp_path / "v1.jsonl", [good]))
    enc = SampleEncoder(processor, embedded_family(), video_fps=2.0, video_max_frames=16)
    out = enc.encode(rec)
    grid = out["video_grid_thw"][0]
    assert int(grid[0]) == 2  # 8 frames at 4 fps over 2 s, sampled at 2 fps: 4 frames, 2 temporal patches
    n_video = int((out["input_ids"] == processor.video_token_id).sum())
    assert n_video == int(grid.prod()) // processor.image_processor.merge_size**2
    assert enc.measure(rec)[0] == len(out["input_ids"])


@pytest.mark.parametrize("n, batch, accum", [(3, 4, 1), (3, 4, 2), (5, 4, 2)])
def test_fewer_records_than_one_step_train_on_a_smaller_batch_instead_of_hanging(n, batch, accum):
    from vlft.data.order import DataOrder, batches

    def hang(*_):
        raise TimeoutError("batches() gave no step within 20 s: the small-set hang")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)  # a hang fails the test instead of the suite
    try:
        gen = batches(list(range(n)), lambda xs: xs, DataOrder(batch_size=batch, grad_accum=accum, seed=0), 0)
        steps = [next(gen) for _ in range(3)]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert all(sorted(x for b in group for x in b) == list(range(n)) for group in steps)


def test_fewer_records_than_processes_is_refused_before_anything_is_written(tmp_path):
    from vlft.config import build_config
    from vlft.planning.preflight import check_enough_records

    with pytest.raises(DataError, match="1 training record.s. for 2 processes.*nothing was written"):
        check_enough_records(1, build_config({}, {"data": "x.jsonl"}).__class__(world_size=2))


def test_every_layout_trains_one_step_and_data_check_reports_them(tmp_path):
    """One short run over one file per layout (and a video), several --data files with a weight, early stopping."""
    from click.testing import CliRunner

    from vlft.cli import cli

    _png(tmp_path / "imgs" / "a.png")
    _mp4(tmp_path / "clips" / "a.mp4")
    files = [str(_write(tmp_path / f"layout{i}.jsonl", [rec])) for i, rec in enumerate(LAYOUTS.values())]
    files.append(
        str(
            _write(
                tmp_path / "video.jsonl",
                [
                    {
                        "video": "clips/a.mp4",
                        "conversations": [{"from": "human", "value": f"<video>\n{Q}"}, {"from": "gpt", "value": A}],
                    }
                ],
            )
        )
        + ":2"
    )
    val = _write(tmp_path / "val.jsonl", [PLAIN])
    res = CliRunner().invoke(cli, ["data", "check", *[f.rsplit(":", 1)[0] for f in files], "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert [f["records"] for f in report["files"]] == [1] * len(files) and report["files"][-1]["videos"] == 1
    assert report["tokens"]["max"] == report["longest"][0]["tokens"] and report["longest"][0]["where"].endswith(
        "video.jsonl:1"
    )
    bad = _write(tmp_path / "bad.jsonl", [_user(f"<|image_pad|>{Q}")])
    res = CliRunner().invoke(cli, ["data", "check", str(bad)])
    assert res.exit_code != 0 and "bad.jsonl:1: turn 0: '<|image_pad|>'" in res.output

    out = tmp_path / "run"
    args = [
        "run",
        "--backend",
        "cpu",
        "--output",
        str(out),
        "--val-data",
        str(val),
        "--batch-size",
        str(len(files) + 1),
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--early-stopping-patience",
        "1",
        "--eval-samples",
        "1",
        "--max-new-tokens",
        "2",
        "--save-every",
        "0",
        "--quiet",
    ]
    for f in files:
        args += ["--data", f]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    # early stopping: the best step is the one with the lowest validation loss logged, its adapter is kept
    vals = {
        m["step"]: m["val_loss"]
        for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in m
    }
    assert sorted(vals) == [1, 2]
    best = min(vals, key=lambda step: (vals[step], step))
    stopping = summary["early_stopping"]
    assert (stopping["best_step"], stopping["best_val_loss"]) == (best, vals[best]), (stopping, vals)
    assert stopping["stopped_early"] == (vals[2] >= vals[1])  # patience 1: one evaluation without a better loss
    from safetensors.torch import load_file

    kept, last = (load_file(str(out / d / "adapter_model.safetensors")) for d in ("adapter-best", "adapter"))
    assert kept.keys() == last.keys()
    assert all(torch.equal(kept[k], last[k]) for k in kept) == (best == 2)  # the last step's adapter or an older one
    assert (out / "adapter" / "adapter_config.json").exists()
