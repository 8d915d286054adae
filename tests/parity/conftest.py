"""Backend pairs for parity: the CPU reference against every accelerator present here."""

from __future__ import annotations

import pytest


def available_accelerators() -> list[str]:
    from vlft.plugins import get_registry

    reg = get_registry()
    return [name for name, info in sorted(reg.backends.items())
            if info.device_type != "cpu" and reg.first("vlft_probe_backend", backend=name).available]


def pytest_generate_tests(metafunc):
    if "accelerator" in metafunc.fixturenames:
        names = available_accelerators()
        metafunc.parametrize(
            "accelerator",
            names or [pytest.param(None, marks=pytest.mark.skip(reason="no accelerator backend is available here"))],
        )
