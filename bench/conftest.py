"""Fixtures for the benchmarks: the backend (``--backend``), two model sizes, and data.

``make bench`` runs these with pytest-benchmark enabled; the default
``make test`` collects them with ``--benchmark-disable`` (each benchmark body
runs once, on a reduced workload, on the embedded model only) so they cannot rot.
"""

from __future__ import annotations

import os

# Models are cached where vlft caches them (VLFT_CACHE, else ~/.cache/vlft): folders are named by the
# recipe's hash and written atomically, so reusing them across sessions is safe and saves rebuilding
# (and leaving ~100 MB in a fresh temp folder per run). Under `make test`, tests/conftest.py has already
# pointed VLFT_CACHE at its session folder, which the benchmarks then share.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP's wait policy is left as it is: PASSIVE keeps a busy machine's figures usable but doubles a
# quiet machine's step time (measured: 0.055 s -> 0.107 s per embedded LoRA step on 2 cores), which
# would misstate every absolute figure. Run `make bench` on a quiet machine.
import pytest


def _default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    # under pytest-xdist (make test's workers) a worker takes its share of the cores, as tests/conftest.py gives
    # the tests: two threads in each of two workers on two cores ran the memory group's smoke run 5 times slower
    # (25.6 s against 4.7 s alone), and every later test in that worker kept the two threads
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(8, cores // workers))


def pytest_addoption(parser):
    group = parser.getgroup("vlft-bench")
    group.addoption(
        "--backend",
        default="cpu",
        help="vlft backend the benchmarks run on (cpu, cuda, ascend, or a plugin's); "
        "skipped with the probe's reason where it is unavailable. Default: cpu.",
    )
    group.addoption(
        "--bench-precision",
        default="auto",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="precision asked of the backend's precision policy (default: auto, the backend's choice).",
    )
    group.addoption(
        "--bench-threads",
        type=int,
        default=None,
        help=f"torch CPU threads for the benchmarks (default: the usable cores, at most 8; {_default_threads()} here).",
    )
    group.addoption(
        "--bench-large",
        action="store_true",
        help="also run the memory group's slow cases: the large model, and the wide model with nf4 "
        "base weights (557 s, bitsandbytes' 4-bit matmuls on the CPU); past make bench's 15 "
        "minutes on 2 cores, so on request.",
    )
    group.addoption(
        "--columnar-scales",
        default="5000,20000",
        help="record counts of the columnar group's Parquet sets, comma-separated, each checked in "
        "a process of its own (default 5000,20000: within make bench's 15 minutes on 2 cores; "
        "100000 adds about 2 minutes, 1000000 about 15).",
    )


@pytest.fixture(scope="session")
def env(request):
    from bench.support.env import resolve_env

    threads = request.config.getoption("--bench-threads") or _default_threads()
    return resolve_env(request.config.getoption("--backend"), threads, request.config.getoption("--bench-precision"))


@pytest.fixture(scope="session")
def embedded_size():
    from bench.support.models import model_size
    from vlft.models.embedded import embedded_model_dir
    from vlft.registry import load_registry

    registry = load_registry()
    return model_size("embedded", str(embedded_model_dir(registry)), registry)


def _built_size(name: str, recipe: dict):
    """A bench model size built once from ``recipe`` into VLFT_CACHE (folder named by the recipe's hash)."""
    from bench.support.models import model_size
    from vlft.models.embedded import cache_root, tokenizer_corpus
    from vlft.registry import load_registry
    from vlft_models._tiny import recipe_hash
    from vlft_models.qwen2_vl import build_tiny_2_5

    path = cache_root() / f"bench-{name}-qwen2_5_vl-{recipe_hash(recipe)}"
    if not (path / "config.json").exists():
        build_tiny_2_5(path, recipe, corpus=tokenizer_corpus())
    return model_size(name, str(path), load_registry())


@pytest.fixture(scope="session")
def wide_size():
    """The wider variant (text hidden 512, vision hidden 256)."""
    from bench.support.models import wide_recipe

    return _built_size("wide", wide_recipe())


@pytest.fixture(scope="session")
def qwen_vocab_size():
    """The embedded recipe with Qwen2.5-VL's 151,936-row vocabulary (the head group's third size)."""
    from bench.support.models import qwen_vocab_recipe

    return _built_size("qwen-vocab", qwen_vocab_recipe())


@pytest.fixture(params=["embedded", "wide", "qwen-vocab"])
def head_size(request):
    """The head group: both sizes, and the embedded model with a real vocabulary's width, where the logits the
    labels-only head leaves out are what they are in a real step (the tiny models' 440 are not)."""
    return size_named(request)


@pytest.fixture(params=["embedded", "wide"])
def size(request):
    """Each benchmark runs on both model sizes (under `make test`'s --benchmark-disable, the embedded one only)."""
    return size_named(request)


@pytest.fixture(scope="session")
def qwen3_vl_size(env):
    """`--model embedded:qwen3-vl`: the Qwen3-VL family's tiny model (built by its plugin, cached like the
    embedded default)."""
    from bench.support.models import model_size
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named

    family = family_named(env.registry, "qwen3-vl")
    return model_size("qwen3-vl", str(embedded_family_dir(family)), env.registry, family)


def size_named(request):
    """The model size a size fixture's parameter names (``qwen-vocab``: ``qwen_vocab_size``), skipped under
    ``--benchmark-disable`` unless it is the embedded one: decided before its model is built."""
    skip_under_benchmark_disable(request, request.param)
    return request.getfixturevalue(f"{request.param.replace('-', '_')}_size")


@pytest.fixture(params=["embedded", "qwen-vocab"])
def head_runs_size(request):
    """The head-runs group: ``qwen-vocab`` carries its figure; the embedded model is make test's smoke run."""
    return size_named(request)


def skip_under_benchmark_disable(request, size_name: str) -> None:
    """`make test` collects bench/ with --benchmark-disable: there the groups run on the embedded model only."""
    disabled = request.config.getoption("benchmark_disable") and not request.config.getoption("benchmark_enable")
    if disabled and size_name != "embedded":
        pytest.skip(f"under --benchmark-disable this group runs on the embedded model only (not {size_name})")


@pytest.fixture(params=["embedded", "wide", "qwen3-vl"])
def family_size(request):
    """train_step and loop_overhead: both sizes and the Qwen3-VL family's embedded model (issue 20's figures)."""
    return size_named(request)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    """The product-inspection set (one image, one question, one answer per record): 32 training records."""
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(tmp_path_factory.mktemp("bench-data") / "demo", n_train=32, n_val=8, seed=5)
    return ds.train


@pytest.fixture(scope="session")
def demo_records(demo_data):
    from vlft.data.records import read_records

    return read_records(demo_data)


@pytest.fixture(scope="session")
def mixed_data(demo_data):
    """The demo records, half of them made longer (see ``bench.support.data.write_mixed_dataset``)."""
    from bench.support.data import write_mixed_dataset

    return write_mixed_dataset(demo_data)


@pytest.fixture(scope="session")
def mixed_records(mixed_data):
    from vlft.data.records import read_records

    return read_records(mixed_data)


@pytest.fixture(scope="session")
def large_size():
    """The third size of the memory group (text hidden 1024, vision hidden 512)."""
    from bench.support.models import large_recipe

    return _built_size("large", large_recipe())
