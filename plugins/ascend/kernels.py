"""The Ascend backend's kernel patches (``vlft_kernel_patches``): each faster path, its condition and reason.

- ``npu-flash-attention-vision`` / ``-text``: ``flash_attention_2``, which transformers routes on the NPU
  to ``torch_npu.npu_fusion_attention`` (TND varlen layout for the vision tower), per tower; LLaMA-Factory
  and ms-swift use it on 910B. Where torch_npu or transformers lack it, eager (the field report's recipe)
  stays, and the plan says why.
- ``npu-cu-seqlens-once``: transformers' NPU varlen path moves ``cu_seqlens`` to the host at every
  attention call (a device sync per layer); vLLM-Ascend computes it once per forward pass. The patch
  converts each distinct ``cu_seqlens`` once per vision forward and hands the host copy to every layer. It
  loads the vision tower on ``flash_attention_2`` itself (as ``npu-flash-attention-vision`` does): on eager,
  the path it changes never runs, so named alone it would do nothing.
- ``npu-rms-norm``, ``npu-swiglu``, ``npu-rotary``: torch_npu's fused ``npu_rms_norm``, ``npu_swiglu`` and
  ``npu_rotary_mul`` on the modules and functions the model family names (``kernels.targets``): peers do
  this for Qwen3 / Qwen3-VL / Qwen3.5 only. Off by default until the ``npu``-marked test has compared them
  with the unpatched model on a 910B.
- ``fp32-before-fsdp``: ms-swift casts the model to fp32 before FSDP2 sharding on the NPU, because sharding
  bf16 parameters there can fail with ``NPUCastError``; taken where ``--shard fsdp`` meets bf16 weights.

Imports inside functions: nothing here imports torch, transformers' NPU integration or torch_npu at module
import (torch_npu without CANN raises there, and the plan lists these patches on any machine); each
condition is probed inside the hook (a stand-in torch_npu in the tests answers only the choice logic).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import weakref

from vlft import KernelPatch

from .probing import probe

NPU_FA_MODULE = "transformers.integrations.npu_flash_attention"
PER_CALL_HOST_COPY = "cu_seqlens_q[1:].cpu()"  # what transformers' varlen function does at every call
DEVICE_TEST = (
    "tests/hardware/test_kernels_on_device.py::test_npu_kernel_patches_take_effect_and_match_the_unpatched_model"
)


def _torch_npu():
    """The imported torch_npu (or the tests' stand-in), or None where it is not usable here."""
    if not probe().available:
        return None
    return sys.modules.get("torch_npu")


def _short(reason: str) -> str:
    """The probe's reason without its install steps (``vlft doctor --backend ascend`` gives those)."""
    return reason.split(":")[0] + " (vlft doctor --backend ascend says what to install)" if ":" in reason else reason


def _npu_fa_source() -> str | None:
    """The text of transformers' NPU flash-attention integration, read without importing it."""
    try:
        spec = importlib.util.find_spec(NPU_FA_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _flash_status(config) -> tuple[bool, str]:
    found = probe()
    if not found.available:
        return False, _short(found.reason)
    npu = sys.modules.get("torch_npu")
    if not hasattr(npu, "npu_fusion_attention"):
        return False, "this torch_npu has no npu_fusion_attention"
    if _npu_fa_source() is None:
        return False, f"this transformers has no {NPU_FA_MODULE}"
    if config.precision == "fp32":
        return False, "npu_fusion_attention computes in fp16/bf16 and --precision fp32 was asked"
    return True, f"torch_npu {getattr(npu, '__version__', '?')} npu_fusion_attention through {NPU_FA_MODULE}"


def _flash(tower: str, config) -> KernelPatch:
    ok, why = _flash_status(config)
    return KernelPatch(
        name=f"npu-flash-attention-{tower}",
        replaces=f"eager attention in the {tower} tower",
        backend="ascend",
        why="eager attention made Ascend about 40% slower than a 4090 in the field report; transformers runs "
        "flash_attention_2 on npu_fusion_attention" + (" (TND varlen)" if tower == "vision" else ""),
        condition="torch_npu usable with npu_fusion_attention; transformers with its NPU flash-attention "
        "integration; fp16/bf16",
        available=ok,
        reason=why if ok else f"{why}: eager (the field report's recipe) stays",
        attention={tower: "flash_attention_2"},
        check=DEVICE_TEST,
    )


# -- cu_seqlens once per forward ----------------------------------------------------------------------------


def host_once(convert_count: list | None = None):
    """A function ``to_host(t)`` that copies each distinct tensor ``t`` to the host once until ``reset()``
    (keyed by the tensor object and its version counter, so an in-place change is copied again)."""
    cache: dict = {}

    def to_host(t):
        if t.device.type == "cpu":
            return t
        key = id(t)
        hit = cache.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        host = t.cpu()
        if convert_count is not None:
            convert_count.append(1)
        cache[key] = (weakref.ref(t), t._version, host)
        return host

    to_host.reset = cache.clear
    return to_host


def apply_cu_seqlens_once(model, vision_tower: str) -> str:
    """Wrap transformers' NPU varlen attention so the ``cu_seqlens`` it reads reach it on the host, copied
    once per vision forward (a forward pre-hook on the tower clears the cache) instead of once per layer."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.integrations import npu_flash_attention as npu_fa

    original = getattr(npu_fa.npu_flash_attn_varlen_func, "__wrapped__", npu_fa.npu_flash_attn_varlen_func)
    to_host = host_once()

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
        return original(q, k, v, to_host(cu_seqlens_q), to_host(cu_seqlens_k), *args, **kwargs)

    varlen.__wrapped__ = original
    npu_fa.npu_flash_attn_varlen_func = varlen
    if getattr(fa_utils, "_flash_varlen_fn", None) is original:  # transformers caches the function it imported
        fa_utils._flash_varlen_fn = varlen
    tower = model
    for part in vision_tower.split("."):
        tower = getattr(tower, part)
    tower.register_forward_pre_hook(lambda module, args: to_host.reset())
    return f"cu_seqlens copied to the host once per {vision_tower} forward (was once per attention layer)"


def _cu_seqlens(config, family) -> KernelPatch:
    ok, why = _flash_status(config)
    source = _npu_fa_source()
    if ok and PER_CALL_HOST_COPY not in (source or ""):
        ok, why = False, "this transformers no longer copies cu_seqlens to the host per call"
    tower = family.towers.vision if family else ""
    if ok and not tower:
        ok, why = False, "the model family names no vision tower"
    return KernelPatch(
        name="npu-cu-seqlens-once",
        replaces="a host copy of cu_seqlens at every vision attention layer",
        backend="ascend",
        why="transformers' NPU varlen path syncs the device once per layer to read cu_seqlens; vLLM-Ascend "
        "computes it once per forward pass",
        condition="npu-flash-attention-vision's condition, and transformers copying cu_seqlens per call",
        available=ok,
        reason=why if ok else f"{why}: nothing to save",
        attention={"vision": "flash_attention_2"},  # the varlen path it changes runs only there
        apply=(lambda model: apply_cu_seqlens_once(model, tower)) if ok else None,
        check="tests/test_kernels.py::test_cu_seqlens_reach_the_host_once_per_forward",
    )


# -- fused ops ------------------------------------------------------------------------------------------------


def _rms_norm_forward(npu):
    def forward(self, hidden_states):
        return npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]

    return forward


def _swiglu_forward(npu):
    import torch

    def forward(self, x):
        return self.down_proj(npu.npu_swiglu(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1), dim=-1))

    return forward


def _is_silu(act) -> bool:
    import torch

    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def apply_module_forward(model, classes: tuple[str, ...], make_forward, accept=lambda m: True) -> tuple[int, int]:
    """Bind ``make_forward``'s forward to every module of ``model`` whose class is in ``classes`` (instances,
    not the classes: other models in the process are untouched). Returns (patched, skipped). vlft pins each
    forward bound here once ``apply`` returns, so transformers' ``train()``/``eval()`` cannot drop it, and
    checks in the run that it is called."""
    patched = skipped = 0
    for module in model.modules():
        if type(module).__name__ not in classes:
            continue
        if not accept(module):
            skipped += 1
            continue
        module.forward = types.MethodType(make_forward, module)
        patched += 1
    return patched, skipped


def _rotary_functions(npu):
    import torch

    def text(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)

    def vision(q, k, cos, sin):
        dq, dk = q.dtype, k.dtype
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        return npu.npu_rotary_mul(q.float(), cos, sin).to(dq), npu.npu_rotary_mul(k.float(), cos, sin).to(dk)

    del torch
    return text, vision


def apply_rotary(targets: tuple[str, ...], npu) -> str:
    """Replace the family's rotary functions (``module:function``) by npu_rotary_mul versions. Module-level
    functions: this changes every model of that class in the process."""
    text, vision = _rotary_functions(npu)
    done = []
    for target in targets:
        module_name, _, fn = target.partition(":")
        module = importlib.import_module(module_name)
        setattr(module, fn, vision if fn.endswith("_vision") else text)
        done.append(f"{module_name.rsplit('.', 1)[-1]}.{fn}")
    return "npu_rotary_mul in " + ", ".join(done) + " (process-wide)"


def _fused(family, npu, name: str, op: str, role: str, replaces: str) -> KernelPatch:
    targets = tuple((family.kernels.targets or {}).get(role, ())) if family else ()
    if npu is None:
        ok, why = False, _short(probe().reason)
    elif not hasattr(npu, op):
        ok, why = False, f"this torch_npu has no {op}"
    elif not targets:
        ok, why = False, f"model family {family.name if family else '(none)'} names no {role} modules"
    else:
        ok, why = True, f"torch_npu.{op} on {', '.join(t.rsplit(':', 1)[-1] for t in targets)}"
    apply = None  # pyright: ignore[reportAssignmentType]  # no patch unless a branch below defines one
    if ok and role == "rms_norm":

        def apply(model, _t=targets):
            n, _ = apply_module_forward(model, _t, _rms_norm_forward(npu))
            return f"npu_rms_norm in {n} modules"
    elif ok and role == "gated_mlp":

        def apply(model, _t=targets):
            n, skipped = apply_module_forward(model, _t, _swiglu_forward(npu), lambda m: _is_silu(m.act_fn))
            return f"npu_swiglu in {n} MLPs" + (f" ({skipped} without SiLU left as they were)" if skipped else "")
    elif ok and role == "rotary":

        def apply(model, _t=targets):
            return apply_rotary(_t, npu)

    return KernelPatch(
        name=name,
        replaces=replaces,
        backend="ascend",
        why=f"torch_npu's fused {op}: one kernel instead of several elementwise ones; LLaMA-Factory and ms-swift "
        "use it for Qwen3 / Qwen3-VL but not Qwen2.5-VL",
        condition=f"torch_npu usable with {op}; the model family names its {role} targets",
        available=ok,
        default=False,
        reason=(why + "; opt-in until the npu-marked test has compared it on a device") if ok else why,
        apply=apply,
        check=DEVICE_TEST,
    )


# -- fp32 before FSDP2 ----------------------------------------------------------------------------------------


def apply_fp32(model) -> str:
    import torch

    n = sum(p.numel() for p in model.parameters() if p.dtype != torch.float32)
    model.to(torch.float32)
    return f"{n:,} base parameters cast to fp32 before FSDP2 sharding (autocast still computes in half precision)"


def _fp32_before_fsdp(config) -> KernelPatch:
    bf16 = config.param_dtype == "bf16" or config.precision == "bf16"
    if config.shard != "fsdp":
        ok, why = False, "no --shard fsdp: nothing is sharded"
    elif not bf16:
        ok, why = False, "the base weights are not bf16 (the NPUCastError is seen sharding bf16 parameters)"
    else:
        ok, why = (
            True,
            (
                "--shard fsdp with bf16 weights; the memory plan counts the bf16 weights, "
                "so the sharded base weights take twice what it says"
            ),
        )
    return KernelPatch(
        name="fp32-before-fsdp",
        replaces="bf16 base weights handed to FSDP2",
        backend="ascend",
        why="ms-swift casts to fp32 before FSDP2 sharding on the NPU: sharding bf16 parameters can fail "
        "with NPUCastError",
        condition="--shard fsdp and bf16 base weights",
        available=ok,
        reason=why,
        apply=apply_fp32 if ok else None,
        check=DEVICE_TEST,
    )


def kernel_patches(config, model_config, family) -> list[KernelPatch]:
    npu = _torch_npu()
    return [
        _flash("vision", config),
        _flash("text", config),
        _cu_seqlens(config, family),
        _fused(family, npu, "npu-rms-norm", "npu_rms_norm", "rms_norm", "RMSNorm"),
        _fused(family, npu, "npu-swiglu", "npu_swiglu", "gated_mlp", "SiLU(gate) * up in gated MLPs"),
        _fused(family, npu, "npu-rotary", "npu_rotary_mul", "rotary", "rotary embedding of q and k"),
        _fp32_before_fsdp(config),
    ]
