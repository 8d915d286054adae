"""Data as the hub publishes it: Parquet files, saved `datasets` folders, shards and globs, images as bytes.

The sets are written here in the layouts their publishers document:
- LLaVA-OneVision-Data: ``id``, ``image`` as a ``{"bytes", "path"}`` struct (None on text-only rows),
  ``conversations`` of ``{"from", "value"}`` with ``<image>``, and a ``data_source`` column vlft does not read;
- the_cauldron: ``images`` a list of structs, ``texts`` a list of ``{"user", "assistant", "source"}`` with no
  placeholder (the images belong at the start of the first user turn);
- TRL (llava-instruct-mix-vsft): ``messages`` with typed content parts ``{"type": "image", "index": k}`` /
  ``{"type": "text", "text"}`` and an ``images`` column of ``datasets.Image``, saved with ``save_to_disk``
  (with `datasets` where installed; else pyarrow writes the same files: an Arrow stream and state.json);
- a set with its own column names (``conv``, ``pics``), read with ``--columns``; one of its images is a
  struct with a path and no bytes.
"""

from __future__ import annotations

import io
import json
import pickle
from array import array
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from helpers import cli_invoke, embedded_family
from vlft.data.columnar import StoredImage
from vlft.data.records import load_image, read_records
from vlft.errors import DataError

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}
SIZES = {"red": (56, 56), "green": (84, 56), "blue": (56, 112)}


def _png(name: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", SIZES[name], COLOURS[name]).save(buf, format="PNG")
    return buf.getvalue()


PNG = {name: _png(name) for name in COLOURS}
NAMES = list(COLOURS)


def _onevision_rows() -> list[dict]:
    rows = []
    for i in range(6):
        name = NAMES[i % 3]
        if i == 5:  # a text-only row, as the set holds them
            rows.append(
                {
                    "id": f"ov-{i}",
                    "image": None,
                    "data_source": "demo",
                    "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "blue"}],
                }
            )
            continue
        rows.append(
            {
                "id": f"ov-{i}",
                "image": {"bytes": PNG[name], "path": f"ov_{i}.png"},
                "data_source": "demo",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat colour is it?"},
                    {"from": "gpt", "value": name},
                ],
            }
        )
    return rows


def _cauldron_rows() -> list[dict]:
    rows = []
    for i in range(5):
        names = NAMES[i % 3 : i % 3 + 1] if i % 2 == 0 else [NAMES[i % 3], NAMES[(i + 1) % 3]]
        texts = [{"user": "Which colours do you see?", "assistant": " and ".join(names), "source": "demo"}]
        if i == 3:
            texts.append({"user": "How many pictures?", "assistant": str(len(names)), "source": "demo"})
        rows.append({"images": [{"bytes": PNG[n], "path": None} for n in names], "texts": texts})
    return rows


def _trl_rows() -> dict:
    messages, images = [], []
    for i in range(4):
        names = [NAMES[i % 3]] if i != 3 else ["red", "blue"]
        # the parts name the images by index; the two-image row names them in reverse
        parts = [{"type": "image", "index": k, "text": None} for k in (range(len(names)) if i != 3 else (1, 0))]
        messages.append(
            [
                {"role": "user", "content": [*parts, {"type": "text", "index": None, "text": "Colours, in order?"}]},
                {
                    "role": "assistant",
                    "content": [{"type": "text", "index": None, "text": ", ".join(names if i != 3 else names[::-1])}],
                },
            ]
        )
        images.append([{"bytes": PNG[n], "path": None} for n in names])
    return {"messages": messages, "images": images}


def _save_to_disk(folder: Path, columns: dict) -> None:
    """A `datasets` save_to_disk folder: with `datasets` where installed, else the same files from pyarrow."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        ds = datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image()))
        ds.save_to_disk(str(folder))
        return
    folder.mkdir(parents=True)
    table = pa.Table.from_pydict(columns)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text("{}")


def _own_names_rows(folder: Path) -> list[dict]:
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    (folder / "pics" / "g.png").write_bytes(PNG["green"])
    rows = []
    for name in ("red", "green", "blue"):
        pic = {"bytes": None, "path": "pics/g.png"} if name == "green" else {"bytes": PNG[name], "path": None}
        rows.append(
            {
                "conv": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": name}],
                "pics": [pic],
            }
        )
    return rows


@pytest.fixture(scope="module")
def hub_sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    sets = {
        "onevision": root / "onevision.parquet",
        "cauldron": root / "cauldron.parquet",
        "trl": root / "trl",
        "own": root / "own" / "own.parquet",
    }
    # two row groups, so locations name the group
    pq.write_table(pa.Table.from_pylist(_onevision_rows()), sets["onevision"], row_group_size=4)
    pq.write_table(pa.Table.from_pylist(_cauldron_rows()), sets["cauldron"])
    _save_to_disk(sets["trl"], _trl_rows())
    pq.write_table(pa.Table.from_pylist(_own_names_rows(sets["own"].parent)), sets["own"])
    return sets


def _table(path: Path) -> pa.Table:
    """The whole set, read here with pyarrow alone (what the files hold, to compare vlft's counts with)."""
    if path.is_dir():
        state = json.loads((path / "state.json").read_text())
        return pa.concat_tables(
            pa.ipc.open_stream(pa.memory_map(str(path / f["filename"]))).read_all() for f in state["_data_files"]
        )
    return pq.read_table(path)


def _held(path: Path, column: str) -> tuple[int, int]:
    """(rows, images) a set holds."""
    values = _table(path).column(column).to_pylist()
    return len(values), sum(0 if v is None else len(v) if isinstance(v, list) else 1 for v in values)


IMAGE_COLUMN = {"onevision": "image", "cauldron": "images", "trl": "images", "own": "pics"}
COLUMNS = "messages=conv,images=pics"
RUN = (
    "run",
    "--quiet",
    "--backend",
    "cpu",
    "--steps",
    "2",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-samples",
    "1",
    "--max-new-tokens",
    "2",
    "--save-every",
    "0",
    "--seed",
    "3",
)


def _losses(out: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def test_hub_sets_check_and_train_as_their_json_lines_conversions(hub_sets, tmp_path):
    """`vlft data check` counts every record and image the files hold and lists the column it does not read;
    a 2-step run on the four sets (--columns for the one with its own names, the saved folder also as
    --val-data) trains every record, with the losses of a run on the same sets converted to JSON Lines by
    `vlft data convert` (images written out as files): the same tokens and pixels reached the model."""
    held = {name: _held(path, IMAGE_COLUMN[name]) for name, path in hub_sets.items()}
    from click.testing import CliRunner

    from vlft.cli import cli

    res = CliRunner().invoke(cli, ["data", "check", *map(str, hub_sets.values()), "--columns", COLUMNS, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert [(f["records"], f["images"]) for f in report["files"]] == list(held.values())
    assert [f["layouts"] for f in report["files"]] == [
        {"conversations": 6},
        {"texts": 5},
        {"messages": 4},
        {"messages": 3},
    ]
    assert report["files"][0]["unread_columns"] == {str(hub_sets["onevision"]): ["data_source"]}
    assert report["notes"] == [
        f"{hub_sets['onevision']}: columns not read: data_source (--columns OURS=THEIRS reads one as a key vlft knows)"
    ]
    n = sum(rows for rows, _ in held.values())

    runs = {}
    for kind in ("hub", "jsonl"):
        if kind == "hub":
            data = [x for p in hub_sets.values() for x in ("--data", p)] + ["--columns", COLUMNS]
        else:
            data = []
            for name, path in hub_sets.items():
                code, output = cli_invoke(
                    "data",
                    "convert",
                    path,
                    tmp_path / f"{name}.jsonl",
                    *(("--columns", COLUMNS) if name == "own" else ()),
                )
                assert code == 0 and f"wrote {held[name][0]} records with {held[name][1]} image(s)" in output, output
                data += ["--data", tmp_path / f"{name}.jsonl"]
        runs[kind] = tmp_path / kind
        val = hub_sets["trl"] if kind == "hub" else tmp_path / "trl.jsonl"
        code, output = cli_invoke(*RUN, *data, "--val-data", val, "--batch-size", n, "--output", runs[kind])
        assert code == 0, output
    plan = json.loads((runs["hub"] / "plan.json").read_text())
    assert plan["lengths"]["samples"] == n  # every record trained: one batch of all of them each step
    assert any("data_source" in note for note in plan["notes"])
    hub, converted = _losses(runs["hub"]), _losses(runs["jsonl"])
    assert len(hub) == 2 and hub == pytest.approx(converted, rel=1e-6, abs=0)


def test_rows_are_read_lazily_with_images_decoded_once(hub_sets, monkeypatch):
    """Records keep each stored image's place (file, row, column, item), not its bytes (a pickled record
    holds none of them); the image read back when a sample is built is the one written. An image repeated in many rows is
    decoded once by the check (3 distinct images in 5 image rows)."""
    import vlft.data.records as records

    decoded = []
    real = records.load_image
    monkeypatch.setattr(records, "load_image", lambda source: decoded.append(1) or real(source))
    recs = read_records(hub_sets["onevision"])
    assert len(decoded) == 3
    assert [r.where for r in recs[3:5]] == [
        "onevision.parquet: row group 0, row 3",
        "onevision.parquet: row group 1, row 4",
    ]
    ref = recs[4].images[0]
    assert ref == StoredImage(str(hub_sets["onevision"].resolve()), 4, "image")
    assert PNG[NAMES[4 % 3]][16:] not in pickle.dumps(recs[4])  # the place, not the bytes
    assert load_image(ref).tobytes() == Image.open(io.BytesIO(PNG[NAMES[4 % 3]])).convert("RGB").tobytes()
    assert recs[5].images == [] and recs[4].image_sizes == [SIZES[NAMES[4 % 3]]]
    # the cauldron's images stand at the start of the first user turn; the TRL row's parts pick by index
    [_, _, _, two, _] = read_records(hub_sets["cauldron"])
    assert two.turns[0].text.startswith("<image><image>") and "<image>" not in two.turns[2].text
    trl = read_records(hub_sets["trl"])
    assert [load_image(s).getpixel((0, 0)) for s in trl[3].images] == [COLOURS["blue"], COLOURS["red"]]
    assert trl[3].where == "trl/data-00000-of-00001.arrow: row 3"


def test_measuring_checked_rows_reads_each_images_size_as_the_check_decoded_it(hub_sets, processor):
    """A check measures its rows after reading them: a worker reads a run of rows together and each distinct
    image's size from its header (not the pixels). Lengths and grids come out as on the records the check
    built with every image decoded (images of three shapes, 56x56, 84x56, 56x112: a swapped width and height
    changes the grid), in any order the run's held-out split and weighting leave the rows in."""
    from vlft.data.encoding import SampleEncoder
    from vlft.data.lazy import read_compact

    encoder = SampleEncoder(processor, embedded_family())
    for name in ("onevision", "cauldron", "trl"):
        rows, problems = read_compact(hub_sets[name])
        assert not problems.items
        checked = read_records(hub_sets[name])
        order = [4, 0, 1, 3, 2, 2][: len(checked)] if len(checked) >= 5 else list(range(len(checked)))[::-1]
        for records, expected in ((rows, checked), (rows.take(order), [checked[i] for i in order])):
            read = list(records)
            assert [r.where for r in read] == [r.where for r in expected]
            assert [r.image_sizes for r in read] == [r.image_sizes for r in expected]
            assert [encoder.measure_labelled(r) for r in read] == [encoder.measure_labelled(r) for r in expected]


def test_a_folder_of_shards_and_a_glob_read_as_one_set(hub_sets, tmp_path):
    """Shards in a folder (sorted by name) and a glob over them: every row once, each named by its shard."""
    rows = _onevision_rows()
    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(3):
        pq.write_table(pa.Table.from_pylist(rows[2 * k : 2 * k + 2]), folder / f"train-{k:05d}-of-00003.parquet")
    by_folder = read_records(folder)
    by_glob = read_records(str(folder / "train-*.parquet"))
    assert [r.id for r in by_folder] == [r.id for r in by_glob] == [r["id"] for r in rows]
    assert by_folder[5].where == "shards/train-00002-of-00003.parquet: row group 0, row 1"
    assert by_glob[5].where == "train-00002-of-00003.parquet: row group 0, row 1"


def _broken_set(path: Path) -> Path:
    rows = _onevision_rows()
    rows[2]["conversations"] = rows[2]["conversations"][:1]  # no reply
    rows[4]["image"] = {"bytes": b"\x89PNG not an image", "path": "broken.png"}
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    return path


def test_bad_rows_are_named_by_file_row_group_and_row_and_nothing_is_written(tmp_path):
    """A broken image and a record without a reply: `vlft data check` and `vlft run` name both with file,
    row group and row, exit non-zero, and the run writes nothing; a cauldron row without a reply too."""
    bad = _broken_set(tmp_path / "bad.parquet")
    expected = [
        "bad.parquet: row group 0, row 2: no assistant turn",
        "bad.parquet: row group 1, row 4: image (column 'image', 17 bytes) cannot be read",
    ]
    code, output = cli_invoke("data", "check", bad)
    assert code != 0 and all(e in output for e in expected), output
    out = tmp_path / "run"
    code, output = cli_invoke(*RUN, "--data", bad, "--output", out)
    assert code != 0 and all(e in output for e in expected) and "nothing was written" in output, output
    assert not out.exists()
    rows = _cauldron_rows()
    rows[1]["texts"][0]["assistant"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "texts.parquet")
    with pytest.raises(DataError, match=r"texts.parquet: row group 0, row 1: texts\[0\] has no 'assistant' reply"):
        read_records(tmp_path / "texts.parquet")


def test_unreadable_files_and_folders_get_a_message_naming_what_they_are_not(hub_sets, tmp_path):
    """A truncated Parquet file is named as damaged Parquet (not as text that is not UTF-8); a file none of
    whose columns a layout reads, a folder that is neither a saved `datasets` folder nor a folder of shards,
    and a saved DatasetDict say what to give."""
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(hub_sets["onevision"].read_bytes()[:-100])
    code, output = cli_invoke("data", "check", cut)
    assert code != 0 and "cut.parquet: cannot be read as Parquet" in output and "UTF-8" not in output, output
    renamed = tmp_path / "train.jsonl"  # Parquet under a JSON name is still read as Parquet
    renamed.write_bytes(hub_sets["onevision"].read_bytes())
    assert len(read_records(renamed)) == 6
    empty = tmp_path / "photos"
    empty.mkdir()
    (empty / "a.png").write_bytes(PNG["red"])
    with pytest.raises(DataError, match="photos is a folder, but neither a saved `datasets` folder"):
        read_records(empty)
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), tmp_path / "qa.parquet")
    with pytest.raises(DataError, match=r"qa.parquet: none of its columns \(question, answer\) is one vlft reads"):
        read_records(tmp_path / "qa.parquet")
    splits = tmp_path / "dd"
    splits.mkdir()
    (splits / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (splits / "train").symlink_to(hub_sets["trl"])
    with pytest.raises(DataError, match=r"holds several splits \(train\).*--data .*dd/train"):
        read_records(splits)


def test_convert_round_trips_json_lines_through_parquet(tmp_path):
    """JSON Lines (image paths, a base64 image, a system turn, a reply out of the loss, two images, an id) to
    Parquet and back: the same turns, and every image's bytes as the source file's; Parquet holds them as
    {bytes, path} structs. A bad record stops the conversion with nothing written."""
    import base64

    (tmp_path / "imgs").mkdir()
    for name in NAMES:
        (tmp_path / "imgs" / f"{name}.png").write_bytes(PNG[name])
    b64 = base64.b64encode(PNG["blue"]).decode()
    lines = [
        {
            "id": 7,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<image>Colour?"},
                {"role": "assistant", "content": "red"},
            ],
            "images": ["imgs/red.png"],
        },
        {
            "conversations": [
                {"from": "human", "value": "<image> and <image>?"},
                {"from": "gpt", "value": "green, blue"},
                {"from": "human", "value": "Sure?"},
                {"from": "gpt", "value": "yes", "loss": False},
            ],
            "images": ["imgs/green.png", f"data:image/png;base64,{b64}"],
        },
    ]
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    code, output = cli_invoke("data", "convert", src, tmp_path / "set.parquet")
    assert code == 0, output
    stored = pq.read_table(tmp_path / "set.parquet").column("images").to_pylist()
    assert stored == [
        [{"bytes": PNG["red"], "path": "red.png"}],
        [{"bytes": PNG["green"], "path": "green.png"}, {"bytes": PNG["blue"], "path": None}],
    ]
    code, output = cli_invoke("data", "convert", tmp_path / "set.parquet", tmp_path / "back.jsonl")
    assert code == 0 and "3 image file(s)" in output, output

    def view(records):
        return [
            (
                [(t.role, t.text, t.trained) for t in r.turns],
                None if r.id is None else str(r.id),
                [load_image(s).tobytes() for s in r.images],
            )
            for r in records
        ]

    first, back = read_records(src), read_records(tmp_path / "back.jsonl")
    assert view(back) == view(first) == view(read_records(tmp_path / "set.parquet"))
    assert sorted(p.read_bytes() for p in (tmp_path / "back-images").iterdir()) == sorted(PNG.values())

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code, output = cli_invoke("data", "convert", bad, tmp_path / "bad.parquet")
    assert code != 0 and "bad.jsonl:1: no assistant turn" in output and not (tmp_path / "bad.parquet").exists()


def test_the_config_file_maps_columns_and_finds_globs_beside_it(tmp_path):
    """``columns`` as a mapping in the config file is the flag's string; a glob is relative to the file."""
    from vlft.config import build_config, load_config_file, parse_columns

    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.parquet").write_bytes(b"")
    (tmp_path / "run.yaml").write_text("columns: {messages: conv, images: pics}\ndata: ['shards/*.parquet:2']\n")
    config = build_config(load_config_file(tmp_path / "run.yaml"), {})
    assert parse_columns(config.columns) == {"messages": "conv", "images": "pics"}
    assert config.data == [f"{tmp_path}/shards/*.parquet:2"]


def _execute(**values) -> Path:
    """``vlft run`` in this process (a KeyboardInterrupt from ``die_at_step`` comes out as it is)."""
    from vlft.commands.run import execute
    from vlft.config import build_config
    from vlft.registry import load_registry

    execute(load_registry(), build_config({}, values), progress=False)
    return Path(values["output"])


def _short_run(hub_sets, out: Path, **over) -> dict:
    """A short run on the OneVision-style Parquet set (image bytes, two row groups; 6 rows in batches of 2, so
    4 steps cross an epoch), dropout off so that losses depend on the samples alone."""
    return {
        **dict(
            backend="cpu",
            data=str(hub_sets["onevision"]),
            val_data=str(hub_sets["cauldron"]),
            output=str(out),
            steps=4,
            batch_size=2,
            log_every=1,
            eval_every=0,
            eval_samples=1,
            max_new_tokens=2,
            save_every=0,
            seed=3,
            lr=3e-3,
            adapter={"lora_dropout": 0.0},
        ),
        **over,
    }


@pytest.fixture(scope="module")
def uninterrupted(hub_sets, tmp_path_factory) -> list[float]:
    return _losses(_execute(**_short_run(hub_sets, tmp_path_factory.mktemp("whole") / "run")))


def test_a_parquet_run_killed_mid_way_resumes_at_the_exact_sample(hub_sets, uninterrupted, tmp_path, monkeypatch):
    """Killed during step 3 (after the step-2 checkpoint), then ``--resume``d: steps 3 and 4 draw the samples the
    uninterrupted run drew there (rows built again from the file), so every logged loss is the same. Same
    process, same shapes, same arithmetic: equal, not close."""
    from helpers import die_at_step

    values = _short_run(hub_sets, tmp_path / "run", save_every=2)
    die_at_step(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _execute(**values)
    monkeypatch.undo()
    assert len(_losses(tmp_path / "run")) == 2
    _execute(**values, resume=True)
    assert len(uninterrupted) == 4 and _losses(tmp_path / "run") == uninterrupted


@pytest.fixture
def reads(tmp_path, monkeypatch):
    """Each row a ``ColumnarRecords`` builds and each stored image's bytes read from its file, noted with the
    process that read it and whether torch called it a DataLoader worker (a log file: workers are processes)."""
    import os

    import torch

    import vlft.data.columnar as columnar
    import vlft.data.lazy as lazy

    log = tmp_path / "reads.jsonl"

    def noted(what, fn, where):
        def read(*args, **kwargs):
            with open(log, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "what": what,
                            "pid": os.getpid(),
                            "where": where(*args),
                            "worker": torch.utils.data.get_worker_info() is not None,
                        }
                    )
                    + "\n"
                )
            return fn(*args, **kwargs)

        return read

    monkeypatch.setattr(lazy, "record_at", noted("row", lazy.record_at, lambda file, row, *_: [Path(file).name, row]))
    monkeypatch.setattr(
        columnar,
        "read_image_bytes",
        noted("image", columnar.read_image_bytes, lambda ref: [Path(ref.file).name, ref.row]),
    )
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_dataloader_worker_reads_the_rows_and_images_itself(hub_sets, uninterrupted, tmp_path, reads):
    """``--num-workers 1``: the records travel to the worker as (file, row) places and the worker reads rows and
    image bytes from the Parquet file itself (seen there: another process, which torch calls a worker); its
    samples are the main process's, so the losses are equal."""
    import os

    out = _execute(**_short_run(hub_sets, tmp_path / "run", steps=2, num_workers=1))
    assert json.loads((out / "plan.json").read_text())["dataloader"]["num_workers"] == 1
    train = [r for r in reads() if r["where"][0] == "onevision.parquet"]  # the validation set is the cauldron's
    by = {(r["what"], r["worker"], r["pid"] != os.getpid()) for r in train}
    assert by == {("row", True, True), ("image", True, True)}, (
        f"reads of the training file (what, in a DataLoader worker, in another process): {sorted(by) or 'none'}"
    )
    assert len({r["where"][1] for r in train if r["what"] == "row"}) >= 4  # 2 steps of 2 samples, and prefetched
    assert len({r["pid"] for r in train}) == 1  # one worker
    assert _losses(out) == uninterrupted[:2]


def _checked(data: str, processor) -> tuple:
    """``load_and_check_data`` on ``data`` without a validation file (a seeded tenth held out), weighted."""
    from vlft.config import RunConfig
    from vlft.data.encoding import SampleEncoder
    from vlft.planning.preflight import load_and_check_data

    return load_and_check_data(RunConfig(data=[data], seed=0), SampleEncoder(processor, embedded_family()))


def test_a_run_holds_parquet_rows_as_places_with_the_records_of_json_lines(tmp_path, processor, monkeypatch):
    """The run's checked data on a Parquet set (held-out tenth, weight 2.5: whole copies and a seeded share)
    are the records the same set as JSON Lines gives, in the same order and split, with the same lengths; but
    held as (file, row) places: the pickled result (the checked-data cache) grows per training sample by its
    places and figures alone: 12 bytes (file int32, row int64) and 8 each for its length, labelled count and
    grid offset, 12 per image grid (int32 t, h, w); in memory they are the same arrays. (A list of Records
    holds a Record per distinct sample, about 3 KB resident: bench/test_columnar.py.)"""
    import vlft.data.lazy as lazy
    from vlft.data.convert import convert
    from vlft.data.demo import write_demo_dataset

    monkeypatch.setenv("VLFT_CACHE", str(tmp_path / "cache"))
    sizes = {}
    for n in (20, 80):
        ds = write_demo_dataset(tmp_path / f"demo-{n}", n_train=n, n_val=1, seed=2)
        convert(ds.train, tmp_path / f"train-{n}.parquet")
        train, val, lengths = _checked(f"{tmp_path / f'train-{n}.parquet'}:2.5", processor)
        assert isinstance(train, lazy.ColumnarRecords) and isinstance(val, lazy.ColumnarRecords)
        json_train, json_val, json_lengths = _checked(f"{ds.train}:2.5", processor)

        def view(records):
            return [([(t.role, t.text) for t in r.turns], [load_image(s).tobytes() for s in r.images]) for r in records]

        assert len(train) == len(json_train) == 2 * (n - n // 10) + (n - n // 10) // 2
        assert view(train) == view(json_train) and view(val) == view(json_val)
        assert list(lengths.lengths) == json_lengths.lengths and list(lengths.labelled) == json_lengths.labelled
        assert list(lengths.grids) == json_lengths.grids
        sizes[n] = (len(train), sum(map(len, lengths.grids)), len(pickle.dumps((train, val, lengths))))
    (s1, g1, p1), (s2, g2, p2) = sizes[20], sizes[80]
    bound = (12 + 3 * 8) * (s2 - s1) + 12 * (g2 - g1) + 12 * 6  # and 6 more held-out places
    assert p2 - p1 <= bound + 3 * 8  # each of the 8 arrays' byte strings may outgrow pickle's 1-byte length
    # in memory too: arrays, not a Python int (28 bytes and an 8-byte pointer) or tuple per sample
    assert all(
        isinstance(a, array) for a in (lengths.lengths, lengths.labelled, lengths.grids.starts, lengths.grids.flat)
    )
    assert isinstance(train.rows, np.ndarray) and isinstance(train.file_of, np.ndarray)
