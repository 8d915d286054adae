"""The CUDA backend plugin, without a GPU.

``torch.cuda``'s functions are patched per test to STAND IN for a GPU of a
given compute capability, and a stand-in ``flash_attn`` module (with a real
``__spec__``) is put into ``sys.modules`` where a test needs flash-attn to
import. The real device is exercised by ``tests/hardware`` (marker ``cuda``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types

import pytest
import torch

import vlft_cuda as cuda
from vlft.config import RunConfig
from vlft.errors import ConfigError
from vlft.policies import DataLoaderOptions


def forget_module(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, name)


def peak_of(index: int) -> int:
    """The stand-in's peak memory on GPU ``index``: a different figure for every device."""
    return (10 + index) << 20


def current_of(index: int) -> int:
    return (2 + index) << 20


@pytest.fixture
def gpu(monkeypatch):
    """Stand in for GPUs; call the fixture's value to change them. Returns the call log.

    Like torch, every query takes a device (an index, a ``torch.device``, or None for the current
    device, which ``set_device`` changes) and answers for that device only, so reading device 0 where
    device 1 was meant is caught.
    """
    calls: list[tuple] = []
    forget_module(monkeypatch, cuda.TRANSFER_TO_NPU)
    if not torch.version.cuda:
        monkeypatch.setattr(torch.version, "cuda", "12.8")

    def install(capability=(8, 0), count=1):
        """``capability``: one for every GPU, or a list of one per GPU."""
        caps = list(capability) if isinstance(capability, list) else [capability] * count
        current = {"index": 0}

        def index_of(device=None) -> int:
            index = device if isinstance(device, int) else getattr(device, "index", None)
            index = current["index"] if index is None else index
            if not 0 <= index < len(caps):
                raise AssertionError("Invalid device id")  # what torch.cuda says
            return index

        def set_device(device):
            current["index"] = index_of(device)
            calls.append(("set_device", device))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: len(caps) > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: caps[index_of(device)])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"Stand-in GPU {caps[index_of(device)]}")
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(("manual_seed_all", seed)))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak_of(index_of(device)))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: current_of(index_of(device)))
        return calls

    install()
    return install


@pytest.fixture
def no_gpu(monkeypatch):
    forget_module(monkeypatch, cuda.TRANSFER_TO_NPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def flash_attn(monkeypatch):
    """A stand-in flash_attn 2.7.4 in sys.modules (importable, with a real __spec__)."""
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.__version__ = "2.7.4.post1"
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


@pytest.fixture
def no_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # find_spec -> None, import -> ImportError


def cfg(**kw) -> RunConfig:
    return RunConfig(backend="cuda", **kw)


def precision(**kw):
    return cuda.vlft_precision_policy(backend="cuda", config=cfg(**kw))


def attention(**kw):
    return cuda.vlft_attention_implementation(backend="cuda", config=cfg(**kw), model_config=None)


# -- probing ------------------------------------------------------------------------------


def test_probe_with_a_gpu(gpu):
    gpu(capability=(8, 9), count=2)
    found = cuda.probe()
    assert found.available and found.device_count == 2
    assert "compute capability 8.9" in found.versions["gpu"] and found.versions["cuda_runtime"]


def test_probe_without_a_gpu_says_why(no_gpu):
    found = cuda.probe()
    assert not found.available and "sees no GPU" in found.reason and "nvidia-smi" in found.reason


def test_probe_with_a_cpu_only_torch(no_gpu, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    found = cuda.probe()
    assert not found.available and "built without CUDA" in found.reason and "whl/cu" in found.reason


def test_transfer_to_npu_makes_the_cuda_probe_decline(gpu, monkeypatch):
    """transfer_to_npu makes torch.cuda.is_available() answer for the NPU: the CUDA backend must not believe it."""
    monkeypatch.setitem(sys.modules, cuda.TRANSFER_TO_NPU, types.ModuleType(cuda.TRANSFER_TO_NPU))
    found = cuda.probe()
    assert not found.available and "transfer_to_npu" in found.reason and "--backend ascend" in found.reason
    assert cuda.capability() is None


def test_auto_takes_the_gpu_when_there_is_no_npu(gpu, monkeypatch):
    from vlft.planning.plan import choose_backend
    from vlft.registry import load_registry

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # no NPU, whatever this machine has
    choice = choose_backend(load_registry(), "auto")
    assert choice.info.name == "cuda" and "skipped ascend: torch_npu is not installed" in choice.reason


def test_auto_asks_the_npu_first_when_transfer_to_npu_makes_cuda_lie(gpu, monkeypatch):
    """A stand-in torch_npu with one NPU, transfer_to_npu loaded, torch.cuda claiming a device: ascend wins."""
    import vlft_ascend
    from vlft.planning.plan import choose_backend
    from vlft.registry import load_registry

    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = f"{vlft_ascend.base_version(torch.__version__)}.post1"
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(vlft_ascend.probing, "_dist_version", lambda name: None)
    monkeypatch.setattr(
        torch, "npu", types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1), raising=False
    )
    monkeypatch.setitem(sys.modules, cuda.TRANSFER_TO_NPU, types.ModuleType(cuda.TRANSFER_TO_NPU))
    registry = load_registry()
    assert registry.backends["ascend"].priority > registry.backends["cuda"].priority > registry.backends["cpu"].priority
    choice = choose_backend(registry, "auto")
    assert choice.info.name == "ascend"
    assert not registry.first("vlft_probe_backend", backend="cuda").available


# -- precision --------------------------------------------------------------------------------


def test_capability_8_gets_bf16_without_loss_scaling(gpu):
    gpu(capability=(8, 0))
    p = precision()
    assert (p.name, p.autocast_dtype, p.loss_scaling, p.make_scaler) == ("bf16", "bfloat16", False, None)
    assert "8.0" in p.reason


def test_capability_7_5_gets_fp16_with_a_cuda_grad_scaler(gpu):
    gpu(capability=(7, 5))
    p = precision()
    assert (p.name, p.autocast_dtype, p.loss_scaling, p.init_scale) == ("fp16", "float16", True, 65536.0)
    scaler = p.make_scaler()
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == "cuda"
    assert scaler.get_scale() == 65536.0 or scaler._init_scale == 65536.0


def test_bf16_asked_on_a_pre_ampere_gpu_is_refused(gpu):
    gpu(capability=(7, 0))
    with pytest.raises(ConfigError, match=r"no native bf16 .*use --precision fp16 or auto"):
        precision(precision="bf16")
    assert precision(precision="fp16").loss_scaling and precision(precision="fp32").name == "fp32"


def test_without_a_gpu_the_plan_assumes_ampere_and_says_so(no_gpu):
    p = precision()
    assert p.name == "bf16" and "assumed" in p.reason


# -- attention --------------------------------------------------------------------------------


def test_flash_attention_where_the_package_imports_and_the_gpu_allows(gpu, flash_attn):
    gpu(capability=(8, 0))
    a = attention()
    assert (a.vision, a.text) == ("flash_attention_2", "flash_attention_2") and "2.7.4" in a.reason
    gpu(capability=(7, 5))
    assert (attention().vision, attention().text) == ("sdpa", "sdpa")


def test_sdpa_without_flash_attn(gpu, no_flash_attn):
    a = attention()
    assert (a.vision, a.text) == ("sdpa", "sdpa") and "not installed" in a.reason
    with pytest.raises(ConfigError, match="flash-attn"):
        attention(attn="text=flash_attention_2")


def test_sdpa_when_flash_attn_is_installed_but_broken(gpu, tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')\n")
    forget_module(monkeypatch, "flash_attn")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    a = attention()
    assert a.vision == "sdpa" and "does not import" in a.reason and "undefined symbol" in a.reason


def test_attention_per_tower_override(gpu, flash_attn):
    a = attention(attn="vision=eager")
    assert (a.vision, a.text) == ("eager", "flash_attention_2")
    a = attention(precision="fp32")
    assert (a.vision, a.text) == ("sdpa", "sdpa")  # flash-attention needs half precision


def test_old_flash_attn_is_not_used(gpu, flash_attn):
    flash_attn.__version__ = "1.0.9"
    assert attention().vision == "sdpa"


# -- device, data, processes, seeds, memory -------------------------------------------------------


def test_setup_device_sets_the_local_rank_and_tf32(gpu):
    """TF32 on for the default; an explicit fp32 (a parity check against the CPU) turns it off again, even
    after a default set-up in the same process turned it on (the conftest restores the switches)."""
    calls = gpu(count=2)
    config = cfg()
    config.local_rank = 1
    setup = cuda.vlft_setup_device(backend="cuda", config=config)
    assert calls == [("set_device", 1)]
    assert (setup.device.type, setup.device.index, setup.local_rank) == ("cuda", 1, 1)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"
    cuda.vlft_setup_device(backend="cuda", config=cfg(precision="fp32"))
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    cuda.vlft_setup_device(backend="cuda", config=cfg(precision="bf16"))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_each_local_rank_reads_its_own_gpu(gpu, flash_attn):
    """Two GPUs of different generations: the policies of local rank 1 follow GPU 1, those of rank 0 GPU 0."""
    gpu(capability=[(7, 5), (8, 0)])
    ranks = {}
    for rank in (0, 1):
        config = cfg()
        config.local_rank = rank
        ranks[rank] = (
            cuda.vlft_precision_policy(backend="cuda", config=config).name,
            cuda.vlft_attention_implementation(backend="cuda", config=config, model_config=None).text,
        )
    assert ranks == {0: ("fp16", "sdpa"), 1: ("bf16", "flash_attention_2")}


def test_dataloader_pins_memory_with_workers(gpu):
    options = DataLoaderOptions()
    cuda.vlft_dataloader_options(backend="cuda", config=cfg(), options=options)
    kw = options.loader_kwargs()
    assert kw["pin_memory"] is True and kw["num_workers"] == 2


def test_nccl(gpu):
    assert cuda.vlft_distributed_options(backend="cuda", config=cfg()).process_group_backend == "nccl"


def test_seed_and_determinism(gpu, monkeypatch):
    calls = gpu()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # restored to the original value afterwards
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    asked = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda flag, **kw: asked.append(flag))
    cuda.vlft_seed(backend="cuda", seed=3, deterministic=False)
    assert calls == [("manual_seed_all", 3)] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not asked
    cuda.vlft_seed(backend="cuda", seed=3, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and asked == [True]
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_memory_reader_reads_the_device_it_was_resolved_for(gpu):
    gpu(count=2)
    for index in (1, 0):
        stats = cuda.vlft_memory_reader(backend="cuda", device=torch.device("cuda", index))()
        assert (stats.peak_bytes, stats.current_bytes) == (peak_of(index), current_of(index))


def test_answers_only_for_cuda():
    c = cfg()
    assert cuda.vlft_probe_backend(backend="ascend") is None
    assert cuda.vlft_attention_implementation(backend="cpu", config=c, model_config=None) is None
    assert cuda.vlft_doctor_checks(backend="ascend") is None


# -- doctor ---------------------------------------------------------------------------------


def test_doctor_checks_with_a_gpu(gpu, no_flash_attn):
    gpu(capability=(7, 5))
    checks = {c.name: c for c in cuda.vlft_doctor_checks(backend="cuda")}
    assert checks["torch build"].ok
    assert checks["GPU 0"].ok and "7.5" in checks["GPU 0"].detail and "fp16" in checks["GPU 0"].detail
    fa = checks["flash-attn"]
    assert not fa.ok and not fa.blocking and "pip install flash-attn" in fa.fix


def test_doctor_checks_without_a_gpu(no_gpu):
    checks = {c.name: c for c in cuda.vlft_doctor_checks(backend="cuda")}
    assert not checks["GPUs"].ok and checks["GPUs"].blocking and "nvidia-smi" in checks["GPUs"].fix
