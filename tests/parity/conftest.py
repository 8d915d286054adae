"""Backend pairs for parity: the CPU reference against every accelerator present here.

Each accelerator's parameter carries its device's marker (``cuda``, ``npu``), so ``-m cuda`` selects the
CUDA parity tests with the device tests.
"""

from __future__ import annotations

import pytest

DEVICE_MARKERS = {"cuda": pytest.mark.cuda, "npu": pytest.mark.npu}


def available_accelerators() -> list:
    from vlft.registry import get_registry

    reg = get_registry()
    return [
        pytest.param(name, marks=[DEVICE_MARKERS[info.device_type]] if info.device_type in DEVICE_MARKERS else [])
        for name, info in sorted(reg.backends.items())
        if info.device_type != "cpu" and reg.first("vlft_probe_backend", backend=name).available
    ]


def pytest_generate_tests(metafunc):
    if "accelerator" in metafunc.fixturenames:
        params = available_accelerators()
        metafunc.parametrize(
            "accelerator",
            params or [pytest.param(None, marks=pytest.mark.skip(reason="no accelerator backend is available here"))],
        )
