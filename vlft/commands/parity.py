"""``vlft parity``: do two backends compute the same training steps?

Each backend runs in its own process (a CUDA torch and torch_npu cannot live
in one), from the same seed, data order and adapter initialisation. Per step
each records the loss, the gradient norm and a digest of every adapted
module's weights; the parent compares them with tolerances that follow the
two precisions and reports the first step and module where they part.

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import click

# Relative tolerances by the looser of the two precisions. The figures carry
# the error of a few steps of AdamW, which amplifies tiny differences early on.
TOLERANCES = {
    "fp32": {"loss": 1e-4, "grad_norm": 1e-3, "weights": 1e-3},
    "fp16": {"loss": 1e-2, "grad_norm": 5e-2, "weights": 5e-2},
    "bf16": {"loss": 3e-2, "grad_norm": 1e-1, "weights": 1e-1},
}


LOOSENESS = ["fp32", "fp16", "bf16"]


def tolerance_for(precisions: list[str], override: str | None = None) -> tuple[str, dict]:
    name = override or max(precisions, key=LOOSENESS.index)
    return name, TOLERANCES[name]


def weight_digest(model, targets: list[str]) -> dict[str, list[float]]:
    """Per adapted module: [L2 norm, projection on a fixed random direction] of its trainable weights."""
    import torch

    out: dict[str, list[float]] = {}
    params = dict(model.named_parameters())
    for target in targets:
        flat = torch.cat(
            [p.detach().float().flatten().cpu() for n, p in params.items() if p.requires_grad and f"{target}." in n]
        )
        direction = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(flat.numel()))
        out[target] = [float(flat.norm()), float(flat @ direction) / math.sqrt(flat.numel())]
    return out


@dataclass(frozen=True)
class WorkerOptions:
    """What both sides of a comparison train with: the parity command's options but the backend and precision."""

    method: str = "lora"
    steps: int = 5
    batch_size: int = 4
    seed: int = 0
    model: str | None = None
    data: str | None = None
    attn: str | None = None


def run_worker(backend: str, precision: str, options: WorkerOptions) -> dict:
    """Train ``options.steps`` steps on ``backend`` and return the per-step figures (in this process)."""
    from vlft.config import build_config
    from vlft.errors import BackendUnavailable
    from vlft.registry import get_registry
    from vlft.training.trainer import build_trainer

    # a trainer without a run folder writes nothing
    values = dict(backend=backend, precision=precision, **asdict(options), eval_every=0, save_every=0, warmup_ratio=0.0)
    config = build_config({}, {k: v for k, v in values.items() if v is not None})
    try:
        trainer = build_trainer(get_registry(), config)
    except BackendUnavailable as e:
        return {"backend": backend, "available": False, "reason": str(e).split("\n")[0]}
    plan = trainer.plan
    records = []
    trainer.model.train()
    for group in trainer.batches():
        result = trainer.train_step(group)
        records.append(
            {
                "step": trainer.step,
                "loss": result.loss,
                "grad_norm": float(result.grad_norm),
                "weights": weight_digest(trainer.model, plan.targets),
            }
        )
        if trainer.step >= options.steps:
            break
    return {
        "backend": backend,
        "available": True,
        "precision": plan.precision.name,
        "device": str(trainer.device),
        "attention": asdict(plan.attention),
        "steps": records,
    }


def rel_diff(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf if a != b else 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@dataclass
class StepComparison:
    step: int
    loss_a: float
    loss_b: float
    loss_diff: float
    grad_norm_diff: float
    worst_module: str
    worst_weight_diff: float
    ok: bool


def compare(a: dict, b: dict, tol: dict) -> list[StepComparison]:
    rows = []
    for sa, sb in zip(a["steps"], b["steps"]):
        worst_module, worst = "", 0.0
        for module, da in sa["weights"].items():
            db = sb["weights"].get(module)
            diff = max(rel_diff(x, y) for x, y in zip(da, db)) if db else math.inf
            if diff > worst:
                worst_module, worst = module, diff
        loss_diff = rel_diff(sa["loss"], sb["loss"])
        gn_diff = rel_diff(sa["grad_norm"], sb["grad_norm"])
        ok = loss_diff <= tol["loss"] and gn_diff <= tol["grad_norm"] and worst <= tol["weights"]
        rows.append(StepComparison(sa["step"], sa["loss"], sb["loss"], loss_diff, gn_diff, worst_module, worst, ok))
    return rows


def default_output(names: list[str]) -> Path:
    """``runs/parity-<time>-A-B/parity.json``: a folder of its own, beside ``vlft run``'s default run folders."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"parity-{stamp}-{names[0]}-{names[1]}" / "parity.json"


def _spawn_worker(index: int, backend: str, precision: str, opts: dict, out: Path, probe_only=False) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "vlft",
        "parity-worker",
        "--backend",
        backend,
        "--precision",
        precision,
        "--out",
        str(out),
    ] + (["--probe-only"] if probe_only else [])
    for key in ("method", "steps", "batch_size", "seed", "model", "data", "attn"):
        if opts.get(key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(opts[key])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        return {"backend": backend, "available": True, "failed": True, "error": tail}
    return json.loads(out.read_text())


@click.command("parity")
@click.option("--backends", required=True, help="Two backends to compare, e.g. cpu,cuda (cpu,cpu checks the harness).")
@click.option("--method", default="lora", show_default=True)
@click.option("--steps", default=5, show_default=True, type=int)
@click.option(
    "--precision",
    default="fp32",
    show_default=True,
    help="One precision for both, or one per backend: fp32,bf16; auto is the backend's default "
    "policy (what `vlft run` uses), compared at the tolerance of the precision it resolves to.",
)
@click.option(
    "--tolerance",
    type=click.Choice(["auto", *TOLERANCES]),
    default="auto",
    show_default=True,
    help="Tolerance set; auto follows the looser of the two precisions.",
)
@click.option("--batch-size", default=4, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--model", default=None, help="Model directory (default: the embedded model).")
@click.option("--data", default=None, help="Training data (default: the embedded set).")
@click.option("--attn", default=None, help="Attention for both backends (default: each backend's).")
@click.option(
    "--output",
    "output",
    default=None,
    type=click.Path(dir_okay=False),
    help="Where to write the figures as JSON [default: parity.json in a new folder runs/parity-<time>-A-B/].",
)
# params: click passes each option as an argument of its own
def parity(backends, method, steps, precision, tolerance, batch_size, seed, model, data, attn, output):
    """Run the same seeded steps on two backends and compare loss, gradient norm and adapter weights."""
    names = [b.strip() for b in backends.split(",") if b.strip()]
    if len(names) != 2:
        raise click.UsageError("--backends takes exactly two names, e.g. cpu,cuda")
    precisions = [p.strip() for p in precision.split(",")]
    if len(precisions) == 1:
        precisions *= 2
    if len(precisions) != 2 or any(p not in (*TOLERANCES, "auto") for p in precisions):
        raise click.UsageError(f"--precision: one or two of {', '.join(TOLERANCES)}, auto; got '{precision}'")
    from vlft.errors import VlftError
    from vlft.registry import get_registry

    try:  # names are checked here; probing and training happen in the workers
        registry = get_registry()
        for name in names:
            registry.backend(name)
        registry.method(method)
    except VlftError as e:
        raise click.ClickException(str(e)) from None
    opts = dict(method=method, steps=steps, batch_size=batch_size, seed=seed, model=model, data=data, attn=attn)
    results = []
    with tempfile.TemporaryDirectory(prefix="vlft-parity-") as tmp:
        # probe both first (each in its own process, like the runs), so nothing trains in vain
        for i, name in enumerate(dict.fromkeys(names)):
            probe = _spawn_worker(i, name, precisions[0], opts, Path(tmp) / f"probe-{i}.json", probe_only=True)
            if probe.get("failed"):
                raise click.ClickException(f"probing {name} failed:\n{probe['error']}")
            if not probe.get("available"):
                raise click.ClickException(f"cannot compare: {probe['reason']} (run `vlft doctor --backend {name}`)")
        for i, (name, prec) in enumerate(zip(names, precisions)):
            click.echo(f"running {steps} steps on {name} ({prec}) ...", err=True)
            results.append(_spawn_worker(i, name, prec, opts, Path(tmp) / f"{i}.json"))
    for r in results:
        if r.get("failed") or not r.get("available"):
            raise click.ClickException(f"the {r['backend']} worker failed:\n{r.get('error') or r.get('reason')}")
    asked, precisions = precisions, [r["precision"] for r in results]  # "auto" resolved by each backend
    tol_name, tol = tolerance_for(precisions, None if tolerance == "auto" else tolerance)
    rows = compare(results[0], results[1], tol)
    label_a, label_b = (
        f"{n}/{p}" + (f"#{i}" if names[0] == names[1] and precisions[0] == precisions[1] else "")
        for i, (n, p) in enumerate(zip(names, precisions))
    )
    click.echo(
        f"{label_a} vs {label_b}: {method}, {steps} steps, seed {seed}; tolerance '{tol_name}' "
        f"(relative: loss {tol['loss']:g}, grad norm {tol['grad_norm']:g}, weights {tol['weights']:g})"
    )
    click.echo(
        f"{'step':>4}  {'loss ' + label_a:>16}  {'loss ' + label_b:>16}  {'Δloss':>9}  {'Δgrad':>9}  "
        f"{'Δweights':>9}  verdict"
    )
    for r in rows:
        click.echo(
            f"{r.step:>4}  {r.loss_a:>16.6f}  {r.loss_b:>16.6f}  {r.loss_diff:>9.2e}  {r.grad_norm_diff:>9.2e}"
            f"  {r.worst_weight_diff:>9.2e}  {'ok' if r.ok else 'DIVERGED'}"
        )
    first_bad = next((r for r in rows if not r.ok), None)
    report = {
        "backends": names,
        "precisions": precisions,
        "asked": asked,
        "method": method,
        "steps": steps,
        "seed": seed,
        "tolerance": {"name": tol_name, **tol},
        "passed": first_bad is None,
        "comparison": [asdict(r) for r in rows],
        "runs": results,
    }
    out_path = Path(output) if output else default_output(names)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    click.echo(f"wrote {out_path}")
    if first_bad is not None:
        what = []
        if first_bad.loss_diff > tol["loss"]:
            what.append(f"loss differs by {first_bad.loss_diff:.2e}")
        if first_bad.grad_norm_diff > tol["grad_norm"]:
            what.append(f"gradient norm differs by {first_bad.grad_norm_diff:.2e}")
        if first_bad.worst_weight_diff > tol["weights"]:
            what.append(f"weights of {first_bad.worst_module} differ by {first_bad.worst_weight_diff:.2e}")
        click.echo(
            f"DIVERGED first at step {first_bad.step}: {'; '.join(what)} (module most apart: "
            f"{first_bad.worst_module}). Figures in {out_path}"
        )
        sys.exit(1)
    click.echo(f"PASSED: every step within tolerance. Figures in {out_path}")


@click.command("parity-worker", hidden=True)
@click.option("--backend", required=True)
@click.option("--precision", required=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--method", default="lora")
@click.option("--steps", default=5, type=int)
@click.option("--batch-size", default=4, type=int)
@click.option("--seed", default=0, type=int)
@click.option("--model", default=None)
@click.option("--data", default=None)
@click.option("--attn", default=None)
@click.option("--probe-only", is_flag=True)  # params: click passes each option as an argument of its own
def parity_worker(backend, precision, out, method, steps, batch_size, seed, model, data, attn, probe_only):
    """One side of `vlft parity` (run by it in a process of its own)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if probe_only:
        from vlft.planning.plan import choose_backend
        from vlft.registry import get_registry

        choice = choose_backend(get_registry(), backend)
        result = {
            "backend": backend,
            "available": choice.probe.available,
            "reason": f"backend '{backend}' is not available here: {choice.probe.reason}",
        }
    else:
        result = run_worker(backend, precision, WorkerOptions(method, steps, batch_size, seed, model, data, attn))
    Path(out).write_text(json.dumps(result))
