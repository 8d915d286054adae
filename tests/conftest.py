"""Shared fixtures. The embedded model and data are built once per session in a temp cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# one cache for the whole session, subprocesses included (set before vlft is imported)
os.environ.setdefault("VLFT_CACHE", tempfile.mkdtemp(prefix="vlft-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vlft.embedded import embedded_model_dir

    return str(embedded_model_dir())


@pytest.fixture(scope="session")
def processor(model_dir):
    from vlft.model import load_processor

    return load_processor(model_dir)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> tuple[Path, Path]:
    """A small product-inspection set: 64 training and 16 validation records."""
    from vlft.demo_data import write_demo_dataset

    ds = write_demo_dataset(tmp_path_factory.mktemp("data") / "demo", n_train=64, n_val=16, seed=3)
    return ds.train, ds.val


@pytest.fixture
def registry():
    from vlft.plugins import load_registry

    return load_registry()
