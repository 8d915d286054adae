"""Each kernel patch a device backend offers, run on the device against the unpatched model.

Marked ``cuda`` / ``npu`` (skipped with the probe's reason elsewhere; ``bench/device_check.py`` runs these
markers). For every patch whose condition holds on this machine (``--kernels NAME``, opt-in ones included),
``checks.compare_each_patch`` builds the embedded model as a run does with the patch and without it
(``--kernels none``), runs the same batch forward and backward under the backend's autocast, and fails a
patch that

- took no effect (its forward calls nothing the unpatched one does not, and no parameter changed dtype; an
  attention patch for a tower the backend already runs on that implementation is one), or whose tower did
  not load and dispatch on the attention it sets;
- moved the logits or a gradient further from a float64 host copy of the model than twice the unpatched
  model's own error plus one rounding of the compute dtype (the dtype's rounding, measured side by side).

The patched step's time is printed beside the unpatched one (the docs' device table). On the CPU,
``tests/test_device_checks.py`` runs the same comparison on patches that are right, that do nothing and
that are wrong, so each failure is shown to happen.
"""

from __future__ import annotations

import pytest
from hardware.checks import compare_each_patch


def check_each_patch(backend: str) -> None:
    lines, failures, compared = compare_each_patch(backend)
    print("\n".join(lines))
    if not compared:
        pytest.skip(f"no kernel patch of {backend} can run here")
    assert failures == {}


@pytest.mark.cuda
def test_cuda_kernel_patches_take_effect_and_match_the_unpatched_model():
    check_each_patch("cuda")


@pytest.mark.npu
def test_npu_kernel_patches_take_effect_and_match_the_unpatched_model():
    check_each_patch("ascend")
