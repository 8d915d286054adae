"""Checkpoints: ``checkpoints/step-NNNNNN/`` holding the adapter (saved by its method), the optimizer,
scheduler, loss-scaler and RNG state; the last K are kept, and ``--resume`` continues from the newest.

A checkpoint is written into a temporary folder and renamed into place, so a
folder named ``step-*`` with a ``state.pt`` is complete. Resuming loads the
adapter through the method's own ``vlft_load_adapter``, so any method that can
save can also resume.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .errors import VlftError


class CheckpointStore:
    """``checkpoints/step-NNNNNN/``: adapter, optimizer, scheduler, scaler and RNG state; last K kept."""

    def __init__(self, root: Path, keep: int, save_adapter: Callable[[Any, Path], None]):
        self.root = root
        self.keep = keep
        self.save_adapter = save_adapter

    def newest(self) -> Path | None:
        done = sorted(p for p in self.root.glob("step-*") if (p / "state.pt").exists())
        return done[-1] if done else None

    def save(self, step: int, model, optimizer, scheduler, scaler, device: torch.device) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f".tmp-step-{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self.save_adapter(model, tmp / "adapter")
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_state(device),
        }
        torch.save(state, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in self.root.glob("step-*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["device"])




def newest_checkpoint(root: Path) -> Path:
    """The newest complete checkpoint under ``root``, or a clear error."""
    done = sorted(p for p in root.glob("step-*") if (p / "state.pt").exists())
    if not done:
        raise VlftError(f"--resume: no complete checkpoint in {root}")
    return done[-1]


def restore_training_state(checkpoint: Path, optimizer, scheduler, scaler, device: torch.device) -> int:
    """Optimizer, scheduler, scaler and RNG state from ``checkpoint``; returns its step."""
    state = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"], device)
    return int(state["step"])
