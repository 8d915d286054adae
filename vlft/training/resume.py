"""Resuming only the same run, and saying how to resume (signals and non-finite stops: ``training.signals``).

- ``run_identity``: what defines a training trajectory, saved in each checkpoint; ``--resume`` compares it
  with the new configuration and refuses on any difference unless ``--force-resume``.
- ``resume_command``: the exact command that continues an interrupted run.
"""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

from vlft.config import split_data_spec
from vlft.errors import VlftError

# RunConfig fields that change the trajectory (the data order, the update, the schedule)
TRAJECTORY_FIELDS = (
    "method",
    "adapter",
    "targets",
    "vision_last_n",
    "batch_size",
    "grad_accum",
    "lr",
    "lr_vision",
    "lr_merger",
    "train_merger",
    "weight_decay",
    "warmup_ratio",
    "max_grad_norm",
    "steps",
    "epochs",
    "seed",
    "precision",
    "param_dtype",
    "double_quant",
    "max_pixels",
    "max_length",
    "skip_too_long",
    "world_size",
    "add_placeholders",
    "video_fps",
    "video_max_frames",
)


def file_identity(path: str | None) -> dict | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        return {"path": str(p)}
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"name": p.name, "size": p.stat().st_size, "sha256": h.hexdigest()}


def model_identity(path: str | None) -> dict:
    """The model by its config and its weight files' names and sizes (hashing gigabytes would take minutes)."""
    if not path:
        return {"model": "embedded"}
    p = Path(path)
    if not p.is_dir():
        return {"model": str(path)}
    weights = {
        f.name: f.stat().st_size for f in sorted(p.iterdir()) if f.suffix in (".safetensors", ".bin", ".pt", ".pth")
    }
    return {"config": file_identity(str(p / "config.json")), "weights": weights}


def run_identity(config, objective_options: dict | None = None) -> dict:
    """What defines the training of ``config``: two runs with equal identities follow the same trajectory.
    ``objective_options``: the objective's options as resolved (its defaults included), so a run given an
    option's default compares equal with one given none."""
    ident = {name: getattr(config, name) for name in TRAJECTORY_FIELDS}
    ident["model"] = model_identity(config.model)
    ident["data"] = data_identity(config.data)
    ident["val_data"] = file_identity(config.val_data)
    if config.objective != "sft":  # keys only where they are not the default, so older checkpoints still compare
        options = objective_options or {}
        # as JSON reads them back (a tuple as a list)
        ident["objective"] = {
            "objective": config.objective,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        }
    if config.init_adapter:
        ident["init_adapter"] = adapter_identity(config.init_adapter)
    return ident


def adapter_identity(path: str) -> dict:
    """An adapter folder (or a run folder's adapter/) by its files' sizes and content hashes."""
    folder = Path(path) / "adapter" if (Path(path) / "adapter").is_dir() else Path(path)
    if not folder.is_dir():
        return {"path": str(path)}
    return {f.name: file_identity(str(f)) for f in sorted(folder.iterdir()) if f.is_file()}


def data_identity(data) -> list | str:
    """Each --data file (size and content hash) with its sampling weight; "embedded" for the default set."""

    if not data:
        return "embedded"
    specs = [data] if isinstance(data, str) else list(data)
    out = []
    for spec in specs:
        path, weight = split_data_spec(str(spec))
        out.append({**(file_identity(path) or {"path": path}), "weight": weight})
    return out


def identity_differences(saved: dict, current: dict) -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            diffs.append(
                f"{key.replace('_', '-')}: {_short(saved.get(key))} in the checkpoint, {_short(current.get(key))} now"
            )
    return diffs


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def check_same_run(saved: dict | None, current: dict, checkpoint: Path, force: bool, warn) -> None:
    """Refuse to resume ``checkpoint`` with a configuration that would train differently, unless forced."""
    if saved is None:
        warn(f"resume: {checkpoint.name} records no run identity (an older vlft wrote it); not compared")
        return
    diffs = identity_differences(saved, current)
    if not diffs:
        return
    listing = "\n  ".join(diffs)
    if force:
        warn(
            f"WARNING --force-resume: continuing {checkpoint} with a different training configuration:\n  "
            f"{listing}\nThe result is not the run the checkpoint started."
        )
        return
    raise VlftError(
        f"--resume: {checkpoint} was trained with a different configuration:\n  {listing}\n"
        f"Resume with the original values, start a new run (another --output), or pass --force-resume "
        f"to continue anyway. Logging, evaluation and output settings may change freely."
    )


def resume_command(argv: list[str], output: Path, world_size: int = 1) -> str:
    """The command that continues this run: the same arguments, ``--output`` made explicit, plus ``--resume``
    (a torchrun worker's arguments lack ``--nproc-per-node``: it is put back)."""
    args = list(argv)
    if args and Path(args[0]).name in ("vlft", "__main__.py"):
        args = ["vlft"] + args[1:]
    if world_size > 1 and "run" in args and not any(a.startswith("--nproc-per-node") for a in args):
        at = args.index("run") + 1
        args[at:at] = ["--nproc-per-node", str(world_size)]
    if "--output" not in args and not any(a.startswith("--output=") for a in args):
        args += ["--output", str(output)]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(args)
