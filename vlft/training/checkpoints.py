"""Checkpoints: ``checkpoints/step-NNNNNN/`` holding the adapter (saved by its method), the optimizer,
scheduler, loss-scaler and RNG state; the last K are kept, and ``--resume`` continues from the newest.

A checkpoint is written into a temporary folder, its files fsynced, a
``manifest.json`` (every file's size and sha256) written last, and only then
renamed into place, so a ``step-*`` folder is either whole or detectably
damaged: ``--resume`` takes the newest one whose manifest verifies, says which
it skipped and why, and removes half-written temporary folders. A write that
fails (a full disk) stops the run and leaves the previous checkpoint intact.
Resuming loads the adapter through the method's own ``vlft_load_adapter``, so
any method that can save can also resume.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vlft.errors import VlftError
from vlft.training.fsdp import OPTIMIZER_DIR, save_optimizer


class CheckpointStore:
    """``checkpoints/step-NNNNNN/``: adapter, optimizer, scheduler, scaler and RNG state; last K kept."""

    def __init__(
        self,
        root: Path,
        keep: int,
        save_adapter: Callable[[Any, Path], None],
        *,
        identity: dict | None = None,
        collective: bool = False,
    ):
        self.root = root
        self.keep = keep
        self.save_adapter = save_adapter
        self.identity = identity  # what defines the training (training.resume.run_identity), saved beside
        self.collective = collective  # --shard fsdp: every process takes part in saving (see save_collective)

    def newest(self) -> Path | None:
        done = sorted(p for p in self.root.glob("step-*") if (p / MANIFEST).exists())
        return done[-1] if done else None

    def save(self, step: int, state: dict, adapter, optimizer_shares: tuple[Any, Any] | None = None) -> Path:
        """Write the checkpoint of ``step``: ``state`` (``training_state``, into state.pt) and ``adapter`` (what
        ``save_adapter`` writes). Without sharding rank 0 alone calls this."""
        if self.collective:
            assert optimizer_shares is not None, "a collective save writes every process's optimizer share"
            return self.save_collective(step, state, adapter, optimizer_shares)
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f".tmp-step-{step:06d}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_partial(self.root)
            tmp.mkdir()
            self._write(tmp, state, adapter)
            self._finish(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, e) from e
        self._prune()
        return final

    def save_collective(self, step: int, state: dict, adapter, optimizer_shares: tuple[Any, Any]) -> Path:
        """Every process calls this under ``--shard fsdp``: ``adapter`` is the adapter gathered whole on rank 0
        (None on the others), ``optimizer_shares`` the (model, optimizer) whose state each process writes its
        share of (torch.distributed.checkpoint); rank 0 writes the rest, the manifest last, and renames the
        folder into place. A failure on any process stops all of them with the same error."""

        main = dist.get_rank() == 0
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f".tmp-step-{step:06d}"
        problem: BaseException | None = None
        if main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                remove_partial(self.root)
                tmp.mkdir()
            except OSError as e:
                problem = e
        problem = _first_problem(problem)
        if problem is None:
            try:
                save_optimizer(*optimizer_shares, tmp / OPTIMIZER_DIR)  # collective; fails on every process
            except Exception as e:  # noqa: BLE001 - torch.distributed.checkpoint wraps OSError in its own type
                problem = e
        if main and problem is None:
            try:
                self._write(tmp, state, adapter)
                self._finish(tmp, final)
            except OSError as e:
                problem = e
        problem = _first_problem(problem)
        if problem is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, problem) from problem
        if main:
            self._prune()
        return final

    def _finish(self, tmp: Path, final: Path) -> None:
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.root)

    def _prune(self) -> None:
        for old in sorted(p for p in self.root.glob("step-*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _failed(self, step: int, e: BaseException) -> CheckpointWriteError:
        previous = self.newest()
        nospace = isinstance(e, OSError) and e.errno == errno.ENOSPC
        why = "the disk is full" if nospace else f"{e.__class__.__name__}: {e}"
        return CheckpointWriteError(
            f"writing the checkpoint of step {step} in {self.root} failed ({why}); the run stops here. "
            + (
                f"The previous checkpoint {previous.name} is intact: free space (or fix the cause) and run again "
                f"with --resume."
                if previous
                else "There is no earlier checkpoint."
            )
        )

    def _write(self, folder: Path, state: dict, adapter) -> None:
        self.save_adapter(adapter, folder / "adapter")
        torch.save(state, folder / "state.pt")
        if self.identity is not None:
            (folder / RUN_IDENTITY).write_text(json.dumps(self.identity, indent=2, sort_keys=True))


def training_state(
    step: int, optimizer, scheduler, scaler, device: torch.device, reference: dict | None = None
) -> dict:
    """What state.pt holds: the step, the optimizer's state (None: written in shares, ``save_collective``), the
    scheduler's, the loss scaler's and the RNG state; and a preference objective's reference weights
    (``models.reference.Reference.state``), so a resumed run has the reference it started with."""
    state = {
        "step": step,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_state(device),
    }
    if reference is not None:
        state["reference"] = reference
    return state


def _first_problem(problem: BaseException | None) -> BaseException | None:
    """Under several processes: a problem on any of them, as every process sees it (rank order)."""

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problem
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, None if problem is None else f"{problem.__class__.__name__}: {problem}")
    first = next((p for p in seen if p is not None), None)
    if first is None:
        return None
    return problem if problem is not None else RuntimeError(f"another process failed: {first}")


MANIFEST = "manifest.json"


RUN_IDENTITY = "run.json"


class CheckpointWriteError(VlftError):
    """A checkpoint could not be written; the previous one is untouched."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> None:
    """Fsync every file of ``folder``, then write the manifest (sizes, sha256) last and fsync it and the folders."""
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        files[f.relative_to(folder).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    with open(folder / MANIFEST, "w", encoding="utf-8") as fh:
        json.dump({"files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    for d in sorted({p for p in folder.rglob("*") if p.is_dir()} | {folder}):
        fsync_dir(d)


def verify(folder: Path) -> str | None:
    """Why ``folder`` is not a whole checkpoint, or None when its manifest verifies."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest (the write did not finish, or an older vlft wrote it)"
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({e})"
    if "state.pt" not in files:
        return "the manifest lists no state.pt"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
        if _sha256(path) != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


def remove_partial(root: Path) -> list[Path]:
    """Remove temporary folders a killed write left behind."""
    partial = [p for p in root.glob(".tmp-step-*") if p.is_dir()]
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


def rng_state(device: torch.device) -> dict:
    """Plain values and tensors only, so that ``state.pt`` loads with ``weights_only=True``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = [
        name,
        torch.from_numpy(keys.astype(np.int64)),  # pyright: ignore[reportAttributeAccessIssue]  # legacy tuple form
        int(pos),
        int(has_gauss),
        float(cached),
    ]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    numpy_state = state["numpy"]
    if isinstance(numpy_state, list):  # as rng_state writes it: the keys as a tensor
        name, keys, pos, has_gauss, cached = numpy_state
        numpy_state = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["device"])


def newest_checkpoint(root: Path, report=None) -> Path:
    """The newest checkpoint under ``root`` whose manifest verifies; the skipped ones are reported with the
    reason, half-written temporary folders removed. None left: a clear error."""
    report = report or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for p in remove_partial(root):
        report(f"resume: removed the half-written checkpoint folder {p.name}")
    skipped = []
    for candidate in sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True):
        problem = verify(candidate)
        if problem is None:
            return candidate
        skipped.append(f"{candidate.name}: {problem}")
        report(f"resume: skipping {candidate.name}: {problem}")
    detail = ("; skipped " + "; ".join(skipped)) if skipped else ""
    raise VlftError(
        f"--resume: no complete checkpoint in {root}{detail}. Start the run again without --resume (in a new --output)."
    )


def load_state(path: Path) -> dict:
    """``state.pt`` with ``weights_only=True``: tensors and plain values, never code. Checkpoints written
    before the RNG state was stored plainly hold a NumPy array, allowed by name (``_reconstruct``, ``ndarray``,
    ``dtype``)."""

    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    multiarray = getattr(np, "_core", None) or np.core
    allowed.append(multiarray.multiarray._reconstruct)  # pyright: ignore[reportAttributeAccessIssue]  # numpy 1's np.core
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0]
        raise VlftError(
            f"--resume: {path} holds not only tensors and plain values ({first}); it is not "
            f"unpickled, since unpickling runs code. Resume from a checkpoint vlft wrote."
        ) from None


def read_checkpoint(checkpoint: Path, sharded: bool) -> dict:
    """``checkpoint``'s state.pt (``training_state``), once it is known to be written as this run holds its
    optimizer state: whole, or in shares (``sharded``, ``--shard fsdp``: read by ``load_optimizer``)."""

    state = load_state(checkpoint / "state.pt")
    written_sharded = (checkpoint / OPTIMIZER_DIR).is_dir()
    if written_sharded != sharded:
        raise VlftError(
            f"--resume: {checkpoint} was written {'with' if written_sharded else 'without'} --shard fsdp; resume "
            f"it {'with' if written_sharded else 'without'} --shard fsdp (the optimizer state is stored "
            f"{'in shares, one per process' if written_sharded else 'whole'})"
        )
    return state
