"""Kernel patches on the CPU: the choice logic (``--kernels``, each backend's conditions), the Linear patch
embedding against the Conv3d it replaces, ``--kernels none`` giving today's model, and no hook per step.

Where a test needs a "working" torch_npu or liger_kernel it uses a STAND-IN module (named so below): it
answers the choice logic (which patch for which versions and capabilities) and, where said, the wiring of a
patch (that the patched model calls the op). It proves nothing about the real kernels; the ``cuda``- and
``npu``-marked tests in ``tests/hardware/test_kernels_on_device.py`` compare each patch with the unpatched model on a
device.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types
from pathlib import Path

import pytest
import torch

import vlft_ascend as ascend
import vlft_ascend.kernels as ascend_kernels
import vlft_cuda
import vlft_cuda.kernels as cuda_kernels
from helpers import embedded_family
from test_ascend_plugin import no_torch_npu, stand_in  # noqa: F401 - the stand-in torch_npu fixtures
from vlft import KernelPatch, Kernels, hookimpl
from vlft.config import RunConfig, build_config
from vlft.errors import ConfigError
from vlft.planning.kernels import (
    apply_kernels,
    choose_kernels,
    format_kernels,
    with_kernel_attention,
)
from vlft.policies import AttentionPolicy, PrecisionPolicy


def offer(name, available=True, default=True, attention=None, reason="") -> KernelPatch:
    return KernelPatch(
        name=name,
        replaces="x",
        why="y",
        condition="z",
        available=available,
        default=default,
        reason=reason or ("holds" if available else f"{name} missing"),
        attention=attention or {},
    )


OFFERED = [
    offer("fast"),
    offer("missing", available=False),
    offer("optin", default=False),
    offer("flash", attention={"vision": "flash_attention_2"}),
]


def names(patches) -> list[str]:
    return [k.name if isinstance(k, KernelPatch) else k[0].name for k in patches]


# -- the choice -----------------------------------------------------------------------------------------------


def test_auto_takes_available_default_patches_and_says_why_not_the_others():
    choice = choose_kernels(OFFERED, RunConfig(kernels="auto"))
    assert names(choice.chosen) == ["fast", "flash"]
    why = {k.name: reason for k, reason in choice.declined}
    assert why["missing"] == "missing missing"
    assert "off by default" in why["optin"] and "--kernels auto,optin" in why["optin"]
    text = "\n".join(format_kernels(choice.describe()))
    assert "+ fast" in text and "- missing: missing missing" in text and "2 chosen, 2 declined" in text


def test_none_declines_every_patch_and_names_pick_exactly():
    assert choose_kernels(OFFERED, RunConfig(kernels="none")).chosen == []
    assert names(choose_kernels(OFFERED, RunConfig(kernels="optin")).chosen) == ["optin"]
    assert names(choose_kernels(OFFERED, RunConfig(kernels="auto,optin")).chosen) == ["fast", "optin", "flash"]


@pytest.mark.parametrize(
    "asked, match",
    [
        ("nope", "no kernel patch named nope.*offered: fast, missing"),
        ("missing", "missing cannot be used here: missing missing"),
        ("none,fast", "cannot be combined"),
    ],
)
def test_a_name_not_offered_or_not_usable_is_an_error(asked, match):
    with pytest.raises(ConfigError, match=match):
        choose_kernels(OFFERED, dataclasses.replace(RunConfig(), kernels=asked))


def test_the_flag_is_checked_with_the_others():
    with pytest.raises(ConfigError, match="cannot be combined"):
        build_config({}, {"kernels": "none,fast"})


def test_attention_of_a_chosen_patch_is_loaded_and_attn_wins():
    policy = AttentionPolicy("eager", "eager", "backend default")
    choice = choose_kernels(OFFERED, RunConfig(kernels="auto"))
    assert with_kernel_attention(policy, choice) == AttentionPolicy(
        "flash_attention_2", "eager", "backend default; vision=flash_attention_2 by kernel flash"
    )
    asked = choose_kernels(OFFERED, RunConfig(kernels="auto", attn="vision=eager"))
    assert "flash" not in names(asked.chosen)
    assert dict((k.name, r) for k, r in asked.declined)["flash"].startswith("--attn vision=eager")
    assert with_kernel_attention(policy, choose_kernels(OFFERED, RunConfig(kernels="none"))) is policy


# -- CUDA's conditions --------------------------------------------------------------------------------------


def cuda_offers(monkeypatch, fa=(True, "flash-attn 2.7.4"), cap=(9, 0), family=None, model_type="qwen2_5_vl", **config):
    # flash-attn and the GPU as every module of the plugin sees them (the attention policy and any patch alike)
    for name, module in list(sys.modules.items()):
        for attr, value in (("flash_attn_status", lambda: fa), ("capability", lambda config=None: cap)):
            if name.split(".")[0] == "vlft_cuda" and hasattr(module, attr):
                monkeypatch.setattr(module, attr, value)
    cfg = RunConfig(backend="cuda", **config)
    return {k.name: k for k in cuda_kernels.kernel_patches(cfg, types.SimpleNamespace(model_type=model_type), family)}


def _asks_for_the_backends_own_attention(offers, policy) -> dict[str, list[str]]:
    """{patch: towers it sets to the implementation the backend already picks} for the attention patches
    offered as available; a patch with towers listed changes nothing there."""
    return {
        k.name: [t for t, impl in k.attention.items() if getattr(policy, t) == impl]
        for k in offers.values()
        if k.available and k.attention
    }


def removed_flash_attn_vision(config) -> KernelPatch:
    """CUDA's ``flash-attn-vision`` as it was before its removal (898eef2): flash-attention 2 for the vision
    tower, offered where flash-attn imports, the GPU is 8.0 or newer (or none is visible) and the precision is
    not fp32, read through the plugin's own probes (``cuda_offers`` sets what they answer)."""
    from vlft_cuda.probing import BF16_CAPABILITY, capability, flash_attn_status

    cap = capability(config)
    available = flash_attn_status()[0] and (cap is None or cap >= BF16_CAPABILITY) and config.precision != "fp32"
    return KernelPatch(
        name="removed-flash-attn-vision",
        replaces="sdpa in the vision tower",
        why="FA2 varlen",
        condition="flash-attn, capability >= 8.0, fp16/bf16",
        available=available,
        attention={"vision": "flash_attention_2"},
        backend="cuda",
    )


@pytest.mark.parametrize(
    "fa, cap, precision",
    [
        ((True, "flash-attn 2.7.4"), (9, 0), "auto"),
        ((True, "flash-attn 2.7.4"), None, "auto"),
        ((False, "the flash-attn package is not installed"), (9, 0), "auto"),
        ((True, "flash-attn 2.7.4"), (7, 5), "auto"),
        ((True, "flash-attn 2.7.4"), (9, 0), "fp32"),
    ],
)
def test_no_cuda_attention_patch_asks_for_what_the_backend_already_loads(monkeypatch, fa, cap, precision):
    """An attention patch must differ from the backend's own choice wherever it is offered (the removed
    flash-attn-vision asked for flash-attention 2 exactly where the backend already loads it).

    CUDA offers no attention patch today, so the check runs over what it offers and over that removed patch,
    planted beside them: exactly the planted one is flagged, wherever it would be offered (2 of these 5
    conditions), and nothing where it would not. A CUDA patch that asks for what the backend loads (the removed
    one put back, say) fails it, and so does a check that no longer sees the clash."""
    offers = cuda_offers(monkeypatch, fa=fa, cap=cap, precision=precision)
    config = RunConfig(backend="cuda", precision=precision)
    planted = removed_flash_attn_vision(config)
    policy = vlft_cuda.vlft_attention_implementation("cuda", config, None)
    asked = _asks_for_the_backends_own_attention({**offers, planted.name: planted}, policy)
    assert {n for n, towers in asked.items() if towers} == ({planted.name} if planted.available else set())
    if planted.available:
        assert asked[planted.name] == ["vision"]


def test_no_ascend_attention_patch_asks_for_what_the_backend_already_loads(stand_in):
    from vlft_models.qwen2_vl import QWEN2_5_VL

    sys.modules["torch_npu"].npu_fusion_attention = object()  # the stand-in has the op: the patches are offered
    offers = ascend_offers(family=QWEN2_5_VL)
    asked = _asks_for_the_backends_own_attention(offers, ascend.attention_policy(RunConfig(backend="ascend")))
    assert set(asked) == {"npu-flash-attention-vision", "npu-flash-attention-text", "npu-cu-seqlens-once"}
    assert {n: towers for n, towers in asked.items() if towers} == {}


def test_every_kernel_patch_names_a_check_that_exists(monkeypatch, stand_in):
    """``KernelPatch.check`` says where a patch is compared with the unpatched model: a test that exists."""
    from vlft_models.qwen2_vl import QWEN2_5_VL

    root = Path(__file__).resolve().parents[1]
    npu = sys.modules["torch_npu"]
    npu.npu_fusion_attention = npu.npu_rms_norm = npu.npu_swiglu = npu.npu_rotary_mul = object()
    offered = [*cuda_offers(monkeypatch, family=QWEN2_5_VL).values(), *ascend_offers(family=QWEN2_5_VL).values()]
    checks = {k.name: k.check for k in offered if k.check}
    missing = {}
    for name, check in checks.items():
        path, _, test = check.partition("::")
        text = (root / path).read_text() if (root / path).is_file() else ""
        if not test or f"def {test}(" not in text:
            missing[name] = check
    assert len(checks) >= 8 and missing == {}


def test_cuda_linear_patch_embedding_follows_the_family(monkeypatch):
    from vlft_models.qwen2_vl import QWEN2_5_VL
    from vlft_models.qwen3_vl import FAMILY as QWEN3_VL

    for family in (QWEN2_5_VL, QWEN3_VL):
        k = cuda_offers(monkeypatch, family=family)["linear-patch-embed"]
        assert k.available and k.default and "model.visual.patch_embed" in k.reason
    bare = dataclasses.replace(QWEN2_5_VL, kernels=dataclasses.replace(QWEN2_5_VL.kernels, vision_stem=""))
    k = cuda_offers(monkeypatch, family=bare)["linear-patch-embed"]
    assert not k.available and "names no patch embedding" in k.reason


def test_liger_is_declined_where_it_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # absent, whatever this machine has
    monkeypatch.setattr(cuda_kernels.importlib.util, "find_spec", lambda name: None)
    offers = cuda_offers(monkeypatch)
    for name in ("liger-rms-norm", "liger-swiglu", "liger-rope", "liger-fused-linear-cross-entropy"):
        assert not offers[name].available and "vlft[liger]" in offers[name].reason


def stand_in_liger(monkeypatch, *model_types) -> list:
    """STAND-IN liger_kernel: a module with an entry point per model type (Liger's naming), so the condition
    can hold here; returns the list its entry points append their keyword arguments to."""
    calls = []
    pkg = types.ModuleType("liger_kernel")
    pkg.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    sub = types.ModuleType("liger_kernel.transformers")
    for model_type in model_types:
        setattr(sub, f"apply_liger_kernel_to_{model_type}", lambda **kw: calls.append(kw))
    pkg.transformers = sub
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    return calls


def test_liger_with_a_stand_in_is_opt_in_and_its_fused_loss_stays_off(monkeypatch):
    from vlft_models.qwen2_vl import QWEN2_5_VL, QWEN2_VL

    calls = stand_in_liger(monkeypatch, "qwen2_5_vl", "qwen2_vl")
    offers = cuda_offers(monkeypatch, family=QWEN2_5_VL)
    k = offers["liger-rms-norm"]
    assert k.available and not k.default and "opt-in" in k.reason
    k.apply(object())
    assert calls[0]["rms_norm"] and not any(v for key, v in calls[0].items() if key not in ("rms_norm", "model"))
    assert not offers["liger-fused-linear-cross-entropy"].available  # switchable on its own, and not wired
    assert "logits" in offers["liger-fused-linear-cross-entropy"].reason
    # Qwen2-VL: Liger has it, but its family names no kernel targets, so nothing is offered
    k = cuda_offers(monkeypatch, model_type="qwen2_vl", family=QWEN2_VL)["liger-swiglu"]
    assert not k.available and "names no fused-op kernel targets" in k.reason


def test_liger_follows_the_familys_kernel_targets_not_a_table_of_model_types(monkeypatch):
    """A family the CUDA plugin has never heard of gets each Liger part its ``kernels.targets`` names, where
    Liger has an entry point for its model type; a part whose role the family does not name is declined."""
    from vlft_models.qwen2_vl import QWEN2_5_VL

    stand_in_liger(monkeypatch, "newvlm")
    family = dataclasses.replace(
        QWEN2_5_VL, name="newvlm", model_types=("newvlm",), kernels=Kernels(targets={"rms_norm": ("NewVLMRMSNorm",)})
    )
    offers = cuda_offers(monkeypatch, model_type="newvlm", family=family)
    assert offers["liger-rms-norm"].available and "apply_liger_kernel_to_newvlm" in offers["liger-rms-norm"].reason
    assert (
        not offers["liger-swiglu"].available and "names no 'gated_mlp' kernel target" in offers["liger-swiglu"].reason
    )
    # Liger without that model type: declined, naming the entry point it looked for
    k = cuda_offers(monkeypatch, model_type="othervlm", family=family)["liger-rms-norm"]
    assert not k.available and "apply_liger_kernel_to_othervlm" in k.reason


# -- Ascend's conditions (stand-in torch_npu) -----------------------------------------------------------


def ascend_offers(config=None, family=None):
    return {k.name: k for k in ascend_kernels.kernel_patches(config or RunConfig(backend="ascend"), None, family)}


def test_ascend_without_torch_npu_keeps_eager_and_says_why(no_torch_npu):
    offers = ascend_offers()
    for tower in ("vision", "text"):
        k = offers[f"npu-flash-attention-{tower}"]
        assert not k.available and "torch_npu is not installed" in k.reason and "eager" in k.reason


def test_ascend_flash_attention_with_a_stand_in_torch_npu(stand_in):
    from vlft_models.qwen2_vl import QWEN2_5_VL

    offers = ascend_offers(family=QWEN2_5_VL)
    assert "no npu_fusion_attention" in offers["npu-flash-attention-vision"].reason
    sys.modules["torch_npu"].npu_fusion_attention = object()  # the stand-in now has the op
    offers = ascend_offers(family=QWEN2_5_VL)
    assert offers["npu-flash-attention-vision"].available and offers["npu-flash-attention-text"].available
    assert offers["npu-cu-seqlens-once"].available  # transformers 5.24 copies cu_seqlens per call
    choice = choose_kernels(list(offers.values()), RunConfig(backend="ascend"))
    policy = with_kernel_attention(ascend.attention_policy(RunConfig(backend="ascend")), choice)
    assert (policy.vision, policy.text) == ("flash_attention_2", "flash_attention_2")
    none = choose_kernels(list(offers.values()), RunConfig(backend="ascend", kernels="none"))
    policy = with_kernel_attention(ascend.attention_policy(RunConfig(backend="ascend")), none)
    assert (policy.vision, policy.text) == ("eager", "eager")  # the field report's recipe
    fp32 = ascend_offers(RunConfig(backend="ascend", precision="fp32"), QWEN2_5_VL)
    assert not fp32["npu-flash-attention-text"].available and "fp32" in fp32["npu-flash-attention-text"].reason


def test_ascend_fused_ops_need_the_op_and_the_familys_targets(stand_in):
    from vlft_models.qwen2_vl import QWEN2_5_VL

    npu = sys.modules["torch_npu"]
    assert "no npu_rms_norm" in ascend_offers(family=QWEN2_5_VL)["npu-rms-norm"].reason
    npu.npu_rms_norm = npu.npu_swiglu = npu.npu_rotary_mul = object()
    offers = ascend_offers(family=QWEN2_5_VL)
    for name in ("npu-rms-norm", "npu-swiglu", "npu-rotary"):
        assert offers[name].available and not offers[name].default
    bare = dataclasses.replace(QWEN2_5_VL, kernels=dataclasses.replace(QWEN2_5_VL.kernels, targets={}))
    assert "names no rms_norm" in ascend_offers(family=bare)["npu-rms-norm"].reason


@pytest.mark.parametrize(
    "shard, precision, available", [("none", "bf16", False), ("fsdp", "fp16", False), ("fsdp", "bf16", True)]
)
def test_ascend_fp32_before_fsdp_only_where_bf16_is_sharded(no_torch_npu, shard, precision, available):
    k = ascend_offers(RunConfig(backend="ascend", shard=shard, precision=precision))["fp32-before-fsdp"]
    assert k.available is available and "NPUCastError" in k.why


def test_ascend_fused_rms_norm_and_swiglu_wiring_with_stand_in_ops(stand_in, model_dir):
    """STAND-IN npu_rms_norm / npu_swiglu (the documented formulas in torch): the patch binds them to the
    family's modules and the model's output stays the same. It shows the wiring, not the NPU kernels."""
    from vlft.models.loading import load_model
    from vlft_models.qwen2_vl import QWEN2_5_VL

    npu = sys.modules["torch_npu"]
    used = []

    def rms_norm(x, w, epsilon):
        used.append("rms")
        xf = x.float()
        return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)).to(x.dtype),)

    def swiglu(x, dim=-1):
        used.append("swiglu")
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    npu.npu_rms_norm, npu.npu_swiglu = rms_norm, swiglu
    model = load_model(
        model_dir, AttentionPolicy("sdpa", "sdpa"), PrecisionPolicy("fp32"), family=embedded_family()
    ).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    offers = ascend_offers(family=QWEN2_5_VL)
    lines = apply_kernels(
        choose_kernels(list(offers.values()), RunConfig(backend="ascend", kernels="npu-rms-norm,npu-swiglu")), model
    )
    assert any("npu_rms_norm in" in line for line in lines) and any("npu_swiglu in" in line for line in lines)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert "rms" in used and "swiglu" in used
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


class StandInDeviceTensor:
    """STAND-IN for a device tensor: ``.cpu()`` counts the host copies (a sync each on a real device)."""

    def __init__(self):
        self.device = types.SimpleNamespace(type="npu")
        self._version = 0
        self.copies = 0

    def cpu(self):
        self.copies += 1
        return ("host", self._version)


def test_cu_seqlens_reach_the_host_once_per_forward(model_dir, monkeypatch):
    from transformers.integrations import npu_flash_attention as npu_fa

    from vlft.models.loading import load_model

    seen = []
    monkeypatch.setattr(npu_fa, "npu_flash_attn_varlen_func", lambda q, k, v, cq, ck, *a, **kw: seen.append(cq))
    model = load_model(
        model_dir, AttentionPolicy("eager", "eager"), PrecisionPolicy("fp32"), family=embedded_family()
    ).eval()
    line = ascend_kernels.apply_cu_seqlens_once(model, "model.visual")
    assert "once per model.visual forward" in line
    cu = StandInDeviceTensor()
    for _layer in range(4):
        npu_fa.npu_flash_attn_varlen_func(None, None, None, cu, cu)
    assert cu.copies == 1 and seen == [("host", 0)] * 4  # every layer gets the host copy; one sync
    cu._version += 1  # changed in place: copied again
    npu_fa.npu_flash_attn_varlen_func(None, None, None, cu, cu)
    assert cu.copies == 2
    vc = model.config.vision_config
    grid = torch.tensor([[1, 2 * vc.spatial_merge_size, 2 * vc.spatial_merge_size]])
    with torch.no_grad():  # a new vision forward starts afresh
        model.model.visual(
            torch.randn(int(grid.prod()), vc.in_channels * vc.temporal_patch_size * vc.patch_size**2), grid_thw=grid
        )
    npu_fa.npu_flash_attn_varlen_func(None, None, None, cu, cu)
    assert cu.copies == 3


# -- the Linear patch embedding against Conv3d -------------------------------------------------------------


@pytest.mark.parametrize("patch, bias, trainable", [(14, False, True), (16, True, True), (14, False, False)])
def test_linear_patch_embed_equals_conv3d_forward_and_backward(patch, bias, trainable):
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 48, kernel_size=(2, patch, patch), stride=(2, patch, patch), bias=bias)
    conv.requires_grad_(trainable)
    x = torch.randn(37, 3, 2, patch, patch, requires_grad=True)
    grad_out = torch.randn(37, 48, 1, 1, 1)

    def run(module):
        x.grad = None
        for p in module.parameters():
            p.grad = None
        y = module(x)
        y.backward(grad_out)
        return y.detach(), x.grad.clone(), [None if p.grad is None else p.grad.clone() for p in conv.parameters()]

    y_ref, gx_ref, gp_ref = run(conv)
    lin = cuda_kernels.linear_patch_embed(conv)
    assert lin.weight is conv.weight and (lin.bias is conv.bias)  # the same Parameters: no copy
    assert lin.weight.view(48, -1).data_ptr() == conv.weight.data_ptr()
    y, gx, gp = run(lin)
    assert y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(gp, gp_ref):
        assert (g is None) == (not trainable)
        if trainable:
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw, why", [(dict(kernel_size=2, stride=1), "kernel"), (dict(kernel_size=2, stride=2, padding=1), "padding")]
)
def test_a_conv_that_is_not_a_matmul_is_refused(kw, why):
    assert why in cuda_kernels.conv3d_as_linear_reason(torch.nn.Conv3d(3, 4, **kw))


# -- --kernels none is today's model; auto changes no weight ----------------------------------------------


@pytest.fixture(scope="module")
def cuda_plans(model_dir):
    from vlft.models.loading import model_config_and_family
    from vlft.planning.plan import resolve_policies
    from vlft.registry import load_registry

    registry = load_registry()
    model_config, family = model_config_and_family(model_dir, registry)
    return {
        asked: resolve_policies(
            registry, RunConfig(backend="cuda", kernels=asked), model_dir, model_config, family=family
        )
        for asked in ("none", "auto")
    }


def _inputs(model):
    vc = model.config.vision_config
    grid = torch.tensor([[1, 2 * vc.spatial_merge_size, 2 * vc.spatial_merge_size]])
    torch.manual_seed(1)
    return torch.randn(int(grid.prod()), vc.in_channels * vc.temporal_patch_size * vc.patch_size**2), grid


def test_kernels_none_gives_todays_model_exactly_and_auto_the_same_weights(cuda_plans, model_dir):
    from vlft.models.loading import load_model

    fp32 = PrecisionPolicy("fp32")
    policy = AttentionPolicy("sdpa", "sdpa")
    today, none, auto = (load_model(model_dir, policy, fp32, family=embedded_family()).eval() for _ in range(3))
    assert apply_kernels(cuda_plans["none"].kernels, none) == []
    assert cuda_plans["none"].describe()["kernels"]["chosen"] == []
    lines = apply_kernels(cuda_plans["auto"].kernels, auto)
    assert any(line.startswith("kernel linear-patch-embed: model.visual.patch_embed.proj Conv3d") for line in lines)
    ref = today.state_dict()
    for model in (none, auto):  # same names, same tensors (the patch shares the conv's Parameters)
        state = model.state_dict()
        assert list(state) == list(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
    assert [type(m) for m in none.modules()] == [type(m) for m in today.modules()]
    assert type(auto.model.visual.patch_embed.proj).__name__ == "LinearPatchEmbed"
    pixels, grid = _inputs(today)
    with torch.no_grad():
        out = {n: m.model.visual(pixels, grid_thw=grid) for n, m in (("today", today), ("none", none), ("auto", auto))}
    first = lambda o: o.pooler_output if hasattr(o, "pooler_output") else o[0]  # noqa: E731 - a one-line helper
    assert torch.equal(first(out["none"]), first(out["today"]))
    torch.testing.assert_close(first(out["auto"]), first(out["today"]), rtol=1e-5, atol=1e-5)


def test_the_plan_lists_the_kernels_chosen_and_declined(cuda_plans):
    desc = cuda_plans["auto"].describe()["kernels"]
    assert [k["name"] for k in desc["chosen"]] == ["linear-patch-embed"]
    declined = {k["name"]: k["because"] for k in desc["declined"]}
    assert set(declined) >= {"liger-rms-norm", "liger-fused-linear-cross-entropy"}
    assert all(declined.values())


# -- a chosen kernel costs no hook call per step --------------------------------------------------------------


class CpuPatchEmbed:
    """Offers the CUDA plugin's (real) linear-patch-embed for the cpu backend, so a CPU run applies it."""

    @hookimpl
    def vlft_kernel_patches(self, backend, config, model_config, family):
        if backend != "cpu":
            return None
        return [dataclasses.replace(cuda_kernels._patch_embed(family), backend="cpu")]


def test_a_run_with_a_kernel_calls_no_hook_inside_a_step(tmp_path, monkeypatch):
    import json

    import vlft.training.step
    from helpers import cli_invoke
    from vlft.measure import HookCallCounter
    from vlft.testing import registry_with, tiny_dataset

    hooks, real_step = HookCallCounter(), vlft.training.step.train_step

    def watched_step(*args, **kwargs):
        with hooks:
            return real_step(*args, **kwargs)

    def model_patches(out, *flags) -> list[str]:  # a 2-step `vlft run` offered the kernel: what set-up patched
        train, val = tiny_dataset(tmp_path)
        code, output = cli_invoke(
            "run",
            "--quiet",
            "--backend",
            "cpu",
            "--data",
            train,
            "--val-data",
            val,
            "--output",
            out,
            "--steps",
            2,
            "--batch-size",
            2,
            "--eval-every",
            0,
            "--eval-samples",
            0,
            "--save-every",
            0,
            *flags,
            registry=registry_with(CpuPatchEmbed()),
        )
        assert code == 0, output
        return json.loads((out / "plan.json").read_text())["model_patches"]

    monkeypatch.setattr(vlft.training.step, "train_step", watched_step)
    assert any(p.startswith("kernel linear-patch-embed") for p in model_patches(tmp_path / "run"))
    assert hooks.calls == []
    # --kernels none: the same run with the model as transformers builds it
    assert not any(p.startswith("kernel ") for p in model_patches(tmp_path / "none", "--kernels", "none"))


def test_each_backend_offers_kernels_only_for_itself(no_torch_npu):
    import vlft_cuda as cuda
    from vlft.registry import load_registry

    cfg = RunConfig()
    assert cuda.vlft_kernel_patches(backend="ascend", config=cfg, model_config=None, family=None) is None
    assert ascend.vlft_kernel_patches(backend="cuda", config=cfg, model_config=None, family=None) is None
    offered = load_registry().hook.vlft_kernel_patches(backend="cpu", config=cfg, model_config=None, family=None)
    assert [k for ks in offered if ks for k in ks] == []  # the CPU reference offers none: its model is today's
