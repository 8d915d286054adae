"""Several processes on the CPU with gloo, data parallel and sharded (``--shard fsdp``, torch FSDP2).

Both give the training of one process with the same global batch. Sharded: evaluation gives the unsharded
answers, the saved adapter loads with plain PEFT and gives the sharded model's logits, two torchrun agents
resume a run exactly, each process holds its share of the weights (and reads only its share: no process
loads the whole checkpoint), rank 0 reading the checkpoint for all (with CPU offload) trains the same, and a
backend that does not offer sharding is refused before any process group starts.

The tests share four runs of 10 steps: one process of batch 4; 2 data-parallel processes of batch 2
(started with plain ``torchrun -m vlft run``); 2 sharded processes of batch 2 (``vlft run --nproc-per-node 2
--shard fsdp``, checkpoint at step 5, activation checkpointing on), each reading its own shares; the same
with rank 0 reading the checkpoint for all and ``--offload cpu``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import base_model, run_flags, vlft_command
from vlft.config import build_config

HERE = Path(__file__).resolve().parent
STEPS = 10


def _values(small_data, out, **over) -> dict:
    train, val = small_data
    values = dict(
        backend="cpu",
        method="lora",
        data=str(train),
        val_data=str(val),
        output=str(out),
        steps=STEPS,
        batch_size=4,
        log_every=1,
        eval_every=0,
        eval_samples=3,
        max_new_tokens=4,
        save_every=5,
        seed=5,
        lr=2e-3,
        warmup_ratio=0.0,
        adapter={"lora_dropout": 0.0},
    )
    values.update(over)
    return values


def _metrics(out: Path) -> list[dict]:
    """The logged steps (the lines with a loss; checkpoint and evaluation timings have lines of their own)."""
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def _adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


# Two fp32 trainings that differ in summation order (2 processes against 1) end with adapters that differ
# element by element in a way no tolerance bounds usefully: AdamW divides each gradient element by its own
# running scale, so an element whose gradient is near the rounding noise (~2^-24 of the terms summed into it)
# moves by up to the learning rate in either direction, step after step (seen: one element of 4,096 1.15e-5
# apart after 10 steps on an AMD EPYC, within 1e-5 on an Intel Xeon). A real error (a gradient not averaged,
# a process's shard lost) moves every element: each tensor is compared as a whole, its difference against its
# own size, at 1e-4 (the rounding-noise elements are a few per thousand, each at most 10 steps x lr apart).
WEIGHTS_RTOL = 1e-4


def _same_weights(wa: dict, wb: dict) -> None:
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wb[k].shape == wa[k].shape, k
        apart, size = (wb[k].double() - wa[k].double()).norm().item(), wa[k].double().norm().item()
        assert apart <= WEIGHTS_RTOL * size, (k, apart, size)


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def unsharded(small_data, tmp_path_factory) -> Path:
    from vlft.commands.run import execute
    from vlft.registry import get_registry

    out = tmp_path_factory.mktemp("unsharded") / "run"
    execute(get_registry(), build_config({}, _values(small_data, out, save_every=0)), progress=False)
    return out


@pytest.fixture(scope="module")
def sharded_values(small_data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded") / "run"
    return _values(small_data, out, batch_size=2, shard="fsdp", grad_checkpointing="on")


@pytest.fixture(scope="module")
def sharded(sharded_values) -> Path:
    proc = subprocess.run(
        [*vlft_command(), "run", "--nproc-per-node", "2", "--quiet", *run_flags(sharded_values)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(sharded_values["output"])


@pytest.fixture(scope="module")
def data_parallel(small_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "run"
    script = Path(sys.executable).with_name("torchrun")
    torchrun = [str(script)] if script.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    values = _values(small_data, out, batch_size=2, save_every=0)
    proc = subprocess.run(
        [*torchrun, "--standalone", "--nproc-per-node", "2", "-m", "vlft", "run", "--quiet", *run_flags(values)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_two_data_parallel_processes_started_by_torchrun_train_as_one_process(unsharded, data_parallel):
    """``torchrun -m vlft run``: 2 processes of batch 2 against 1 of batch 4. LoRA dropout is off: each
    process draws its own dropout masks, which no data-parallel split can match."""
    config = json.loads((data_parallel / "config.json").read_text())
    assert (config["world_size"], config["rank"], config["shard"]) == (2, 0, "none")  # written by rank 0 of two
    a, b = _metrics(unsharded), _metrics(data_parallel)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, STEPS + 1))  # one writer: rank 0
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), (x, y)
    _same_weights(_adapter(unsharded / "adapter"), _adapter(data_parallel / "adapter"))
    assert a[-1]["loss"] < a[0]["loss"] - 1  # the adapter moved: not two untouched initialisations
    assert json.loads((data_parallel / "summary.json").read_text())["sharding"] is None


def test_two_sharded_processes_train_as_one_process_with_the_same_global_batch(unsharded, sharded):
    """Losses, gradient norms (clipped over the sharded gradients) and the saved adapter against one
    unsharded process: this also proves FSDP's gradient reduction on gloo averages, not sums."""
    a, b = _metrics(unsharded), _metrics(sharded)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), (x, y)
    wb = _adapter(sharded / "adapter")
    assert all(v.dtype == torch.float32 for v in wb.values())
    _same_weights(_adapter(unsharded / "adapter"), wb)
    assert a[-1]["loss"] < a[0]["loss"] - 1  # the adapter moved: not two untouched initialisations
    plan = json.loads((sharded / "plan.json").read_text())
    assert plan["sharding"]["strategy"] == "fsdp" and plan["sharding"]["world_size"] == 2
    assert plan["sharding"]["wrapped"] == {"Qwen2_5_VLVisionBlock": 8, "Qwen2_5_VLDecoderLayer": 2}


def test_sharded_gradient_accumulation_trains_as_one_process(unsharded, sharded_values, tmp_path):
    """2 sharded processes x batch 1 x 2 micro-batches against 1 process x batch 4: the unreduced gradients
    of the first micro-batch (set_requires_gradient_sync off) must add up with the last one's."""
    values = {
        **sharded_values,
        "output": str(tmp_path / "run"),
        "batch_size": 1,
        "grad_accum": 2,
        "save_every": 0,
        "eval_samples": 1,
        "max_new_tokens": 1,
        "grad_checkpointing": "off",
    }
    proc = subprocess.run(
        [*vlft_command(), "run", "--nproc-per-node", "2", "--quiet", *run_flags(values)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _metrics(unsharded), _metrics(tmp_path / "run")
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), (x, y)


@pytest.fixture(scope="module")
def rank0_offloaded(sharded_values, tmp_path_factory) -> Path:
    """The sharded run again with rank 0 reading the whole checkpoint (``--shard-loading rank0``) and FSDP2's
    CPU offload (``--offload cpu``), without checkpoints and with the shortest evaluation."""
    out = tmp_path_factory.mktemp("rank0-offload") / "run"
    values = {
        **sharded_values,
        "output": str(out),
        "shard_loading": "rank0",
        "offload": "cpu",
        "save_every": 0,
        "eval_samples": 1,
        "max_new_tokens": 1,
    }
    proc = subprocess.run(
        [*vlft_command(), "run", "--nproc-per-node", "2", "--quiet", *run_flags(values)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_each_process_reading_its_own_shares_trains_as_rank_0_reading_them_all(sharded, rank0_offloaded):
    """The same 2-process sharded run, its base weights read two ways (each process its own ranges of the
    safetensors files, under the names transformers' conversion mapping gives them; rank 0 the whole checkpoint,
    sent out), the second also with --offload cpu: the same loss and gradient norm at every step. The rotary
    buffers the checkpoint does not hold are computed by each process as from_pretrained computes them."""
    each, rank0 = (json.loads((run / "plan.json").read_text())["sharding"] for run in (sharded, rank0_offloaded))
    assert (each["loading"], each["offload"]) == ("each", "none"), each
    assert (rank0["loading"], rank0["offload"], rank0["loading_reason"]) == ("rank0", "cpu", "--shard-loading rank0")
    a, b = _metrics(sharded), _metrics(rank0_offloaded)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)
    _same_weights(_adapter(sharded / "adapter"), _adapter(rank0_offloaded / "adapter"))


def test_offload_and_shard_loading_need_shard_fsdp(small_data, tmp_path):
    from vlft.errors import ConfigError

    with pytest.raises(ConfigError, match="--offload cpu needs --shard fsdp"):
        build_config({}, _values(small_data, tmp_path / "out", offload="cpu"))
    with pytest.raises(ConfigError, match="--shard-loading rank0 needs --shard fsdp"):
        build_config({}, _values(small_data, tmp_path / "out", shard_loading="rank0"))


def test_a_folder_without_safetensors_is_read_by_rank_0_with_the_reason(tmp_path):
    from vlft.models.loading import SharesUnreadable, checkpoint_names

    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SharesUnreadable, match="is not a folder of .safetensors files"):
        checkpoint_names(str(tmp_path), torch.nn.Linear(2, 2))


def test_evaluation_under_sharding_gives_the_unsharded_answers(unsharded, sharded):
    """3 validation records over 2 processes: one process pads its share, and decoding stays in step."""
    a = json.loads((unsharded / "eval.json").read_text())
    b = json.loads((sharded / "eval.json").read_text())
    for when in ("before", "after"):
        assert b[when]["samples"] == a[when]["samples"] == 3
        assert [e["prediction"] for e in b[when]["examples"]] == [e["prediction"] for e in a[when]["examples"]]
        assert b[when]["exact_match"] == a[when]["exact_match"]


def test_each_process_holds_half_of_the_base_weights(sharded):
    """Measured on each process's tensors after sharding (summary.json), not computed from the config."""
    s = json.loads((sharded / "summary.json").read_text())["sharding"]
    whole, per = s["base_bytes_whole"], s["base_bytes_per_process"]
    assert len(per) == 2 and sum(per) == whole
    for held in per:
        assert held == pytest.approx(whole / 2, rel=0.02)


def test_the_adapter_of_a_sharded_model_loads_with_plain_peft_and_gives_its_logits(
    sharded, sharded_values, model_dir, tmp_path
):
    """A worker shards the model of the step-5 checkpoint over 2 processes (no process may load the whole
    checkpoint: each reads its own shares), takes its logits and saves its adapter through the sharded path;
    plain ``PeftModel.from_pretrained`` on one process must agree."""
    from peft import PeftModel

    from vlft.data.batching import model_inputs

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**sharded_values, "output": str(tmp_path / "unused")}))
    checkpoint = sharded / "checkpoints" / "step-000005"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(HERE / "fsdp_worker.py"),
            str(config),
            str(checkpoint),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "sharded.pt", weights_only=False)
    # then a step with NaN pixels: skipped, and rank 0's shards of adapter and AdamW state untouched
    assert got["skip"]["skipped"] and got["skip"]["unchanged"] and got["skip"]["state_tensors"] > 0, got["skip"]
    saved, step5 = _adapter(tmp_path / "adapter"), _adapter(checkpoint / "adapter")
    assert saved.keys() == step5.keys() and all(torch.equal(saved[k], step5[k]) for k in saved)
    model = PeftModel.from_pretrained(base_model(model_dir), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        logits = model(**model_inputs(got["batch"])).logits
    torch.testing.assert_close(logits, got["logits"], rtol=1e-5, atol=1e-5)
    with torch.no_grad(), model.disable_adapter():  # the adapter matters: the comparison is not of base models
        assert not torch.allclose(model(**model_inputs(got["batch"])).logits, got["logits"], atol=1e-3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_resume_a_sharded_run_with_the_uninterrupted_losses(sharded, sharded_values, tmp_path):
    """The run is cut back to its step-5 checkpoint and continued with --resume by two torchrun agents
    (--nnodes 2, one process each, rendezvous on localhost): one job, the same losses as without the cut."""
    out = tmp_path / "run"
    shutil.copytree(sharded, out)
    for name in ("adapter", "summary.json", "eval.json", f"checkpoints/step-{STEPS:06d}"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000005"]
    port = _free_port()
    args = [
        *vlft_command(),
        "run",
        "--quiet",
        "--resume",
        *run_flags({**sharded_values, "output": str(out)}),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    agents = [
        subprocess.Popen(
            [*args, "--node-rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )
        for r in (0, 1)
    ]
    try:
        results = [a.communicate(timeout=600) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert "resumed      from step 5" in results[0][1]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    resumed, straight = _metrics(out), _metrics(sharded)
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    for x, y in zip(straight, resumed):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6), (x, y)
    wa, wb = _adapter(sharded / "adapter"), _adapter(out / "adapter")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-7)


def test_a_sharded_checkpoint_is_not_resumed_without_sharding(sharded):
    from vlft.errors import VlftError
    from vlft.training.checkpoints import read_checkpoint

    with pytest.raises(VlftError, match="was written with --shard fsdp; resume it with --shard fsdp"):
        read_checkpoint(sharded / "checkpoints" / "step-000005", sharded=False)


def test_a_backend_without_sharding_is_refused_before_any_process_group(small_data, tmp_path):
    """ToyPlugin's backend answers DistributedOptions("gloo") and says nothing of FSDP."""
    from test_run import ToyPlugin
    from vlft.builtin.commands import check_sharding
    from vlft.commands.run import execute
    from vlft.errors import ConfigError
    from vlft.registry import load_registry

    reg = load_registry(plugins=(ToyPlugin(),))
    config = build_config({}, _values(small_data, tmp_path / "out", backend="toycpu", shard="fsdp"))
    with pytest.raises(ConfigError, match="backend toycpu does not support sharded training"):
        check_sharding(reg, config)  # what `vlft run --nproc-per-node N` asks before torchrun starts
    with pytest.raises(ConfigError, match="backend toycpu does not support sharded training"):
        execute(reg, config, progress=False)
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "out").exists()


def test_the_report_says_how_the_processes_held_the_model(data_parallel, sharded):
    from vlft.commands.report import read_run, table_rows

    header, rows = table_rows([read_run(data_parallel, "ddp"), read_run(sharded, "fsdp")])
    device = header.index("device")
    assert [row[device] for row in rows] == ["cpu x1 (2 processes)", "cpu x1 (2 processes, FSDP)"]


MIXED_STEPS = 3


@pytest.fixture(scope="module")
def mixed_data(small_data, tmp_path_factory) -> tuple[Path, Path]:
    """16 records of the demo set, where the records each process draws are chosen (from the sampler's
    order) so that rank 1 is text-only at steps 1 and 3 and rank 0 at step 2, beside the other's images."""
    from vlft.data.order import EpochSampler

    train, val = small_data
    records = [json.loads(x) for x in train.read_text().splitlines()][:16]
    text_only = set()
    for rank in (0, 1):
        order = EpochSampler(len(records), 5, 0, rank, 2).indices()  # seed 5 as _values, batch 2 per process
        for step in (1, 3) if rank == 1 else (2,):
            text_only.update(order[(step - 1) * 2 : step * 2])
    for i in text_only:
        rec = records[i]
        del rec["image"]
        rec["conversations"][0]["value"] = rec["conversations"][0]["value"].replace("<image>\n", "")
    out = tmp_path_factory.mktemp("mixed")
    (out / "imgs").symlink_to(train.parent / "imgs")
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out / "train.jsonl", val


@pytest.fixture(scope="module")
def mixed_reference(mixed_data, tmp_path_factory) -> Path:
    from vlft.commands.run import execute
    from vlft.registry import get_registry

    out = tmp_path_factory.mktemp("mixed-one") / "run"
    execute(
        get_registry(),
        build_config({}, _values(mixed_data, out, steps=MIXED_STEPS, save_every=0, eval_samples=1, max_new_tokens=1)),
        progress=False,
    )
    return out


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_text_only_batches_beside_image_batches_train_as_one_process(mixed_data, mixed_reference, shard, tmp_path):
    """One process's batch has no image while the other's has: every process still runs the vision tower
    (a dummy image whose output counts 0), so DDP finds no unused parameter, FSDP gathers the same blocks on
    every process, and the losses are those of one process with the same global batch."""
    out = tmp_path / "run"
    values = _values(
        mixed_data, out, batch_size=2, steps=MIXED_STEPS, save_every=0, eval_samples=1, max_new_tokens=1, shard=shard
    )
    proc = subprocess.run(
        [*vlft_command(), "run", "--nproc-per-node", "2", "--quiet", *run_flags(values)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _metrics(mixed_reference), _metrics(out)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, MIXED_STEPS + 1))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), (x, y)
