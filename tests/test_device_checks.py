"""Tests of the device tests' checks (``tests/hardware/checks.py``), on the CPU.

Each check passes on a run made by the installed plugins, and fails on a run where a plugin registered
``tryfirst`` gives a wrong answer (or a model that silently differs from its plan): the checks the GPU
and NPU tests rely on are shown here to be able to fail.
"""

from __future__ import annotations

import pytest
import torch
from hardware.checks import (
    TF32_ERROR_THRESHOLD,
    check_attention,
    check_autocast,
    check_memory_reader,
    check_non_finite_step_is_undone_on_the_device,
    check_overflowing_step_is_skipped,
    check_parameters,
    check_tf32,
    fp32_matmul_error,
    observed_run,
    prepared,
)

from vlft.contracts.backend import DeviceSetup, MemoryStats
from vlft.hookspecs import hookimpl
from vlft.policies import AttentionPolicy, PrecisionPolicy

ASKED = {"precision": "bf16", "attn": "vision=sdpa,text=eager"}
ASKED_TOWERS = {"vision": "sdpa", "text": "eager"}


class WrongPrecisionAndAttention:
    """Answers the CPU's precision and attention wrongly: fp32 and eager, whatever was asked."""

    @hookimpl(tryfirst=True)
    def vlft_precision_policy(self, backend, config):
        return PrecisionPolicy("fp32", reason="wrong on purpose") if backend == "cpu" else None

    @hookimpl(tryfirst=True)
    def vlft_attention_implementation(self, backend, config, model_config):
        return AttentionPolicy("eager", "eager", "wrong on purpose") if backend == "cpu" else None


class SilentFallbackAndHalfWeights:
    """The plan says what was asked, the model does not: the text tower is switched to eager after loading
    (as a silent fallback would), and the base weights load in bf16 although fp32 is the CPU's."""

    @hookimpl(tryfirst=True)
    def vlft_precision_policy(self, backend, config):
        if backend != "cpu":
            return None
        return PrecisionPolicy("bf16", param_dtype="bfloat16", autocast_dtype="bfloat16", reason="wrong on purpose")

    @hookimpl
    def vlft_patch_model(self, backend, model, config, attention):
        from vlft_ascend import patch_attention

        patch_attention(model, AttentionPolicy(attention.vision, "eager"))


@pytest.fixture(scope="module")
def right_run(small_data, tmp_path_factory):
    return observed_run(tmp_path_factory.mktemp("right"), *small_data, backend="cpu", **ASKED)


def test_the_checks_pass_on_a_run_made_by_the_installed_plugins(right_run):
    result, observer = right_run
    check_autocast(observer, torch.bfloat16)
    check_attention(observer, ASKED_TOWERS)
    check_parameters(observer.model, "cpu", torch.float32)


def test_autocast_and_attention_checks_fail_on_wrong_policy_answers(small_data, tmp_path):
    result, observer = observed_run(
        tmp_path, *small_data, plugins=(WrongPrecisionAndAttention(),), backend="cpu", **ASKED
    )
    assert result.plan.precision.name == "fp32"  # the wrong answer was taken
    with pytest.raises(AssertionError, match="computed in"):
        check_autocast(observer, torch.bfloat16)
    with pytest.raises(AssertionError, match="loaded with"):
        check_attention(observer, ASKED_TOWERS)
    check_parameters(observer.model, "cpu", torch.float32)  # this one was right


def test_attention_and_parameter_checks_fail_when_the_model_differs_from_its_plan(small_data, tmp_path):
    result, observer = observed_run(
        tmp_path, *small_data, plugins=(SilentFallbackAndHalfWeights(),), backend="cpu", precision="bf16", attn="sdpa"
    )
    assert (result.plan.attention.vision, result.plan.attention.text) == ("sdpa", "sdpa")  # the plan is right
    check_autocast(observer, torch.bfloat16)
    with pytest.raises(AssertionError, match="loaded with"):
        check_attention(observer, {"vision": "sdpa", "text": "sdpa"})
    assert observer.forward_attention == {"vision": {"sdpa"}, "text": {"eager"}}  # the steps' half saw it too
    with pytest.raises(AssertionError, match="frozen parameters are not torch.float32"):
        check_parameters(observer.model, "cpu", torch.float32)
    with pytest.raises(AssertionError, match="left on"):
        check_parameters(observer.model, "cuda", torch.bfloat16)


# -- TF32 -----------------------------------------------------------------------------------------


class OnlySkipsTF32:
    """The CUDA set-up as it was before: TF32 on for auto, and for fp32 merely not turned on."""

    @hookimpl(tryfirst=True)
    def vlft_setup_device(self, backend, config):
        if backend != "cuda":
            return None
        import vlft_cuda

        torch.cuda.set_device(config.local_rank)
        if config.precision != "fp32":
            vlft_cuda.enable_tf32()
        return DeviceSetup(torch.device("cuda", config.local_rank), local_rank=config.local_rank)


@pytest.mark.parametrize("plugins, fails", [((), False), ((OnlySkipsTF32(),), True)])
def test_tf32_check_after_a_default_then_an_fp32_set_up(plugins, fails, monkeypatch):
    """No GPU here: ``torch.cuda.set_device`` is stood in for; the TF32 switches are torch's own."""
    from vlft.config import RunConfig
    from vlft.registry import load_registry

    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    registry = load_registry(plugins=plugins)
    registry.first("vlft_setup_device", backend="cuda", config=RunConfig(backend="cuda"))
    check_tf32(True)
    registry.first("vlft_setup_device", backend="cuda", config=RunConfig(backend="cuda", precision="fp32"))
    if fails:
        with pytest.raises(AssertionError, match="TF32 switches"):
            check_tf32(False)
    else:
        check_tf32(False)


def test_the_tf32_threshold_separates_fp32_from_tf32_rounding():
    assert fp32_matmul_error("cpu") < TF32_ERROR_THRESHOLD < fp32_matmul_error("cpu", emulate_tf32=True)


# -- loss scaling ----------------------------------------------------------------------------------------


class NoScaler:
    @hookimpl(tryfirst=True)
    def vlft_precision_policy(self, backend, config):
        return PrecisionPolicy("fp16", autocast_dtype="float16", reason="no scaler") if backend == "cpu" else None


class DisabledScaler:
    @hookimpl(tryfirst=True)
    def vlft_precision_policy(self, backend, config):
        if backend != "cpu":
            return None
        return PrecisionPolicy(
            "fp16",
            autocast_dtype="float16",
            loss_scaling=True,
            reason="a scaler that scales nothing",
            make_scaler=lambda: torch.amp.GradScaler("cpu", enabled=False),
        )


# a skipped step leaves the optimizer unstepped before the scheduler steps, which torch warns about
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize(
    "plugin, message",
    [
        (None, None),
        (NoScaler(), "without a loss scaler"),
        (DisabledScaler(), "overflowing step changed"),
    ],
)
def test_overflow_check_on_vlfts_own_step(small_data, tmp_path, plugin, message):
    session = prepared(small_data[0], tmp_path, plugins=(plugin,) if plugin else (), backend="cpu", precision="fp16")
    if message is None:
        check_overflowing_step_is_skipped(session)
    else:
        with pytest.raises(AssertionError, match=message):
            check_overflowing_step_is_skipped(session)


def unguarded_step_stand_in(optimizer, finite):
    """A stand-in for a broken guarded_step: the optimizer steps whatever the flag says."""
    optimizer.step()


def test_non_finite_check_on_the_device_path_of_vlfts_step(small_data, tmp_path, monkeypatch):
    """The CPU made to take the accelerator's path (``flags_on_host`` off: the step is taken and undone by
    ``guarded_step``), bf16 without a scaler as on a GPU; with a guarded_step that guards nothing the
    check fails."""
    import vlft.training.step

    session = prepared(small_data[0], tmp_path, backend="cpu", precision="bf16")
    with pytest.raises(AssertionError, match="reads its flag on the host"):
        check_non_finite_step_is_undone_on_the_device(session)  # the CPU's own path
    session.policy.flags_on_host = False
    check_non_finite_step_is_undone_on_the_device(session)
    monkeypatch.setattr(vlft.training.step, "guarded_step", unguarded_step_stand_in)
    with pytest.raises(AssertionError, match="the NaN step changed"):
        check_non_finite_step_is_undone_on_the_device(session)


# -- memory -------------------------------------------------------------------------------------------------


def test_memory_check_fails_for_a_reader_of_another_device(registry):
    device = torch.device("cpu")
    check_memory_reader(registry.first("vlft_memory_reader", backend="cpu", device=device), device)

    def other_device():  # figures that do not move with this device's allocations
        return MemoryStats(peak_bytes=3 << 20, current_bytes=1 << 20)

    with pytest.raises(AssertionError, match="peak"):
        check_memory_reader(other_device, device)


# -- kernel patches -----------------------------------------------------------------------------------------


def _scaled_norms(model) -> str:
    """WRONG ON PURPOSE: every RMSNorm's output 10% larger (a fused kernel that dropped a factor would look so)."""
    import types

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for m in norms:
        m.forward = types.MethodType(lambda self, x, _real=type(m).forward: _real(self, x) * 1.1, m)  # noqa: B008 - binds each module's own forward
    return f"{len(norms)} RMSNorms scaled"


def _rotary_rewritten(model) -> str:
    """Right, and process-wide as torch_npu's and Liger's rotary patches are: the vision tower's rotary
    function replaced, in the modeling module, by the same formula written differently."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as modeling

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()

        def rotate(x):
            first, second = x.float().chunk(2, dim=-1)
            return (x.float() * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)

        return rotate(q), rotate(k)

    modeling.apply_rotary_pos_emb_vision = apply_rotary_pos_emb_vision
    return "vision rotary rewritten (process-wide)"


class CpuKernelOffers:
    """Kernel patches offered for the cpu backend: the CUDA plugin's real linear-patch-embed, a right
    process-wide one, a right attention one (as Ascend's flash-attention patches are), one asking for the
    attention the backend already uses (so it does nothing), one wrong."""

    @hookimpl
    def vlft_kernel_patches(self, backend, config, model_config, family):
        if backend != "cpu":
            return None
        import dataclasses

        import vlft_cuda.kernels as cuda_kernels
        from vlft.contracts.backend import KernelPatch

        def offer(name, **kw):
            return KernelPatch(
                name=name, replaces="-", why="-", condition="-", available=True, reason="-", backend="cpu", **kw
            )

        return [
            dataclasses.replace(cuda_kernels._patch_embed(family), backend="cpu"),
            offer("rotary-rewritten", apply=_rotary_rewritten),
            offer("sdpa-vision", attention={"vision": "sdpa"}),
            offer("eager-vision", attention={"vision": "eager"}),  # the CPU backend's own choice
            offer("scaled-norms", apply=_scaled_norms),
        ]


def test_kernel_patch_comparison_fails_a_patch_that_changes_nothing_or_is_wrong_and_undoes_process_wide_ones():
    """``compare_each_patch`` (what the cuda/npu kernel tests assert) on the CPU in bf16, the autocast the
    devices run: the right patches pass, within bf16's own error measured on the unpatched model; the one that
    changes nothing and the wrong one fail, each for its reason; the process-wide one is undone afterwards."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as modeling
    from hardware.checks import compare_each_patch

    from vlft.testing import registry_with

    real_rotary = modeling.apply_rotary_pos_emb_vision
    lines, failures, compared = compare_each_patch("cpu", registry_with(CpuKernelOffers()), precision="bf16")
    print("\n".join(lines))
    assert compared == ["linear-patch-embed", "rotary-rewritten", "sdpa-vision", "eager-vision", "scaled-norms"]
    assert set(failures) == {"eager-vision", "scaled-norms"}
    assert [f.split(":")[0] for f in failures["eager-vision"]] == ["took no effect", "vision tower"]
    assert "already uses eager" in failures["eager-vision"][1]
    assert failures["scaled-norms"][0].startswith("logits: relative error")
    assert modeling.apply_rotary_pos_emb_vision is real_rotary
    rotary_line = next(line for line in lines if line.startswith("  rotary-rewritten"))
    assert "apply_rotary_pos_emb_vision" in rotary_line  # its code ran in the patched forward
    assert "sdpa_attention_forward" in next(line for line in lines if line.startswith("  sdpa-vision"))
