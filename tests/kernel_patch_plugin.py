"""A test plugin (``VLFT_PLUGINS=kernel_patch_plugin``) offering two backends' real kernel patches to the cpu
backend, so a real ``vlft run`` here applies them as a device run would:

- the Ascend plugin's ``npu-rms-norm`` (its own ``_fused`` offer and ``apply_module_forward``, which binds a
  forward on each RMSNorm instance) over a STAND-IN ``torch_npu`` whose ``npu_rms_norm`` is the documented
  formula in torch and counts its calls (``OP_CALLS``): the wiring, not the NPU kernel;
- the CUDA plugin's ``linear-patch-embed`` (a module put in place of the Conv3d patch embedding), unchanged.
"""

from __future__ import annotations

import dataclasses
import types

import torch

from vlft import hookimpl

OP_CALLS = [0]  # calls of the stand-in npu_rms_norm, in this process


def _npu_rms_norm(x, weight, epsilon):
    OP_CALLS[0] += 1
    xf = x.float()
    return ((weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon))).to(x.dtype),)


STAND_IN_NPU = types.SimpleNamespace(npu_rms_norm=_npu_rms_norm, __version__="stand-in")


@hookimpl
def vlft_kernel_patches(backend, config, model_config, family):
    if backend != "cpu":
        return None
    import vlft_ascend.kernels as ascend_kernels  # the plugins' own offers, taken as they are
    import vlft_cuda.kernels as cuda_kernels

    rms = ascend_kernels._fused(family, STAND_IN_NPU, "npu-rms-norm", "npu_rms_norm", "rms_norm", "RMSNorm")
    return [
        dataclasses.replace(rms, backend="cpu"),
        dataclasses.replace(cuda_kernels._patch_embed(family), backend="cpu"),
    ]
