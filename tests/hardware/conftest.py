"""Device tests run only where the device is: a test marked ``cuda`` or ``npu`` is skipped, with the
backend probe's reason, on a machine without that device. This works on its own, whatever
``tests/conftest.py`` does, so the same suite is green on a laptop and real on a GPU or NPU machine.

What the device tests assert lives in ``checks.py``; ``tests/test_device_checks.py`` runs those checks
on the CPU against plugins that answer wrongly, to show each can fail.
"""

from __future__ import annotations

import functools

import pytest

MARKERS = {"cuda": ("vlft_cuda", "an NVIDIA GPU"), "npu": ("vlft_ascend", "an Ascend NPU")}


@functools.cache
def missing(marker: str) -> str | None:
    """Why the device for ``marker`` is unusable here, or None when it is usable."""
    import importlib

    module, what = MARKERS[marker]
    try:
        found = importlib.import_module(module).probe()
    except Exception as e:  # noqa: BLE001 - a broken plugin means no device test either
        return f"needs {what}; probing failed: {e}"
    return None if found.available else f"needs {what}: {found.reason}"


def pytest_runtest_setup(item):
    for marker in MARKERS:
        if item.get_closest_marker(marker) is not None:
            reason = missing(marker)
            if reason:
                pytest.skip(reason)
