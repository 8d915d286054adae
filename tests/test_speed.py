"""Throughput work of issue 21: logits at labelled positions only, the guard without copies, no blocking syncs
of vlft's own under torchrun, a preflight that scales, readable throughput, length-grouped batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import embedded_family, installed
from test_memory import _cfg


@pytest.fixture(scope="module")
def session(small_data, tmp_path_factory):
    from vlft.registry import load_registry
    from vlft.training.trainer import build_trainer

    return build_trainer(load_registry(), _cfg(small_data, tmp_path_factory.mktemp("speed") / "r", batch_size=3))


def _loss_and_grads(s, host, labels_only: bool):
    from vlft.data.batching import model_inputs, to_device, with_label_positions
    from vlft.models.loss import batch_loss_sum

    s.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the adapter's dropout draws the same masks on both paths
    batch = to_device(with_label_positions(host) if labels_only else host, s.device)
    loss = batch_loss_sum(s.model, model_inputs(batch), batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in s.model.named_parameters() if p.requires_grad}
    s.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# -- 3. logits only where labels are ----------------------------------------------------------------


def test_label_positions_point_at_the_logits_that_predict_labels():
    from vlft.data.batching import label_positions
    from vlft.data.records import IGNORE_INDEX as X

    labels = torch.tensor([[X, X, 5, 6, X, 7], [X, 8, X, X, X, X]])
    positions, targets = label_positions(labels)
    # the logit at position t predicts label t + 1; the short row is filled with ignored targets
    assert positions[0].tolist() == [1, 2, 4]
    assert targets[0].tolist() == [5, 6, 7]
    assert positions[1, 0] == 0 and targets[1].tolist() == [8, X, X]


def test_labels_only_head_gives_the_full_heads_loss_and_gradients(session):
    s = session
    s.model.train()
    host = s.collate([s.dataset[i] for i in range(3)])
    assert host["labels"].shape[1] > 2 * int((host["labels"] != -100).sum(1).max())  # most positions unlabelled
    full_loss, full_grads = _loss_and_grads(s, host, labels_only=False)
    kept_loss, kept_grads = _loss_and_grads(s, host, labels_only=True)
    torch.testing.assert_close(kept_loss, full_loss, rtol=1e-6, atol=0)
    assert full_grads.keys() == kept_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(kept_grads[name], full_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_model_returns_logits_at_the_kept_positions_only(session):
    from vlft.data.batching import model_inputs, with_label_positions

    s = session
    host = with_label_positions(s.collate([s.dataset[i] for i in range(3)]))
    with torch.no_grad():
        logits = s.model(**model_inputs(host), logits_to_keep=host["logit_positions"]).logits
    assert logits.shape[:2] == host["kept_labels"].shape
    assert logits.shape[1] < host["labels"].shape[1]


def test_the_memory_plan_counts_the_logits_at_labelled_positions_only(session, registry, small_data, tmp_path):
    from vlft.data.batching import label_positions, model_inputs, with_label_positions
    from vlft.measure import SavedTensorMeter
    from vlft.models.loss import batch_loss_sum
    from vlft.planning.memory import MemoryBasis, plan_memory
    from vlft.planning.preflight import plan_run, plan_targets
    from vlft.planning.trace import BatchShape, skeleton

    plan = plan_run(registry, _cfg(small_data, tmp_path / "r", batch_size=3))
    s = session
    host = with_label_positions(s.collate([s.dataset[i] for i in range(4)]))
    kept = label_positions(host["labels"])[0].shape[1]
    grids = [tuple(g) for g in host["image_grid_thw"].tolist()]
    tokens = host["input_ids"].shape[1]
    sk, _ = plan_targets(registry, plan, skeleton(plan.model_config, plan.attention, torch.float32))
    basis = MemoryBasis(sk, plan.model_config, "float32", None, plan.family)
    full = plan_memory(basis, BatchShape(4, tokens, grids))
    only = plan_memory(basis, BatchShape(4, tokens, grids, kept))
    assert only.logits_bytes * tokens == full.logits_bytes * kept
    meter = SavedTensorMeter(s.model)
    s.model.train()
    with meter.hooks():
        batch_loss_sum(s.model, model_inputs(host), host)
    assert only.activations.full < full.activations.full
    assert only.activations.full == pytest.approx(meter.bytes, rel=0.02)


def test_sample_lengths_report_each_samples_label_tokens(session):
    from vlft.data.batching import label_count
    from vlft.data.lengths import check_lengths

    s = session
    records = s.plan.train_records[:5]
    _, report = check_lengths(records, s.plan.encoder, None, False)
    assert report.labelled == [label_count(s.collate([s.dataset[i]])) for i in range(5)]


# -- 4. the non-finite guard without copies ---------------------------------------------------------


def _adamw(fused: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, **({"fused": True} if fused else {}))
    return model, opt


def _grads(model, value=None):
    model.zero_grad()
    model(torch.ones(2, 6)).sum().backward()
    if value is not None:
        model.weight.grad[0, 0] = value


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_the_fused_guard_skips_a_non_finite_step_on_the_device_and_copies_nothing(bad):
    from vlft.measure import CopiedBytes
    from vlft.training.step import fused_guarded_step

    model, opt = _adamw(fused=True)
    _grads(model)
    fused_guarded_step(opt, torch.tensor(True))  # one good step: state exists
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    assert float(state["step"]) == 1
    _grads(model, bad)
    with CopiedBytes() as copied:
        fused_guarded_step(opt, torch.isfinite(model.weight.grad).all())
    assert copied.bytes == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in opt.state[model.weight].items():
        assert torch.equal(v, state[k]), k  # moments and the step counter: skipped steps do not count
    assert not hasattr(opt, "found_inf")
    _grads(model)
    fused_guarded_step(opt, torch.tensor(True))
    assert float(opt.state[model.weight]["step"]) == 2


def test_the_fused_guards_good_steps_are_adamws_own():
    from vlft.training.step import fused_guarded_step

    (m1, o1), (m2, o2) = _adamw(fused=True), _adamw(fused=True)
    for _ in range(3):
        _grads(m1), _grads(m2)
        o1.step()
        fused_guarded_step(o2, torch.tensor(True))
    for k, v in m1.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k


def test_the_copying_guard_copies_the_adapter_and_its_state_and_keeps_the_counter_exact():
    from vlft.measure import CopiedBytes
    from vlft.training.step import guarded_step

    model, opt = _adamw(fused=False)
    _grads(model)
    opt.step()
    _grads(model, float("inf"))
    with CopiedBytes() as copied:
        guarded_step(opt, torch.isfinite(model.weight.grad).all())
    n = sum(p.numel() for p in model.parameters())
    assert copied.bytes >= (4 + 8) * n * 2  # cloned before the step, restored after
    assert float(opt.state[model.weight]["step"]) == 1


def test_a_step_as_on_a_device_with_fused_adamw_skips_without_counting_the_step(session):
    from dataclasses import replace

    from vlft.training.step import cosine_with_warmup, train_step_on

    s = session
    assert s.plan.precision.fused_optimizer  # the CPU answers yes; its run reads the flag on the host instead
    assert s.policy.flags_on_host and not s.policy.fused_optimizer
    trainable = [p for p in s.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, fused=True)
    scheduler = cosine_with_warmup(optimizer, 0, 100)
    policy = replace(s.policy, flags_on_host=False, fused_optimizer=True)
    host = [s.collate([s.dataset[i] for i in range(3)])]
    out = train_step_on(s.model, optimizer, scheduler, host, policy)
    assert not bool(out.skipped)
    steps = {float(st["step"]) for st in optimizer.state.values()}
    weights = {n: p.detach().clone() for n, p in s.model.named_parameters() if p.requires_grad}
    first = next(p for p in s.model.parameters() if p.requires_grad)
    hook = first.register_hook(lambda g: torch.full_like(g, float("nan")))
    try:
        out = train_step_on(s.model, optimizer, scheduler, host, policy)
    finally:
        hook.remove()
    assert bool(out.skipped)
    assert {float(st["step"]) for st in optimizer.state.values()} == steps == {1.0}
    for n, p in s.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), weights[n]), n


def test_the_memory_plan_counts_the_guards_copy_only_where_fused_adamw_does_not_serve():
    from types import SimpleNamespace as NS

    from vlft.planning.preflight import guard_copies

    def plan(device, fused, scaling=False, sharded=False):
        return NS(
            backend=NS(info=NS(device_type=device)),
            sharding=NS(enabled=sharded),
            precision=NS(fused_optimizer=fused, loss_scaling=scaling),
        )

    from vlft.planning.preflight import fused_optimizer

    assert not guard_copies(plan("cuda", True)) and fused_optimizer(plan("cuda", True))
    assert not fused_optimizer(plan("cpu", True))  # the CPU's flag is read on the host: no copy either way
    assert guard_copies(plan("npu", False))
    assert guard_copies(plan("cuda", True, sharded=True))  # FSDP keeps the default AdamW
    assert not guard_copies(plan("npu", False, scaling=True))  # the scaler skips steps itself
    assert not guard_copies(plan("cpu", False))  # the flag is read on the host


@pytest.mark.parametrize("copies", [False, True])
def test_the_guards_copy_is_in_the_estimate(session, registry, small_data, tmp_path, copies):
    from vlft.planning.memory import MemoryBasis, plan_memory
    from vlft.planning.preflight import plan_run, plan_targets
    from vlft.planning.trace import BatchShape, skeleton

    plan = plan_run(registry, _cfg(small_data, tmp_path / "r", batch_size=3))
    sk, _ = plan_targets(registry, plan, skeleton(plan.model_config, plan.attention, torch.float32))
    shape = BatchShape(1, 64, [], 8)
    bare = plan_memory(MemoryBasis(sk, plan.model_config, "float32", None, plan.family), shape)
    est = plan_memory(MemoryBasis(sk, plan.model_config, "float32", None, plan.family, guard_copy=copies), shape)
    assert est.total_bytes() - bare.total_bytes() == (12 * est.adapter_parameters if copies else 0)
    assert est.describe()["guard_copy_bytes"] == (12 * est.adapter_parameters if copies else 0)


# -- 5. no blocking syncs of vlft's own under torchrun ---------------------------------------------


def _stop_worker(rank, world, init, queue):
    import signal

    from vlft.training.signals import StopRequest
    from vlft.training.step import global_label_count, start_global_label_count

    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        stop, seen = StopRequest(), []
        for step in range(1, 6):
            if rank == 1 and step == 2:
                stop.signum = signal.SIGTERM  # as the handler would set it, on one process only
            pending = start_global_label_count(10 * (rank + 1) + step, world)
            seen.append((step, stop.agreed(world), pending()))
            if seen[-1][1]:
                break
        stop.__exit__(None, None, None)
        queue.put((rank, seen, global_label_count(0, world)))
    finally:
        torch.distributed.destroy_process_group()


def test_the_stop_flag_and_label_counts_are_agreed_on_the_host_one_step_later(tmp_path):
    import signal

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_stop_worker, args=(r, 2, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, seen, empty = queue.get(timeout=120)
        got[rank] = (seen, empty)
    for p in procs:
        p.join(timeout=30)
    assert got[0] == got[1]  # every rank stops at the same step, with the same counts
    seen, empty = got[0]
    # asked during step 2 on rank 1: both ranks act after step 3
    assert [(s, a) for s, a, _ in seen] == [(1, None), (2, None), (3, signal.SIGTERM)]
    assert [n for *_, n in seen] == [10 + 20 + 2 * s for s in (1, 2, 3)]
    assert empty == 1.0  # no label anywhere: never a division by zero


# -- 6. preflight that scales -----------------------------------------------------------------------


@pytest.fixture
def own_data(small_data, tmp_path, monkeypatch):
    """A copy of the small set (its images may be changed) and a cache of checked data of its own."""
    import shutil

    import vlft.planning.checked as checked
    from vlft.data import records

    folder = tmp_path / "data"
    shutil.copytree(small_data[0].parent, folder)
    monkeypatch.setattr(checked, "cache_dir", lambda: tmp_path / "checked")
    monkeypatch.setattr(records, "_CHECKED_IMAGES", {})
    return folder / small_data[0].name, folder / small_data[1].name


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_each_image_is_decoded_once_however_many_records_name_it(own_data, monkeypatch):
    import json

    from vlft.data import records

    train = own_data[0]
    lines = train.read_text().splitlines()
    first = json.loads(lines[0])
    train.write_text("\n".join([json.dumps(first)] * 7 + lines[1:3]) + "\n")
    decoded = _counting(monkeypatch, records, "load_image")
    got = records.read_records(train)
    assert len(got) == 9
    assert len(decoded) == len({s for r in got for s in r.images})


def test_measuring_images_by_size_runs_no_image_processor(model_dir, monkeypatch):
    """The Qwen families size an image by their own formula (``ImageInputs.prepare`` with sizes only): measuring
    runs the image processor not once, and the grids are the processor's own."""
    from vlft import Media
    from vlft.data.encoding import SampleEncoder
    from vlft.models.loading import load_processor

    processor = load_processor(model_dir, embedded_family(), installed())
    ip = processor.image_processor
    expected = {
        size: tuple(int(x) for x in ip(images=[Image.new("RGB", size)], return_tensors="pt")["image_grid_thw"][0])
        for size in ((448, 448), (300, 200))
    }
    calls = _counting(monkeypatch, type(ip), "__call__")
    encoder = SampleEncoder(processor, embedded_family())
    sizes = [(448, 448)] * 5 + [(300, 200)] * 3
    prepared = encoder.family.image_inputs.prepare(processor, Media(sizes), None)
    written = encoder.family.image_inputs.write(processor, ["<|image_pad|>" * len(sizes)], prepared)
    assert written.grids == [expected[(448, 448)]] * 5 + [expected[(300, 200)]] * 3
    assert len(calls) == 0


def test_parallel_measuring_gives_the_serial_answers(session, monkeypatch):
    from vlft.data import lengths

    s = session
    monkeypatch.setattr(lengths, "PARALLEL_FROM", 1)
    serial = lengths.measure_all(s.plan.train_records, s.plan.encoder, workers=1)
    done = []
    parallel = lengths.measure_all(s.plan.train_records, s.plan.encoder, done.append, workers=2)
    assert parallel == serial and sum(done) == len(s.plan.train_records)


FORK_AFTER_TORCH = """
import json, sys
from pathlib import Path
import torch
from PIL import Image
from vlft.data import lengths
from vlft.data.encoding import SampleEncoder
from vlft.data.records import read_records
from vlft.models.embedded import default_family, embedded_model_dir
from vlft.models.loading import load_processor
from vlft.registry import load_registry

folder = Path(sys.argv[1])
Image.new("RGB", (448, 448), (200, 30, 30)).save(folder / "a.jpg")
record = {"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "a dent"}],
          "images": [str(folder / "a.jpg")]}
(folder / "t.jsonl").write_text("\\n".join(json.dumps(record) for _ in range(4)) + "\\n")
records = read_records(folder / "t.jsonl")
registry = load_registry()
family = default_family(registry)
encoder = SampleEncoder(load_processor(str(embedded_model_dir(registry)), family, registry), family)
torch.set_num_threads(2)
torch.ones(1 << 22).mul_(2)  # the parent's OpenMP team exists from here, as after a training step
lengths.PARALLEL_FROM = 1
print(len(lengths.measure_all(records, encoder, workers=2)))
"""


def test_workers_forked_after_torch_ran_in_parallel_do_not_hang(tmp_path):
    """In a process whose OpenMP threads exist (a training step ran, as in the bench), forked measuring workers
    used to wait forever on the first image large enough for torch to fan out. Bounded: a fresh process,
    60 s (it takes about 5)."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "fork_after_torch.py"
    script.write_text(FORK_AFTER_TORCH)
    # its own process group: a hang leaves forked workers behind, killed with it
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("measuring workers forked after a parallel torch op hung (60 s)")
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "4"


def test_the_checked_data_is_reused_while_the_files_are_unchanged(own_data, monkeypatch, tmp_path):
    import os

    from PIL import Image

    from vlft.data.encoding import SampleEncoder
    from vlft.errors import DataError
    from vlft.models.embedded import embedded_model_dir
    from vlft.models.loading import load_processor
    from vlft.planning import preflight

    config = _cfg(own_data, tmp_path / "r")
    encoder = SampleEncoder(
        load_processor(str(embedded_model_dir(installed())), embedded_family(), installed()), embedded_family()
    )
    checks = _counting(monkeypatch, preflight, "_load_and_check_data")
    first = preflight.load_and_check_data(config, encoder)
    again = preflight.load_and_check_data(config, encoder)  # a resume, a later run
    assert len(checks) == 1
    assert [r.where for r in again[0]] == [r.where for r in first[0]] and again[2].lengths == first[2].lengths
    # an image changed on disk: checked again
    image = Path(first[0][0].images[0])
    Image.new("RGB", (64, 48), (1, 2, 3)).save(image)
    changed = preflight.load_and_check_data(config, encoder)
    assert len(checks) == 2 and changed[0][0].image_sizes[0] == (64, 48)
    # a data file changed: checked again
    with open(own_data[0], "a") as f:
        f.write(own_data[0].read_text().splitlines()[0] + "\n")
    assert len(preflight.load_and_check_data(config, encoder)[0]) == len(first[0]) + 1 and len(checks) == 3
    # an image broken in place (same size and time as before): never trained on
    st = image.stat()
    image.write_bytes(b"\0" * st.st_size)
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(DataError, match="cannot be read"):
        preflight.load_and_check_data(config, encoder)


def test_under_torchrun_the_other_processes_take_local_rank_0s_check(own_data, monkeypatch, tmp_path):
    import threading
    from dataclasses import replace

    import vlft.planning.checked as checked
    from vlft.data.encoding import SampleEncoder
    from vlft.models.embedded import embedded_model_dir
    from vlft.models.loading import load_processor
    from vlft.planning import preflight

    config = replace(_cfg(own_data, tmp_path / "r"), world_size=2, rank=1)
    encoder = SampleEncoder(
        load_processor(str(embedded_model_dir(installed())), embedded_family(), installed()), embedded_family()
    )
    monkeypatch.setattr(checked, "POLL_S", 0.05)
    monkeypatch.setenv("LOCAL_RANK", "0")
    result = preflight._load_and_check_data(config, encoder)  # what rank 0 will have found
    monkeypatch.setenv("LOCAL_RANK", "1")
    checks = _counting(monkeypatch, preflight, "_load_and_check_data")
    paths = list(own_data)
    key = checked.cache_key(config, encoder, paths)
    later = threading.Timer(0.5, checked.store, (key, result, checked.media_files([*result[0], *result[1]])))
    later.start()
    got = preflight.load_and_check_data(config, encoder)  # waits for rank 0's entry
    later.join()
    assert not checks and len(got[0]) == len(result[0])
    # rank 0 never writes (a cache it cannot write): after the wait the process checks itself
    monkeypatch.setattr(checked, "WAIT_S", 0.3)
    monkeypatch.setattr(checked, "cache_dir", lambda: tmp_path / "elsewhere")
    preflight.load_and_check_data(config, encoder)
    assert len(checks) == 1


# -- 7. throughput a user can read ------------------------------------------------------------------


def test_throughput_counts_every_position_the_effective_ones_and_the_mfu_where_the_peak_is_known():
    from vlft.training.loop import LoopSettings, throughput

    settings = LoopSettings(total_steps=1, batch_size=1, grad_accum=1, seed=0, world_size=2, processes=2)
    totals = {"positions": 1000.0, "real": 600.0, "labels": 50.0}
    out = throughput(totals, 2.0, settings)
    assert out == {"tokens_per_s": 500.0, "effective_tokens_per_s": 300.0, "label_tokens_per_s": 25.0}
    settings.peak_flops, settings.flops_per_token = 1e12, 4e9
    assert throughput(totals, 2.0, settings)["mfu"] == pytest.approx(300.0 * 4e9 / 2e12)


def test_a_run_logs_tokens_per_second_and_the_report_shows_them(small_data, tmp_path):
    import json

    from vlft.commands.report import read_run, table_rows
    from vlft.commands.run import execute
    from vlft.registry import load_registry

    out = tmp_path / "run"
    execute(load_registry(), _cfg(small_data, out, steps=3, log_every=1), progress=False)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in logged if "loss" in m]
    assert len(logged) == 3
    for m in logged:
        assert m["tokens_per_s"] > m["effective_tokens_per_s"] > m["label_tokens_per_s"] > 0
        assert "mfu" not in m  # the CPU backend knows no peak FLOP/s
        # the samples and the tokens of a window come from the same time
        assert m["tokens_per_s"] / m["samples_per_s"] == pytest.approx(m["tokens_per_s"] * m["step_time_s"] / 4)
    header, rows = table_rows([read_run(out, "run")])
    row = dict(zip(header, rows[0]))
    assert row["tokens/s"] != "-" and row["effective tokens/s"] != "-" and row["MFU"] == "-"


def test_the_cuda_backend_knows_the_peak_of_the_cards_it_lists():
    from vlft_cuda import peak_flops

    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "auto") == 756e12
    assert peak_flops("NVIDIA H200", "fp32") is None and peak_flops("Some Card", "bf16") is None


# -- 2. length-grouped batches ----------------------------------------------------------------------


def _lengths(n=1000, seed=5):
    import random

    rng = random.Random(seed)
    return [rng.randrange(20, 2000) for _ in range(n)]


def test_grouped_order_is_one_shuffle_shared_by_the_processes():
    from vlft.data.order import EpochSampler

    lengths = _lengths()
    n = len(lengths)
    one = EpochSampler(n, 3, 1, lengths=lengths, batch_size=8).indices()
    two = [EpochSampler(n, 3, 1, rank, 2, lengths=lengths, batch_size=4).indices() for rank in range(2)]
    assert sorted(one) == list(range(n))  # every sample once per epoch
    # 2 processes of batch 4 draw exactly the global batches 1 process of batch 8 draws
    for b in range(len(two[0]) // 4):
        assert sorted(one[8 * b : 8 * b + 8]) == sorted(two[0][4 * b : 4 * b + 4] + two[1][4 * b : 4 * b + 4])
    assert EpochSampler(n, 3, 1, lengths=lengths, batch_size=8).indices() == one  # seeded
    assert EpochSampler(n, 4, 1, lengths=lengths, batch_size=8).indices() != one
    assert EpochSampler(n, 3, 2, lengths=lengths, batch_size=8).indices() != one


def test_grouped_batches_pad_less_than_the_plain_shuffle():
    from vlft.data.order import EpochSampler

    lengths = _lengths()

    def padded(order):
        return sum(8 * max(lengths[j] for j in order[i : i + 8]) for i in range(0, len(order) - 7, 8))

    plain = padded(EpochSampler(len(lengths), 0, 0).indices())
    grouped = padded(EpochSampler(len(lengths), 0, 0, lengths=lengths, batch_size=8).indices())
    assert grouped < 0.75 * plain


def test_a_resumed_grouped_run_continues_exactly():
    from vlft.data.order import DataOrder, batches, step_indices

    lengths = _lengths(200)
    settings = DataOrder(batch_size=4, grad_accum=2, seed=7, lengths=lengths)

    def collate(samples):
        return samples

    dataset = list(range(len(lengths)))
    straight = batches(dataset, collate, settings, 0)
    steps = [next(straight) for _ in range(40)]  # more than an epoch (25 steps)
    resumed = batches(dataset, collate, settings, 30)
    assert [next(resumed) for _ in range(10)] == steps[30:]
    for k in (1, 26, 33):  # naming a step's records recomputes the same order
        assert step_indices(len(dataset), settings, k) == [j for b in steps[k - 1] for j in b]


def test_group_by_length_gives_the_sampler_each_training_samples_length(registry, small_data, tmp_path):
    from vlft.training.trainer import build_trainer

    s = build_trainer(registry, _cfg(small_data, tmp_path / "r", group_by_length=True))
    assert s.settings.lengths == [s.plan.encoder.measure(r)[0] for r in s.plan.train_records]
    plain = build_trainer(registry, _cfg(small_data, tmp_path / "p"))
    assert plain.settings.lengths is None


def test_the_loss_reads_each_rows_positions_from_either_transformers_layout():
    """transformers 5.2x gives ``logits_to_keep=[B, P]`` positions as [B, P, V] (each row its own); the 5.17
    of a device machine indexes ``hidden[:, positions]`` and gives [B, B, P, V] (found by the device
    rehearsal). Both give the full head's loss. Stand-in models serve the two layouts from one logits tensor."""
    from types import SimpleNamespace

    from vlft.data.batching import with_label_positions
    from vlft.models.loss import batch_loss_sum, token_loss_sum

    torch.manual_seed(0)
    full = torch.randn(3, 9, 11)
    labels = torch.full((3, 9), -100)
    labels[0, 5:8], labels[1, 2:4], labels[2, 7:9] = 1, 2, 3
    batch = with_label_positions({"labels": labels})

    class NewLayout(torch.nn.Module):  # stand-in: a model of the installed transformers' behaviour
        def forward(self, logits_to_keep=None):
            return SimpleNamespace(logits=torch.stack([full[b, logits_to_keep[b]] for b in range(len(full))]))

    class OldLayout(torch.nn.Module):  # stand-in: hidden[:, positions] with the [B, P] positions as one index
        def forward(self, logits_to_keep=None):
            return SimpleNamespace(logits=full[:, logits_to_keep])

    want = token_loss_sum(full, labels)
    assert OldLayout()(batch["logit_positions"]).logits.dim() == 4
    for model in (NewLayout(), OldLayout()):
        torch.testing.assert_close(batch_loss_sum(model, {}, batch), want)


def test_the_sampler_draws_the_seeded_shuffle_from_an_array_not_a_list_per_epoch():
    """The epoch's order is an int64 array (a list of Python ints holds 36 bytes a sample for the epoch: at a
    million rows more than the rows' places); iterating it, its length and ``indices()`` are the seeded
    shuffle's share as the list gave it, for every rank, offset and with --group-by-length."""
    import numpy as np

    from vlft.data.order import EpochSampler

    lengths = _lengths(n=103)
    for n, world, start, grouped in [(103, 1, 0, False), (103, 2, 5, False), (103, 3, 7, True), (10, 4, 0, False)]:
        for rank in range(world):
            s = EpochSampler(n, 7, 2, rank, world, start=start, lengths=lengths[:n] if grouped else None, batch_size=2)
            assert isinstance(s.order(), np.ndarray) and s.order().dtype == np.int64
            assert list(s) == s.indices() and len(s) == len(s.indices())
            if not grouped:
                usable = n - n % world
                shuffle = torch.randperm(n, generator=torch.Generator().manual_seed(7 + 2)).tolist()
                assert s.indices() == shuffle[rank:usable:world][start:]
