"""Shared fixtures. The embedded model and data are built once per session, in a folder removed at the end.

``VLFT_TEST_ORDER=reverse`` runs the collected tests in reverse order (the device tests use it to show
they do not depend on which ran first).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# One folder for the session, removed when it ends: the embedded model cache (about 80 MB, shared with
# subprocesses through VLFT_CACHE) and the temp folder of every subprocess (torchrun's agent leaves a
# torchelastic_* folder per launch). This process keeps the system temp folder (resolved before TMPDIR
# changes), so pytest's own tmp_path and its retention are as usual.
tempfile.gettempdir()
SESSION_DIR = Path(tempfile.mkdtemp(prefix="vlft-test-"))
(SESSION_DIR / "tmp").mkdir()
os.environ["TMPDIR"] = str(SESSION_DIR / "tmp")
os.environ.setdefault("VLFT_CACHE", str(SESSION_DIR / "cache"))  # a cache the caller chose is kept
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test` runs two workers) the workers share the cores: each worker, and every
# process it starts (a `vlft run` subprocess inherits the variable), takes its share of the threads, or two
# processes of two threads fight over two cores and both run slower than one after the other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

# The built-in plugin packages (vlft_models, vlft_cuda, ...) from this checkout, for the tests that import them
# by name: where vlft is not installed (a device machine's Python runs the suite from the checkout) nothing
# else provides those names. Nothing is written: vlft/plugins.py maps the names to plugins/ on import.
from vlft.plugins import serve_checkout  # noqa: E402 - after TMPDIR, before any test module imports a plugin

serve_checkout()

import pytest  # noqa: E402 - with torch, below the set-up above
import torch  # noqa: E402 - after the thread settings above

torch.set_num_threads(THREADS)

# the option index's evidence: which `vlft run` options each test's runs set (run_option_index.py)
pytest_plugins = ["run_option_index"]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("VLFT_TEST_ORDER") == "reverse":
        items.reverse()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The versions under test, beside the results (under -q too): `make test-latest` runs on whatever the
    registry has newest, and a failure there should name what changed (constraints.txt holds the pins)."""
    from importlib.metadata import PackageNotFoundError, version

    def found(name):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} (not installed)"

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminalreporter.write_line(
        "vlft stack: "
        + ", ".join(
            found(n) for n in ("torch", "transformers", "peft", "kernels", "accelerate", "pluggy", "click", "numpy")
        )
    )


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


def math_flags() -> tuple:
    """The process-wide switches a backend's set-up may change (TF32 on CUDA)."""
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )


@pytest.fixture(autouse=True)
def _restore_math_flags():
    """Each test leaves the switches as it found them, so no outcome depends on which test ran before."""
    saved = math_flags()
    yield
    if math_flags() == saved:
        return
    # the precision first: setting it also moves the matmul switch
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32 = saved[1]
    torch.backends.cudnn.allow_tf32 = saved[2]


@pytest.fixture(scope="session")
def model_dir() -> str:
    from helpers import installed
    from vlft.models.embedded import embedded_model_dir

    return str(embedded_model_dir(installed()))


@pytest.fixture(scope="session")
def processor(model_dir):
    from helpers import embedded_family, installed
    from vlft.models.loading import load_processor

    return load_processor(model_dir, embedded_family(), installed())


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> tuple[Path, Path]:
    """A small product-inspection set: 64 training and 16 validation records."""
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(tmp_path_factory.mktemp("data") / "demo", n_train=64, n_val=16, seed=3)
    return ds.train, ds.val


@pytest.fixture
def registry():
    from vlft.registry import load_registry

    return load_registry()


@pytest.fixture(scope="session")
def straight_run(small_data, tmp_path_factory) -> Path:
    """An uninterrupted 8-step run that resumed runs are compared with (``test_run.short_config`` values)."""
    from test_run import short_config
    from vlft.commands.run import execute
    from vlft.registry import load_registry

    out = tmp_path_factory.mktemp("straight") / "run"
    execute(load_registry(), short_config(small_data, out, steps=8, save_every=4, eval_every=0), progress=False)
    return out
