"""Group ``memory``: peak memory of one training step with fp32 against bf16 base weights and with
activation checkpointing on against off, each beside the memory plan's estimate.

Every variant is a real ``vlft.run.prepare`` (the plan, the memory plan, the model in its parameter
dtype, checkpointing switched on through transformers) on a data set of exactly one batch: the
``BATCH_SIZE`` longest records of the mixed-length set, so the plan's "largest batch" is the batch
measured. The estimate compared is the plan's total less the runtime reserve (which no tensor
meter sees). Peak memory is measured, not counted: see ``bench.support.memory.measured_step_peak``.

Figures: bf16/fp32 peak (target <= 0.6 on the wide model), checkpointing on/off step memory above
the resident weights and optimizer state (target <= 0.5 on the wide model), estimate/measured for
every variant (target within +-20%), and the step-time cost of checkpointing.
"""

from __future__ import annotations

import json

import pytest

from bench.support.env import BATCH_SIZE
from bench.support.figures import figure, record
from bench.support.memory import measured_step_peak
from bench.support.timing import Interleaved

VARIANTS = {"fp32": ("fp32", "off"), "fp32+ckpt": ("fp32", "on"), "bf16": ("bf16", "off"), "bf16+ckpt": ("bf16", "on")}


# (size, attention): the backend's default everywhere, and SDPA on the wide model too, since eager
# attention keeps its softmax in fp32 whatever the compute dtype (transformers' eager path, by design)
CASES = [("embedded", None), ("wide", None), ("wide", "sdpa"), ("large", None), ("qwen3-vl", None)]


@pytest.fixture(params=CASES, ids=[f"{s}-{a or 'default'}" for s, a in CASES])
def mem_case(request):
    size, attn = request.param
    # decided before the size's model is built: under `make test` only the embedded model runs
    disabled = request.config.getoption("benchmark_disable") and not request.config.getoption("benchmark_enable")
    if disabled and size != "embedded":
        pytest.skip("under --benchmark-disable the memory group runs on the embedded model only")
    if size == "large" and not request.config.getoption("--bench-large"):
        pytest.skip("on request (--bench-large): the large model would take make bench past its 15 minutes on 2 cores")
    return request.getfixturevalue(f"{size.replace('-', '_')}_size"), attn


@pytest.fixture(scope="session")
def longest_batch_data(mixed_records, mixed_data, tmp_path_factory, embedded_size):
    """The mixed set's ``BATCH_SIZE`` longest records (by the embedded tokenizer), written as one JSONL."""
    lengths = sorted(((embedded_size.encoder.measure(r)[0], i) for i, r in enumerate(mixed_records)), reverse=True)
    keep = {i for _, i in lengths[:BATCH_SIZE]}
    lines = [line for i, line in enumerate(mixed_data.read_text().splitlines()) if i in keep]
    out = mixed_data.parent / "longest-batch.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def _session(env, size, data, tmp_path, param_dtype, ckpt, attn):
    from vlft.training.trainer import build_trainer

    precision = env.asked_precision if param_dtype in ("bf16", "nf4") else "fp32"
    config = env.config(
        model=size.path,
        data=str(data),
        val_data=str(data),
        output=str(tmp_path / "unused"),
        steps=2,
        param_dtype=param_dtype,
        grad_checkpointing=ckpt,
        precision=precision,
        warmup_ratio=0.0,
        attn=attn,
    )
    return build_trainer(env.registry, config)


@pytest.mark.benchmark(group="memory")
def test_memory(benchmark, env, mem_case, longest_batch_data, tmp_path):
    mem_size, attn = mem_case
    from vlft.training.step import train_step_on

    sessions, groups = {}, {}
    for name, (dtype, ckpt) in VARIANTS.items():
        s = _session(env, mem_size, longest_batch_data, tmp_path / name, dtype, ckpt, attn)
        s.model.train()
        groups[name] = next(s.batches())
        s.train_step(groups[name])  # AdamW state exists from here
        sessions[name] = s

    memory = {}
    for name, s in sessions.items():
        m = measured_step_peak(env, s, groups[name])
        plan = s.plan.memory
        m["estimate_bytes"] = plan.total_bytes() - plan.reserved_bytes
        m["estimate/measured"] = m["estimate_bytes"] / m["peak_bytes"]
        m["batch"] = plan.batch.describe()
        memory[name] = m

    # the figures here are memory; a few rounds time checkpointing's cost in fp32 (one on the slow large model),
    # the one time figure: timing the bf16 variants too doubled the wide model's share of make bench
    timed = ("fp32", "fp32+ckpt")
    timer = Interleaved(
        env,
        {
            name: (
                lambda s=sessions[name], g=groups[name]: train_step_on(s.model, s.optimizer, s.scheduler, g, s.policy)
            )
            for name in timed
        },
    )
    timer.run(benchmark, rounds=1 if mem_size.name == "large" else 3)

    wide = mem_size.name == "wide"
    errors = [abs(m["estimate/measured"] - 1) for m in memory.values()]
    figures = {
        "bf16/fp32 peak": figure(
            memory["bf16"]["peak_bytes"] / memory["fp32"]["peak_bytes"], "<= 0.6" if wide else None
        ),
        "ckpt on/off step memory (fp32)": figure(
            memory["fp32+ckpt"]["step_bytes"] / memory["fp32"]["step_bytes"], "<= 0.5" if wide else None
        ),
        "ckpt on/off step memory (bf16)": figure(memory["bf16+ckpt"]["step_bytes"] / memory["bf16"]["step_bytes"]),
        "worst |estimate/measured - 1|": figure(max(errors), "<= 0.2"),
        "ckpt on/off step time (fp32)": timer.ratio_figure("fp32+ckpt", "fp32"),
    }
    for name, m in memory.items():
        figures[f"estimate/measured {name}"] = figure(m["estimate/measured"])
    attention = sessions["fp32"].plan.attention
    figures = {f"{k} [{attention.text} attention]": v for k, v in figures.items()}
    record(
        benchmark,
        env,
        mem_size,
        "memory",
        figures,
        timer.summary({n: BATCH_SIZE for n in timed}),
        memory,
        notes=[
            "estimate: the memory plan's total less its runtime reserve, for exactly the batch measured",
            "step memory: the peak above the resident weights and optimizer state",
        ],
        batch=json.loads(json.dumps(memory["fp32"]["batch"])),
    )


# -- 4-bit base weights (QLoRA) ------------------------------------------------------------------------

NF4_VARIANTS = {"bf16": ("bf16", "off"), "nf4": ("nf4", "off"), "nf4+ckpt": ("nf4", "on")}


@pytest.fixture(params=["embedded", "wide"])
def nf4_size(request):
    disabled = request.config.getoption("benchmark_disable") and not request.config.getoption("benchmark_enable")
    if disabled and request.param != "embedded":
        pytest.skip("under --benchmark-disable the memory group runs on the embedded model only")
    if request.param == "wide" and not request.config.getoption("--bench-large"):
        pytest.skip(
            "on request (--bench-large): nf4 on the wide model took 557 s of make bench (bitsandbytes' "
            "4-bit matmuls on the CPU), past its 15 minutes on 2 cores"
        )
    try:
        import bitsandbytes  # noqa: F401 - where it is importable, 4-bit loading runs
    except ImportError:
        pytest.skip("bitsandbytes is not importable; `make bench` runs this with .venv/qlora-site on PYTHONPATH")
    return request.getfixturevalue(f"{request.param}_size")


def _four_bit_constants(model) -> list:
    """bitsandbytes' per-block scales (and their nested scales) of every 4-bit weight: resident like the
    packed weights, but held by each weight's quant_state, not as parameters."""
    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            out += [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else [])
    return out


@pytest.mark.benchmark(group="memory")
def test_memory_nf4(benchmark, env, nf4_size, longest_batch_data, tmp_path):
    """nf4 against bf16 base weights: peak of one step, each beside the plan's estimate."""
    from vlft.measure import LiveTensorMeter
    from vlft.training.step import train_step_on

    sessions, groups = {}, {}
    for name, (dtype, ckpt) in NF4_VARIANTS.items():
        s = _session(env, nf4_size, longest_batch_data, tmp_path / name, dtype, ckpt, None)
        s.model.train()
        groups[name] = next(s.batches())
        s.train_step(groups[name])
        sessions[name] = s

    memory = {}
    for name, s in sessions.items():
        if env.device_module() is None:  # the CPU meter, with the 4-bit scales counted as resident
            resident = [
                *s.model.parameters(),
                *s.model.buffers(),
                *_four_bit_constants(s.model),
                *(v for st in s.optimizer.state.values() for v in st.values()),
            ]
            with LiveTensorMeter(resident) as meter:
                s.train_step(groups[name])
            m = {
                "measure": "live tensor storages, followed through the dispatcher",
                "peak_bytes": meter.peak,
                "step_bytes": meter.peak - meter.start_bytes,
                "resident_bytes": meter.start_bytes,
            }
        else:
            m = measured_step_peak(env, s, groups[name])
        plan = s.plan.memory
        m["weight_estimate_bytes"] = sum(plan.base_weights.values())
        m["estimate_bytes"] = plan.total_bytes() - plan.reserved_bytes
        m["estimate/measured"] = m["estimate_bytes"] / m["peak_bytes"]
        memory[name] = m

    timed = ("bf16", "nf4")  # the one time figure's pair
    timer = Interleaved(
        env,
        {
            name: (
                lambda s=sessions[name], g=groups[name]: train_step_on(s.model, s.optimizer, s.scheduler, g, s.policy)
            )
            for name in timed
        },
    )
    timer.run(benchmark, rounds=3)
    errors = [abs(m["estimate/measured"] - 1) for m in memory.values()]
    figures = {
        "nf4/bf16 peak": figure(memory["nf4"]["peak_bytes"] / memory["bf16"]["peak_bytes"]),
        "nf4/bf16 planned weight bytes": figure(
            memory["nf4"]["weight_estimate_bytes"] / memory["bf16"]["weight_estimate_bytes"]
        ),
        "worst |estimate/measured - 1|": figure(max(errors), "<= 0.2"),
        "nf4/bf16 step time": timer.ratio_figure("nf4", "bf16"),
    }
    for name, m in memory.items():
        figures[f"estimate/measured {name}"] = figure(m["estimate/measured"])
    record(
        benchmark,
        env,
        nf4_size,
        "memory",
        figures,
        timer.summary({n: BATCH_SIZE for n in timed}),
        memory,
        notes=[
            "nf4: linear weights in 4-bit NF4 (bitsandbytes), the head, merger, embeddings and norms bf16; "
            "bf16 compute in both",
            "estimate: the memory plan's total less its runtime reserve, for exactly the batch measured",
        ],
    )
