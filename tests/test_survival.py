"""Fault injection: non-finite steps, signals, kills during a checkpoint write, damaged checkpoints, changed
configurations and hostile inputs. Where a process must die it is a real subprocess, bounded by a timeout."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers import cli_invoke, run_flags, vlft_command
from test_run import logged_losses, read_metrics, short_config, short_values
from vlft.cli import cli
from vlft.errors import ConfigError, DataError, VlftError
from vlft.training.checkpoints import (
    CheckpointStore,
    CheckpointWriteError,
    newest_checkpoint,
    training_state,
)


def wait_for(predicate, proc: subprocess.Popen, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the process ended (rc {proc.returncode}) before {what}:\n{out[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def logged_steps(output: Path) -> list[int]:
    path = output / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


# -- 1. non-finite steps -----------------------------------------------------------------------------


def test_non_finite_steps_are_not_applied_and_too_many_stop_the_run(small_data, tmp_path, monkeypatch):
    import vlft.data.encoding
    import vlft.models.passes
    import vlft.training.step

    # steps 2, 4 and 5 produce a NaN loss (a patched loss)
    nan_steps = {2, 4, 5}
    calls = {"step": 0}
    real_loss, real_step, real_get = (
        vlft.models.passes.batch_loss_sum,
        vlft.training.step.train_step,
        vlft.data.encoding.EncodedDataset.__getitem__,
    )
    weights: dict[int, tuple] = {}
    drawn: list[int] = []

    def nan_loss(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        return out * float("nan") if calls["step"] in nan_steps else out

    def watched_step(model, optimizer, *args, **kwargs):
        calls["step"] += 1
        params = [p for g in optimizer.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        state_before = {
            id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params if p in optimizer.state
        }
        out = real_step(model, optimizer, *args, **kwargs)
        weights[calls["step"]] = (
            before,
            [p.detach().clone() for p in params],
            state_before,
            {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params},
        )
        return out

    def watched_get(self, index):
        drawn.append(index)
        return real_get(self, index)

    monkeypatch.setattr(vlft.models.passes, "batch_loss_sum", nan_loss)
    monkeypatch.setattr(vlft.training.step, "train_step", watched_step)
    monkeypatch.setattr(vlft.data.encoding.EncodedDataset, "__getitem__", watched_get)
    out = tmp_path / "run"
    values = short_values(
        small_data, out, steps=8, save_every=1, eval_every=0, eval_samples=1, max_new_tokens=2, max_skipped_steps=2
    )
    code, output = cli_invoke("run", "--quiet", *run_flags(values))
    assert code != 0 and re.search(r"2 consecutive steps .* \(steps 4, 5;", output), output

    before, after, state_before, state_after = weights[2]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the NaN step changed the weights"
    for pid, st in state_after.items():  # the optimizer state is as before, step counter included
        for k, v in st.items():
            assert torch.equal(v, state_before[pid][k]), k
    before3, after3 = weights[3][:2]
    assert not all(torch.equal(a, b) for a, b in zip(before3, after3)), "the finite step after it was not applied"
    assert all(torch.isfinite(p).all() for p in weights[5][1])

    metrics = read_metrics(out)
    skipped = [m for m in metrics if "skipped" in m]
    assert [m["step"] for m in skipped] == [2, 4, 5]
    # the records named are the ones the data loader drew for that step (batch 4, one micro-batch a step)
    records = __import__("vlft.data.records", fromlist=["read_records"]).read_records(small_data[0])
    train_where = {r.where for r in records}
    assert set(skipped[0]["records"]) <= train_where and len(skipped[0]["records"]) == 4
    assert [m["skipped_steps"] for m in metrics if "loss" in m] == [0, 1, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"].startswith("stopped") and summary["skipped_steps"] == 3
    assert [e["step"] for e in summary["skipped"]] == [2, 4, 5]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003", "step-000004"]
    # the loader draws step k's samples just before step k: step 2 is the second group of 4
    assert skipped[0]["records"] == [records[i].where for i in drawn[4:8]]


def test_guarded_step_undoes_a_non_finite_step_on_the_device_bit_for_bit():
    """The accelerator path (the CPU just skips the step, see StepPolicy.flags_on_host): the step is taken
    and undone by a device-side mask, parameters and AdamW state (step counter included) as they were."""
    import copy

    from vlft.training.step import guarded_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # AdamW state exists
    snapshot = (
        [p.detach().clone() for p in model.parameters()],
        [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()],
    )
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    guarded_step(opt, torch.tensor(False))
    for p, old, old_state in zip(model.parameters(), *snapshot):
        assert torch.equal(p, old) and all(torch.equal(v, old_state[k]) for k, v in opt.state[p].items())
    # a finite step goes through as optimizer.step() would
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1, weight_decay=0.01)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own state tensors, not opt's
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    guarded_step(opt, torch.tensor(True))
    twin_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert not all(torch.equal(p, old) for p, old in zip(model.parameters(), snapshot[0]))


def test_guarded_step_on_parameters_off_the_host_reads_no_flag_and_leaves_host_counters_to_settle():
    """Parameters on the 'meta' device stand in for an accelerator's (no values, and reading one on the host
    raises, as a sync would be needed): the guarded step runs without reading its flag, masks the state that
    lives with the parameters, and leaves AdamW's host step counters to ``settle_step_counters``, which takes
    the skipped steps back off."""
    from vlft.training.step import guarded_step, settle_step_counters

    model = torch.nn.Linear(4, 3, device="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError):
        bool(torch.tensor(False, device="meta"))  # what a host read of the flag would do

    def step(finite: bool) -> None:
        for p in model.parameters():
            p.grad = torch.empty_like(p)
        guarded_step(opt, torch.tensor(finite, device="meta"))

    step(True)
    step(False)
    for p in model.parameters():
        state = opt.state[p]
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu" and float(state["step"]) == 2  # not masked: elsewhere
    settle_step_counters(opt, 1, torch.device("meta"))
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [1.0, 1.0]


# -- 2. signals ---------------------------------------------------------------------------------------


def test_sigterm_writes_a_checkpoint_and_resume_gives_the_uninterrupted_losses(
    registry, small_data, tmp_path, straight_run
):
    from vlft.commands.run import execute

    train, val = small_data
    out = tmp_path / "run"
    # the same training as straight_run (short_config), evaluated less; no periodic checkpoints
    args = [
        "run",
        "--backend",
        "cpu",
        "--method",
        "lora",
        "--data",
        str(train),
        "--val-data",
        str(val),
        "--output",
        str(out),
        "--steps",
        "8",
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--eval-samples",
        "1",
        "--max-new-tokens",
        "2",
        "--save-every",
        "0",
        "--seed",
        "1",
        "--lr",
        "3e-3",
        "--quiet",
    ]
    proc = subprocess.Popen(vlft_command() + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: logged_steps(out), proc, 240, "the first training step")
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    step = summary["step"]
    assert summary["status"] == "interrupted" and 1 <= step < 8
    assert f"--output {out}" in summary["resume_command"] and summary["resume_command"].endswith("--resume")
    assert summary["resume_command"] in stdout
    assert newest_checkpoint(out / "checkpoints").name == f"step-{step:06d}"
    assert logged_steps(out) == list(range(1, step + 1))

    execute(
        registry,
        short_config(small_data, out, steps=8, eval_every=0, eval_samples=1, max_new_tokens=2, resume=True),
        progress=False,
    )
    a, b = logged_losses(straight_run), logged_losses(out)
    assert [m["step"] for m in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), (x, y)
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"

    # a changed batch size is refused, listing the difference, before anything is loaded or written
    with pytest.raises(VlftError, match=r"batch-size: 4 in the checkpoint, 2 now"):
        execute(registry, short_config(small_data, out, steps=8, batch_size=2, resume=True), progress=False)


def test_resume_identity_ignores_logging_and_evaluation(small_data, tmp_path):
    from vlft.training.resume import identity_differences, run_identity

    base = run_identity(short_config(small_data, tmp_path))
    same = run_identity(
        short_config(
            small_data,
            tmp_path / "x",
            log_every=7,
            eval_every=0,
            eval_samples=1,
            max_new_tokens=3,
            save_every=9,
            keep_checkpoints=5,
        )
    )
    assert identity_differences(base, same) == []
    changed = run_identity(short_config(small_data, tmp_path, grad_accum=2, seed=3))
    assert [d.split(":")[0] for d in identity_differences(base, changed)] == ["grad-accum", "seed"]


# -- 3. checkpoints: whole or ignored -----------------------------------------------------------------


def stand_in_save_adapter(model, path: Path) -> None:
    """A stand-in for a method's vlft_save_adapter: the store's own writing is what is under test."""
    path.mkdir(parents=True)
    torch.save(model.state_dict(), path / "weights.pt")


def tiny_training_state():
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler


def test_a_damaged_newest_checkpoint_is_skipped_and_none_left_is_one_error(tmp_path):
    model, optimizer, scheduler = tiny_training_state()
    store = CheckpointStore(tmp_path / "checkpoints", 3, stand_in_save_adapter)
    for step in (2, 4):
        store.save(step, training_state(step, optimizer, scheduler, None, torch.device("cpu")), model)
    assert newest_checkpoint(store.root).name == "step-000004"
    state = store.root / "step-000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    said: list[str] = []
    assert newest_checkpoint(store.root, report=said.append).name == "step-000002"
    assert said == [
        "resume: skipping step-000004: state.pt has 100 bytes, the manifest says "
        f"{json.loads((state.parent / 'manifest.json').read_text())['files']['state.pt']['size']}"
    ]
    older = store.root / "step-000002" / "adapter" / "weights.pt"
    data = bytearray(older.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    older.write_bytes(bytes(data))
    with pytest.raises(
        VlftError,
        match=r"no complete checkpoint .*step-000004: state.pt has 100 bytes.*"
        r"step-000002: adapter/weights.pt does not match its sha256",
    ):
        newest_checkpoint(store.root, report=lambda m: None)


def test_a_full_disk_stops_the_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import vlft.training.checkpoints

    model, optimizer, scheduler = tiny_training_state()
    store = CheckpointStore(tmp_path / "checkpoints", 2, stand_in_save_adapter)
    store.save(1, training_state(1, optimizer, scheduler, None, torch.device("cpu")), model)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(vlft.training.checkpoints.torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"step 2 .*the disk is full.*step-000001 is intact"):
        store.save(2, training_state(2, optimizer, scheduler, None, torch.device("cpu")), model)
    assert sorted(p.name for p in store.root.iterdir()) == ["step-000001"]
    assert newest_checkpoint(store.root).name == "step-000001"


FULL_DISK_ON_RANK_0 = '''
"""sitecustomize for the test below: in the torchrun worker of rank 0 only, torch.save as the checkpoint
store calls it is replaced by a stand-in for a full disk while the checkpoint of one step is written."""
import os
if os.environ.get("RANK") == "0" and os.environ.get("FULL_DISK_STAND_IN_AT_STEP"):
    import errno
    import vlft.training.checkpoints

    _real_save = vlft.training.checkpoints.torch.save
    _folder = f".tmp-step-{int(os.environ['FULL_DISK_STAND_IN_AT_STEP']):06d}"

    def full_disk_stand_in(obj, f, *args, **kwargs):
        if _folder in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return _real_save(obj, f, *args, **kwargs)

    vlft.training.checkpoints.torch.save = full_disk_stand_in
'''


def test_a_checkpoint_write_failing_on_rank_0_stops_every_process_with_its_message(small_data, tmp_path):
    """Two torchrun agents (--nnodes 2, one data-parallel process each, as on two machines: neither agent
    stops the other's process): rank 0's disk is full at step 2's checkpoint (the last step's). Both processes stop with the
    message and a non-zero exit, well before the process-group timeout (gloo: 600 s), and step 1's
    checkpoint is intact."""
    import socket

    train, val = small_data
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK_ON_RANK_0)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        FULL_DISK_STAND_IN_AT_STEP="2",
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    )
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    args = [
        "-m",
        "vlft",
        "run",
        "--quiet",
        "--backend",
        "cpu",
        "--method",
        "lora",
        "--data",
        str(train),
        "--val-data",
        str(val),
        "--output",
        str(out),
        "--steps",
        "2",
        "--batch-size",
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
        "1",
    ]
    agents = [
        subprocess.Popen(
            [*torchrun, "--node-rank", str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    try:
        said = [a.communicate(timeout=240)[0] for a in agents]  # the bug this guards against: 600 s, then a timeout
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    message = (
        r"writing the checkpoint of step 2 .* failed \(the disk is full\); the run stops here. "
        r"The previous checkpoint step-000001 is intact"
    )
    for rank, (agent, text) in enumerate(zip(agents, said)):
        assert agent.returncode != 0, f"rank {rank} exited 0:\n{text[-3000:]}"
        assert re.search(message, text.replace("\n", " ")), f"rank {rank}:\n{text[-3000:]}"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert newest_checkpoint(out / "checkpoints").name == "step-000001"
    assert not (out / "adapter").exists()
    summary = json.loads((out / "summary.json").read_text())  # rank 0's, written as it stopped
    assert summary["status"] == "stopped: checkpoint write failed" and re.search(message, summary["error"])
    assert summary["checkpoint"].endswith("step-000001") and "--resume" in summary["resume_command"]


KILLED_WRITER = """
import sys, time, torch
from pathlib import Path
import vlft.training.checkpoints
from test_survival import stand_in_save_adapter, tiny_training_state

root = Path(sys.argv[1])
real = torch.save
def paused_save(obj, path, *a, **k):
    real(obj, path, *a, **k)
    if 'tmp-step-000002' in str(path) and str(path).endswith('state.pt'):
        (root.parent / 'inside-write').write_text('1')  # tell the test, then wait to be killed
        time.sleep(120)
vlft.training.checkpoints.torch.save = paused_save
model, optimizer, scheduler = tiny_training_state()
store = vlft.training.checkpoints.CheckpointStore(root, 2, stand_in_save_adapter)
for step in (1, 2):
    store.save(step, vlft.training.checkpoints.training_state(step, optimizer, scheduler, None, torch.device('cpu')), model)
"""


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_for_resume(tmp_path):
    root = tmp_path / "checkpoints"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (tmp_path / "inside-write").exists(), proc, 60, "the checkpoint write")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-000002", "step-000001"]
    said: list[str] = []
    assert newest_checkpoint(root, report=said.append).name == "step-000001"
    assert said == ["resume: removed the half-written checkpoint folder .tmp-step-000002"]
    model, optimizer, scheduler = tiny_training_state()
    CheckpointStore(root, 2, stand_in_save_adapter).save(
        2, training_state(2, optimizer, scheduler, None, torch.device("cpu")), model
    )
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]


# -- 5. hostile inputs --------------------------------------------------------------------------------


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels in a few bytes (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def record(image: str) -> str:
    return json.dumps(
        {
            "image": image,
            "conversations": [{"from": "user", "value": "<image>\nWhat?"}, {"from": "assistant", "value": "ok"}],
        }
    )


def test_hostile_images_are_data_problems_with_file_and_line(tmp_path, small_data):
    from PIL import Image

    from vlft.data.records import read_records

    good = next(Path(small_data[0]).parent.rglob("*.png"))
    (tmp_path / "bomb.png").write_bytes(png_header_only(20000, 20000))  # 4e8 pixels, over PIL's 8.9e7 limit
    (tmp_path / "over.png").write_bytes(png_header_only(10000, 10000))  # over the limit, under 2x: PIL only warns
    (tmp_path / "cut.png").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    (tmp_path / "dev.png").symlink_to("/dev/zero")
    (tmp_path / "dir.png").symlink_to(tmp_path)
    lines = [record(n) for n in ("bomb.png", "over.png", "cut.png", "dev.png", "dir.png")]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        read_records(tmp_path / "d.jsonl")
    msg = str(e.value)
    assert "5 problem(s)" in msg
    assert "d.jsonl:1: image 'bomb.png' cannot be read (ValueError: image too large" in msg
    assert "d.jsonl:2: image 'over.png' cannot be read (ValueError: image too large" in msg
    assert "d.jsonl:3: image 'cut.png' cannot be read (OSError: image file is truncated" in msg
    assert "d.jsonl:4: image 'dev.png' is a device, pipe or socket (a symlink to /dev/zero)" in msg
    assert "d.jsonl:5: image 'dir.png' is a folder" in msg
    assert Image.MAX_IMAGE_PIXELS == 89478485  # the guard is PIL's own, not loosened


def test_hostile_data_files(tmp_path):
    from vlft.data.records import read_records

    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"empty.jsonl is empty"):
        read_records(tmp_path / "empty.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"a": 1}\n{"b": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at offset 19\)"):
        read_records(tmp_path / "latin1.jsonl")
    # 100,000 bad records: reported in linear time, at most 20 listed
    (tmp_path / "big.json").write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}] * 100_000))
    t0 = time.perf_counter()
    with pytest.raises(DataError) as e:
        read_records(tmp_path / "big.json")
    elapsed = time.perf_counter() - t0
    assert str(e.value).startswith("100000 problem(s)") and "... and 99980 more" in str(e.value)
    assert str(e.value).count("no assistant turn") == 20
    assert elapsed < 30  # a quadratic check would take minutes at this size; the time itself is not measured


def test_hostile_config_and_pickled_weights_exit_non_zero_and_write_nothing(tmp_path, small_data, model_dir):
    from vlft.models.loading import check_weight_format

    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 1\nbackend:\n  - cpu\n")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["run", "--config", str(cfg), "--output", str(out)])
    assert res.exit_code != 0 and f"{cfg}:2: 'backend' expects str, got ['cpu']" in res.output
    assert not out.exists()

    model = tmp_path / "model"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match=r"pytorch_model.bin\) and no .safetensors.*--trust-pickle"):
        check_weight_format(str(model), trust_pickle=False)
    check_weight_format(str(model), trust_pickle=True)
    (model / "model.safetensors").write_bytes(b"")
    check_weight_format(str(model), trust_pickle=False)

    # the whole command: a model folder whose weights are pickled only; vlft run exits non-zero, writes nothing
    import shutil

    pickled = tmp_path / "pickled-model"
    shutil.copytree(model_dir, pickled, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    train, val = small_data
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *vlft_command(),
            "run",
            "--backend",
            "cpu",
            "--model",
            str(pickled),
            "--data",
            str(train),
            "--val-data",
            str(val),
            "--output",
            str(out),
            "--steps",
            "1",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"pytorch_model.bin\) and no .safetensors.*--trust-pickle", proc.stderr.replace("\n", " ")), (
        proc.stderr[-2000:]
    )
    assert not out.exists()

    # --trust-pickle: the same folder holding the model's real weights, pickled (tensors only), trains
    from safetensors.torch import load_file

    weights = {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    torch.save(weights, pickled / "pytorch_model.bin")
    code, output = cli_invoke(
        "run",
        "--quiet",
        "--backend",
        "cpu",
        "--model",
        pickled,
        "--data",
        train,
        "--val-data",
        val,
        "--output",
        out,
        "--steps",
        1,
        "--batch-size",
        2,
        "--eval-every",
        0,
        "--eval-samples",
        0,
        "--save-every",
        0,
        "--trust-pickle",
    )
    assert code == 0, output
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_the_end_of_a_run_saves_first_and_a_failed_evaluation_keeps_the_adapter(
    registry, small_data, tmp_path, monkeypatch, capsys
):
    """The evaluation after training runs out of memory (raised where it starts: a fault injected into the
    real run): by then the adapter and a checkpoint of the last step are written and the AdamW state is
    freed; summary.json says completed, with the error; ``--resume`` then says the run is complete and trains
    nothing."""
    import vlft.commands.run as run

    out = tmp_path / "run"
    trainers, calls, seen = [], [], {}
    real_build, real_eval = run.build_trainer, run.evaluate_generation

    def build_trainer(*args, **kwargs):
        trainers.append(real_build(*args, **kwargs))
        return trainers[-1]

    def evaluation(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 2:  # after training
            seen.update(
                adapter=(out / "adapter" / "adapter_model.safetensors").is_file(),
                checkpoints=sorted(p.name for p in (out / "checkpoints").iterdir()),
                optimizer_state=len(trainers[0].optimizer.state),
            )
            raise torch.OutOfMemoryError("out of memory (injected): tried to allocate 2.00 GiB")
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(run, "build_trainer", build_trainer)
    monkeypatch.setattr(run, "evaluate_generation", evaluation)
    config = dict(steps=4, save_every=3, eval_every=0, eval_samples=2, max_new_tokens=2, batch_size=2)
    run.execute(registry, short_config(small_data, out, **config), progress=False)
    assert seen == {"adapter": True, "checkpoints": ["step-000003", "step-000004"], "optimizer_state": 0}
    assert [c["decoding"].batch_size for c in calls] == [2, 2]  # the training micro-batch, not 16
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["exact_match_after"] is None
    assert summary["eval_error"].startswith("OutOfMemoryError: out of memory (injected)")
    plan = json.loads((out / "plan.json").read_text())
    assert any(n.startswith("evaluation generates in batches of 2") for n in plan["notes"])

    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    result = run.execute(registry, short_config(small_data, out, resume=True, **config), progress=False)
    assert "is complete (4 steps, checkpoint step-000004); nothing to train" in capsys.readouterr().err
    assert len(trainers) == 1 and result.metrics == []  # nothing was set up, nothing trained
    assert (out / "metrics.jsonl").read_text() == metrics


def test_fp16_scaler_back_offs_at_the_start_do_not_stop_the_run_and_a_nan_loss_still_does(
    small_data, tmp_path, monkeypatch
):
    """fp16 on the CPU with a loss scale of 2**28 to start (the backend's 2**16 does not overflow the embedded
    model; 2**28 does, for real, in its fp16 gradients): the scaler backs off step after step, more often than
    --max-skipped-steps, and the run completes; those steps are counted as back-offs, not as skipped steps.
    Then a NaN loss (a patched loss) is not explained by the scaler: it stops the run."""
    import vlft.models.passes
    import vlft.training.step

    class StartsHigh(torch.amp.GradScaler):  # the CPU backend's scaler, started at 2**28
        def __init__(self, device="cpu", init_scale=2.0**16, **kwargs):
            super().__init__(device, init_scale=2.0**28, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", StartsHigh)
    out = tmp_path / "run"
    values = dict(
        precision="fp16", steps=12, max_skipped_steps=3, save_every=0, eval_every=0, eval_samples=1, max_new_tokens=1
    )
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        code, output = cli_invoke("run", "--quiet", *run_flags(short_values(small_data, out, **values)))
    assert code == 0, output
    # a back-off advances the schedule, by design: torch's warning about it would only alarm the user
    assert not [w for w in said if "lr_scheduler.step()" in str(w.message)]
    summary = json.loads((out / "summary.json").read_text())
    metrics = [m for m in read_metrics(out) if "loss" in m]
    assert summary["status"] == "completed" and summary["skipped_steps"] == 0
    assert summary["scaler_backoffs"] > 3  # more than --max-skipped-steps, at the start
    scales = [m["loss_scale"] for m in metrics]
    assert scales[0] <= 2.0**27 and scales[-1] <= 2.0 ** (28 - summary["scaler_backoffs"])  # it backed off
    assert [m["scaler_backoffs"] for m in metrics][-1] == summary["scaler_backoffs"]

    real_loss = vlft.models.passes.batch_loss_sum
    monkeypatch.setattr(vlft.models.passes, "batch_loss_sum", lambda *a, **k: real_loss(*a, **k) * float("nan"))
    code, output = cli_invoke("run", "--quiet", *run_flags(short_values(small_data, tmp_path / "nan", **values)))
    assert code != 0 and "3 consecutive steps" in output, output


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_state_is_loaded_without_running_pickled_code(registry, small_data, tmp_path, straight_run):
    """state.pt is read with ``weights_only=True``: a real checkpoint restores (the RNG state included), and a
    state.pt carrying an object that runs code when unpickled is refused before that code runs."""
    from vlft.training.trainer import build_trainer

    checkpoint = straight_run / "checkpoints" / "step-000008"
    s = build_trainer(registry, short_config(small_data, tmp_path / "unused", steps=8, save_every=4, eval_every=0))
    s.load_checkpoint(checkpoint)
    assert s.step == 8
    assert s.optimizer.state  # the AdamW moments came back

    marker = tmp_path / "code-ran"
    hostile = tmp_path / "step-000001"
    hostile.mkdir()
    state = torch.load(checkpoint / "state.pt", weights_only=False)  # the test's own file, to copy from
    torch.save({**state, "extra": _RunsCodeWhenUnpickled(marker)}, hostile / "state.pt")
    with pytest.raises(VlftError, match="state.pt .* not only tensors and plain values"):
        s.load_checkpoint(hostile)
    assert not marker.exists()
