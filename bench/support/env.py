"""The backend as a run would see it, resolved once through the plugin hooks, and the settings every group shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

BATCH_SIZE = 4
VISION_LAST_N = 6  # vlft's default: adapt the last 6 vision blocks (all of them where there are fewer)
TARGETS = "both"


@dataclass
class BenchEnv:
    """The backend as a run would see it: device, precision, memory reader, all from the plugins."""

    registry: Any
    backend: str
    device: torch.device
    precision: Any  # PrecisionPolicy
    memory_reader: Callable
    threads: int
    versions: dict = field(default_factory=dict)
    choice: Any = None  # the plan's BackendChoice
    asked_precision: str = "auto"

    def config(self, **over):
        from vlft.config import build_config

        values = dict(
            backend=self.backend,
            targets=TARGETS,
            vision_last_n=VISION_LAST_N,
            batch_size=BATCH_SIZE,
            precision=self.asked_precision,
        )
        values.update(over)
        return build_config({}, values)

    @property
    def autocast_dtype(self):
        return getattr(torch, self.precision.autocast_dtype) if self.precision.autocast_dtype else None

    def autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            module = torch.get_device_module(self.device.type)
            if hasattr(module, "synchronize"):
                module.synchronize(self.device)

    def device_module(self):
        return None if self.device.type == "cpu" else torch.get_device_module(self.device.type)

    def describe(self) -> dict:
        import os

        return {
            "backend": self.backend,
            "device": str(self.device),
            "precision": self.precision.name,
            "threads": self.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            **self.versions,
        }


def resolve_env(backend: str, threads: int, precision: str = "auto") -> BenchEnv:
    """Probe ``backend`` through the registry and set its device up; skip the caller when it is unavailable."""
    import os

    import pytest

    from vlft.planning.plan import choose_backend
    from vlft.registry import load_registry

    registry = load_registry()
    choice = choose_backend(registry, backend)  # unknown names raise with the valid ones; "auto" picks
    probe = choice.probe
    if not probe.available:
        pytest.skip(f"backend '{backend}' is not available here: {probe.reason}")
    backend = choice.info.name
    torch.set_num_threads(threads)
    env = BenchEnv(
        registry, backend, torch.device("cpu"), None, lambda: None, threads, dict(probe.versions), choice, precision
    )
    config = env.config()
    registry.hook.vlft_seed(backend=backend, seed=0, deterministic=False)
    setup = registry.first("vlft_setup_device", backend=backend, config=config)
    for key, value in setup.env.items():
        os.environ.setdefault(key, value)
    env.device = setup.device
    env.precision = registry.first("vlft_precision_policy", backend=backend, config=config)
    env.memory_reader = registry.first("vlft_memory_reader", backend=backend, device=setup.device)
    return env
