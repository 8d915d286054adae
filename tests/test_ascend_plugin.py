"""The Ascend NPU backend plugin, without an NPU.

Every test that needs a "working" torch_npu uses a STAND-IN: a plain module
named ``torch_npu`` put into ``sys.modules`` (with a real ``__spec__``, so
``importlib.util.find_spec`` finds it) and a ``torch.npu`` namespace that
reports devices. It is not torch_npu; it lets the probe, version check,
policies, environment and scaler choice run here. The real device is
exercised by ``tests/hardware`` (marker ``npu``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import subprocess
import sys
import types

import pytest
import torch

import vlft_ascend as ascend
from helpers import embedded_family
from vlft.config import RunConfig
from vlft.errors import ConfigError
from vlft.policies import DataLoaderOptions

TORCH_BASE = ascend.base_version(torch.__version__)


class StandInScaler:
    """Stands in for ``torch.npu.amp.GradScaler``: records its arguments."""

    def __init__(self, init_scale=2.0**16, growth_interval=2000, **kwargs):
        self.init_scale = init_scale
        self.growth_interval = growth_interval


class StandInNPU:
    """Stands in for the ``torch.npu`` namespace torch_npu adds: reports ``count`` devices.

    Like torch_npu, its queries take a device (an index, a device object, or None for the current one,
    which ``set_device`` changes) and answer for that device only: device ``i`` has its own memory figures.
    """

    def __init__(self, count=2, bf16=True):
        self.count, self.bf16 = count, bf16
        self.current = 0
        self.calls: list[tuple] = []
        self.amp = types.SimpleNamespace(GradScaler=StandInScaler)

    def index_of(self, device=None) -> int:
        index = device if isinstance(device, int) else getattr(device, "index", None)
        index = self.current if index is None else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"Invalid device ID {index}")
        return index

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def is_bf16_supported(self):
        return self.bf16

    def get_device_name(self, index=0):
        return "Ascend910B2 (stand-in)"

    def set_device(self, index):
        self.current = self.index_of(index)
        self.calls.append(("set_device", index))

    def manual_seed_all(self, seed):
        self.calls.append(("manual_seed_all", seed))

    @staticmethod
    def peak_of(index):
        return (30 + index) << 20

    @staticmethod
    def current_of(index):
        return (10 + index) << 20

    def max_memory_allocated(self, device=None):
        return self.peak_of(self.index_of(device))

    def memory_allocated(self, device=None):
        return self.current_of(self.index_of(device))


HCCL_ENV = ("HCCL_OP_TIMEOUT", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_DETERMINISTIC")


def clear_env(monkeypatch, *keys):
    """Unset ``keys`` for this test, restoring the original values (set or unset) afterwards."""
    for key in keys:
        monkeypatch.setenv(key, "")  # records the original, so whatever a plugin sets is undone
        monkeypatch.delenv(key)


def forget_module(monkeypatch, name):
    """Remove ``name`` from sys.modules for this test, whether or not it was there, and restore it afterwards."""
    monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def no_torch_npu(monkeypatch):
    """torch_npu absent, whatever this machine has (``None`` in sys.modules blocks the import)."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    clear_env(monkeypatch, *HCCL_ENV)


@pytest.fixture
def stand_in(monkeypatch):
    """Install a stand-in torch_npu reporting two NPUs; returns a function to reconfigure it."""
    clear_env(monkeypatch, *HCCL_ENV, "CUDA_VISIBLE_DEVICES")
    forget_module(monkeypatch, ascend.TRANSFER_TO_NPU)
    # package metadata of a real torch_npu (if this machine has one) must not override the stand-in's version
    real_dist_version = ascend.probing._dist_version
    monkeypatch.setattr(
        ascend.probing, "_dist_version", lambda name: None if name == "torch_npu" else real_dist_version(name)
    )

    def install(version=f"{TORCH_BASE}.post1", count=2, bf16=True):
        module = types.ModuleType("torch_npu")
        module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        module.__version__ = version
        npu = StandInNPU(count=count, bf16=bf16)
        monkeypatch.setitem(sys.modules, "torch_npu", module)
        monkeypatch.setattr(torch, "npu", npu, raising=False)
        return npu

    install()
    return install


def cfg(**kw) -> RunConfig:
    return RunConfig(backend="ascend", **kw)


# -- importing and probing -------------------------------------------------------------


def test_importing_the_plugins_imports_neither_torch_nor_torch_npu():
    code = "import sys, vlft_ascend, vlft_cuda; print(sorted(m for m in ('torch', 'torch_npu') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_without_torch_npu_says_what_to_install(no_torch_npu):
    found = ascend.probe()
    assert not found.available
    assert found.reason.startswith("torch_npu is not installed")
    assert "vlft[ascend]" in found.reason and "CANN" in found.reason


def install_fake_torch_npu(tmp_path, monkeypatch, init_source: str) -> None:
    """Put a real on-disk package ``torch_npu`` with ``init_source`` as its ``__init__`` on sys.path."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(init_source)
    forget_module(monkeypatch, "torch_npu")
    clear_env(monkeypatch, *HCCL_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


@pytest.mark.parametrize(
    "error",
    [
        "ImportError('libhccl.so: cannot open shared object file')",
        "RuntimeError('call aclInit failed, error code 100000')",
    ],
)
def test_probe_when_importing_torch_npu_raises(error, tmp_path, monkeypatch):
    """A real (tiny) package named torch_npu whose import raises, as it does without CANN."""
    install_fake_torch_npu(tmp_path, monkeypatch, f"raise {error}\n")
    found = ascend.probe()
    assert not found.available
    assert "does not import" in found.reason
    assert error.split("(")[0] in found.reason  # the exception class
    assert "set_env.sh" in found.reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in found.reason
    assert "torch_npu" not in sys.modules  # the failed import left nothing behind


def test_probe_when_import_torch_itself_raises(stand_in, monkeypatch):
    """torch's device-backend autoload imports torch_npu inside `import torch`; that failure is explained."""

    def failing(name):
        if name == "torch":
            raise RuntimeError("Failed to load the backend extension: torch_npu")
        return importlib.import_module(name)

    monkeypatch.setattr(ascend.probing, "_import", failing)
    found = ascend.probe()
    assert not found.available
    assert "`import torch` failed" in found.reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in found.reason


def test_version_mismatch_is_found_from_metadata_without_importing(tmp_path, monkeypatch):
    """Mismatched versions are read from package metadata; the mismatched torch_npu is never imported."""
    dist = tmp_path / "torch_npu-2.1.0.post3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.1.0.post3\n")
    install_fake_torch_npu(
        tmp_path, monkeypatch, "raise AssertionError('the probe must not import a mismatched torch_npu')\n"
    )
    found = ascend.probe()
    assert not found.available
    assert "torch_npu 2.1.0.post3 is built for torch 2.1.0" in found.reason
    assert TORCH_BASE in found.reason and "pip install 'torch==2.1.0'" in found.reason
    assert found.versions["torch_npu"] == "2.1.0.post3"
    assert "torch_npu" not in sys.modules


def test_version_mismatch_of_an_imported_torch_npu(stand_in):
    stand_in(version="2.1.0.post10")
    found = ascend.probe()
    assert not found.available
    assert "torch_npu 2.1.0.post10 is built for torch 2.1.0" in found.reason and torch.__version__ in found.reason


@pytest.mark.parametrize(
    "torch_v, npu_v, mismatch",
    [
        ("2.6.0", "2.6.0", False),
        ("2.6.0+cpu", "2.6.0.post3", False),
        ("2.9.0", "2.9.0rc1", False),
        ("2.5.1", "2.6.0", True),
        ("2.6.0+cpu", "2.1.0.post10", True),
        (None, "2.6.0", False),
    ],
)
def test_version_rule(torch_v, npu_v, mismatch):
    assert (ascend.version_mismatch(torch_v, npu_v) is not None) == mismatch


def test_probe_with_the_stand_in_reports_its_devices(stand_in):
    found = ascend.probe()
    assert found.available and found.reason == ""
    assert found.device_count == 2
    assert found.versions["torch_npu"] == f"{TORCH_BASE}.post1"


def test_probe_with_no_device_names_the_visibility_variable(stand_in, monkeypatch):
    stand_in(count=0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "7")
    found = ascend.probe()
    assert not found.available and "sees no NPU" in found.reason and "ASCEND_RT_VISIBLE_DEVICES='7'" in found.reason


def test_environment_warnings(stand_in, monkeypatch):
    monkeypatch.setenv("HCCL_OP_TIMEOUT", "1800")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setitem(sys.modules, ascend.TRANSFER_TO_NPU, types.ModuleType(ascend.TRANSFER_TO_NPU))
    warnings = " | ".join(ascend.probe().warnings)
    assert "HCCL_OP_TIMEOUT is set, but CANN does not read it" in warnings and "HCCL_EXEC_TIMEOUT" in warnings
    assert "ASCEND_RT_VISIBLE_DEVICES" in warnings and "transfer_to_npu is loaded" in warnings


# -- policies ----------------------------------------------------------------------------


def test_precision_is_fp16_with_dynamic_loss_scaling_through_the_npu_scaler(stand_in):
    policy = ascend.vlft_precision_policy(backend="ascend", config=cfg())
    assert (policy.name, policy.autocast_dtype, policy.loss_scaling, policy.init_scale) == (
        "fp16",
        "float16",
        True,
        65536.0,
    )
    # fp16 base weights halve the frozen model; trainable weights are upcast to fp32 by the core, so the
    # scaler still unscales fp32 gradients (tests/test_memory.py checks that)
    assert policy.param_dtype == "float16"
    scaler = policy.make_scaler()
    assert isinstance(scaler, StandInScaler)  # torch.npu.amp.GradScaler, not torch.amp's CUDA one
    assert (scaler.init_scale, scaler.growth_interval) == (65536.0, 2000)


def test_policies_resolve_without_torch_npu_and_without_importing_it(no_torch_npu):
    """A laptop's dry run: every policy resolves while torch_npu cannot even be imported."""
    c = cfg()
    policy = ascend.vlft_precision_policy(backend="ascend", config=c)
    assert policy.name == "fp16" and policy.make_scaler is not None
    assert ascend.vlft_attention_implementation(backend="ascend", config=c, model_config=None).vision == "eager"
    assert ascend.vlft_distributed_options(backend="ascend", config=c).process_group_backend == "hccl"
    bf16 = ascend.vlft_precision_policy(backend="ascend", config=cfg(precision="bf16"))
    assert bf16.name == "bf16" and "not checked here" in bf16.reason
    assert sys.modules["torch_npu"] is None


def test_bf16_only_where_the_npu_has_it(stand_in):
    stand_in(bf16=True)
    assert ascend.vlft_precision_policy(backend="ascend", config=cfg(precision="bf16")).autocast_dtype == "bfloat16"
    stand_in(bf16=False)
    with pytest.raises(ConfigError, match=r"has no bf16 .*use --precision fp16 or auto"):
        ascend.vlft_precision_policy(backend="ascend", config=cfg(precision="bf16"))


def test_fp32_on_request(stand_in):
    policy = ascend.vlft_precision_policy(backend="ascend", config=cfg(precision="fp32"))
    assert (policy.name, policy.autocast_dtype, policy.loss_scaling) == ("fp32", None, False)


@pytest.mark.parametrize(
    "attn, vision, text",
    [
        (None, "eager", "eager"),
        ("text=sdpa", "eager", "sdpa"),
        ("sdpa", "sdpa", "sdpa"),
        ("vision=eager,text=flash_attention_2", "eager", "flash_attention_2"),
    ],
)
def test_attention_is_eager_unless_asked_per_tower(attn, vision, text, no_torch_npu):
    policy = ascend.vlft_attention_implementation(backend="ascend", config=cfg(attn=attn), model_config=None)
    assert (policy.vision, policy.text) == (vision, text)
    assert ("NaN" in policy.reason) == (attn is None)


def test_dataloader_does_not_pin_memory(no_torch_npu):
    options = DataLoaderOptions(pin_memory=True)
    ascend.vlft_dataloader_options(backend="ascend", config=cfg(), options=options)
    assert options.pin_memory is False and options.loader_kwargs()["pin_memory"] is False


def test_hccl_with_raised_connect_timeout_and_the_real_exec_timeout(no_torch_npu, monkeypatch):
    d = ascend.vlft_distributed_options(backend="ascend", config=cfg())
    assert d.process_group_backend == "hccl"
    assert d.env == {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1800"}
    assert d.timeout_s > 1800  # the process group outlives HCCL's own timeout
    assert "HCCL_OP_TIMEOUT" not in d.env
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "3600")  # the user's value wins
    d = ascend.vlft_distributed_options(backend="ascend", config=cfg(deterministic=True))
    assert d.env["HCCL_CONNECT_TIMEOUT"] == "3600" and d.env["HCCL_DETERMINISTIC"] == "true"


def test_seeding_and_determinism(stand_in, monkeypatch):
    npu = stand_in()
    asked = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda flag, **kw: asked.append(flag))
    ascend.vlft_seed(backend="ascend", seed=7, deterministic=False)
    assert npu.calls == [("manual_seed_all", 7)] and asked == [] and "HCCL_DETERMINISTIC" not in os.environ
    ascend.vlft_seed(backend="ascend", seed=7, deterministic=True)
    assert asked == [True] and os.environ["HCCL_DETERMINISTIC"] == "true"


@pytest.mark.parametrize("local_rank", [0, 1])
def test_device_setup_and_memory_follow_the_local_rank(stand_in, monkeypatch, local_rank):
    npu = stand_in()
    # torch.device("npu") needs the real torch_npu's device registration; stand in for it too
    monkeypatch.setattr(torch, "device", lambda kind, index=None: types.SimpleNamespace(type=kind, index=index))
    config = cfg()
    config.local_rank = local_rank
    setup = ascend.vlft_setup_device(backend="ascend", config=config)
    assert npu.calls == [("set_device", local_rank)]
    assert (setup.device.type, setup.device.index) == ("npu", local_rank)
    npu.current = 1 - local_rank  # whatever the current device, the reader reads the one it was given
    stats = ascend.vlft_memory_reader(backend="ascend", device=setup.device)()
    assert (stats.peak_bytes, stats.current_bytes) == (npu.peak_of(local_rank), npu.current_of(local_rank))


def test_answers_only_for_ascend():
    c = cfg()
    assert ascend.vlft_probe_backend(backend="cuda") is None
    assert ascend.vlft_precision_policy(backend="cpu", config=c) is None
    assert ascend.vlft_patch_model(backend="cuda", model=None, config=c, attention=None, family=None) is None
    assert ascend.vlft_doctor_checks(backend="cpu") is None


# -- SDPA patched out where eager is chosen --------------------------------------------------


def test_patch_model_finds_the_vision_tower_where_the_family_says_not_by_its_name():
    """A model whose vision tower is not called ``visual`` (``model.vision_tower``, as SigLIP families have it)
    and whose top config has no ``vision_config``: the family's ``vision_tower`` path alone tells Ascend which
    config is the vision tower's."""
    from types import SimpleNamespace

    from vlft.policies import AttentionPolicy

    class Config:
        def __init__(self):
            self._attn_implementation = "sdpa"

    def holding(config):
        module = torch.nn.Module()
        module.config = config
        return module

    model = holding(Config())
    model.model = torch.nn.Module()
    model.model.vision_tower = holding(Config())
    model.model.language_model = holding(Config())
    family = SimpleNamespace(name="stand-in", towers=SimpleNamespace(vision="model.vision_tower", vision_mergers=()))
    patched = ascend.vlft_patch_model(
        backend="ascend",
        model=model,
        config=cfg(),
        family=family,
        attention=AttentionPolicy(vision="eager", text="sdpa"),
    )
    assert patched == ["model.vision_tower (vision): sdpa attention -> eager"]
    assert model.model.vision_tower.config._attn_implementation == "eager"
    assert model.model.language_model.config._attn_implementation == "sdpa"


def test_patch_model_reroutes_sdpa_to_eager(model_dir, monkeypatch):
    from vlft.models.loading import load_model, tower_attention
    from vlft.policies import AttentionPolicy, PrecisionPolicy
    from vlft_models.qwen2_vl import QWEN2_5_VL

    model = load_model(
        model_dir, AttentionPolicy("sdpa", "sdpa"), PrecisionPolicy("fp32"), family=embedded_family()
    ).eval()
    vc = model.config.vision_config
    patch, merge = vc.patch_size, vc.spatial_merge_size
    grid = torch.tensor([[1, 2 * merge, 2 * merge]])
    pixels = torch.randn(int(grid.prod()), vc.in_channels * vc.temporal_patch_size * patch * patch)
    ids = torch.tensor([[1, 2, 3, 4, 5]])

    def forward():
        with torch.no_grad():
            model.model.visual(pixels, grid_thw=grid)
            model(input_ids=ids)

    def no_sdpa(*args, **kwargs):
        raise AssertionError("scaled_dot_product_attention called")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    with pytest.raises(AssertionError, match="scaled_dot_product_attention"):
        forward()  # the model as loaded does call SDPA

    def patch(config):
        return ascend.vlft_patch_model(
            backend="ascend", model=model, config=config, attention=ascend.attention_policy(config), family=QWEN2_5_VL
        )

    patched = patch(cfg(attn="text=sdpa"))
    assert patched and all("-> eager" in p for p in patched) and any("(vision)" in p for p in patched)
    assert tower_attention(model) == {"vision": "eager", "text": "sdpa"}  # text stays as asked
    model.model.visual(pixels, grid_thw=grid)  # vision no longer calls SDPA

    patched = patch(cfg())
    assert any("(text)" in p for p in patched)
    assert tower_attention(model) == {"vision": "eager", "text": "eager"}
    forward()  # nothing calls SDPA now
    assert patch(cfg()) is None  # nothing left to patch


# -- doctor --------------------------------------------------------------------------------


def _checks():
    return {c.name: c for c in ascend.vlft_doctor_checks(backend="ascend")}


def test_doctor_without_torch_npu(no_torch_npu, monkeypatch):
    monkeypatch.setenv("HCCL_OP_TIMEOUT", "600")
    checks = _checks()
    assert not checks["torch_npu"].ok and "vlft[ascend]" in checks["torch_npu"].fix
    assert "CANN" in checks
    op = checks["HCCL_OP_TIMEOUT"]
    assert not op.ok and not op.blocking and "HCCL_EXEC_TIMEOUT" in op.fix


def test_doctor_with_the_stand_in(stand_in, monkeypatch):
    monkeypatch.setattr(
        ascend.probing, "_dist_version", lambda name: {"torch": "2.9.0", "torch_npu": "2.9.0.post2"}.get(name)
    )
    stand_in(version="2.9.0.post2")
    monkeypatch.setattr(torch, "__version__", "2.9.0+cpu")
    checks = _checks()
    assert checks["torch_npu"].ok and checks["torch/torch_npu versions"].ok
    assert checks["NPU devices"].ok and "2 visible" in checks["NPU devices"].detail
    assert checks["HCCL_CONNECT_TIMEOUT"].ok and "1200" in checks["HCCL_CONNECT_TIMEOUT"].detail


def test_doctor_reports_a_version_mismatch_with_both_versions_and_the_fix(stand_in, monkeypatch):
    monkeypatch.setattr(
        ascend.probing, "_dist_version", lambda name: {"torch": "2.5.1", "torch_npu": "2.6.0.post3"}.get(name)
    )
    check = _checks()["torch/torch_npu versions"]
    assert not check.ok and check.blocking
    assert "2.5.1" in check.detail and "2.6.0.post3" in check.detail and "torch==2.6.0" in check.fix


def test_cann_version_is_read_from_the_toolkit_info_file(tmp_path, monkeypatch):
    import platform

    info = tmp_path / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir()
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.5.0\ninnerversion=V100R001C25\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    version, where = ascend.cann_version()
    assert version == "8.5.0" and where == str(info)
