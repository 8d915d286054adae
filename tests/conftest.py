"""Shared fixtures. The embedded model and data are built once per session, in a folder removed at the end.

``VLFT_TEST_ORDER=reverse`` runs the collected tests in reverse order (the device tests use it to show
they do not depend on which ran first).
"""

from __future__ import annotations

import os
import shutil
import sys
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



def source_tree_example_plugin_metadata(repo: Path = Path(__file__).resolve().parents[1]) -> Path | None:
    """Test helper for running from a source tree (``bench/source_tree.py``'s ``.device-site`` on the path): a
    ``vlft_example_plugin`` dist-info there, generated from examples/vlft-example-plugin/pyproject.toml, and a
    link to this checkout's package, so the example plugin's real entry points (the Gemma 3 family among
    them) load from this checkout and not from an install made elsewhere. Where the example plugin is
    installed from this checkout with those entry points (``make test`` installs it editable) nothing is
    written. Returns the dist-info written, or None."""
    import importlib.metadata
    import importlib.util

    import tomllib

    site = repo / ".device-site"
    if str(site) not in sys.path or not site.is_dir():
        return None
    example = repo / "examples" / "vlft-example-plugin"
    project = tomllib.loads((example / "pyproject.toml").read_text())["project"]
    wanted = dict(project["entry-points"]["vlft"])
    package = example / "vlft_example_plugin"
    try:
        dist = importlib.metadata.distribution(project["name"])
        have = {ep.name: ep.value for ep in dist.entry_points if ep.group == "vlft"}
    except importlib.metadata.PackageNotFoundError:
        have = {}
    spec = importlib.util.find_spec("vlft_example_plugin")
    here = spec is not None and Path(list(spec.submodule_search_locations)[0]).resolve() == package.resolve()
    if have == wanted and here:
        return None
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text("[vlft]\n" + "".join(f"{k} = {v}\n" for k, v in wanted.items()))
    (info / "top_level.txt").write_text("vlft_example_plugin\n")
    link = site / "vlft_example_plugin"
    if not link.exists():
        os.symlink(os.path.relpath(package, site), link, target_is_directory=True)
    importlib.invalidate_caches()
    return info


source_tree_example_plugin_metadata()

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("VLFT_TEST_ORDER") == "reverse":
        items.reverse()


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


def math_flags() -> tuple:
    """The process-wide switches a backend's set-up may change (TF32 on CUDA)."""
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)


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
    from vlft.models.embedded import embedded_model_dir

    return str(embedded_model_dir())


@pytest.fixture(scope="session")
def processor(model_dir):
    from vlft.models.loading import load_processor

    return load_processor(model_dir)


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
