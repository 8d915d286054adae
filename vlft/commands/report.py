"""``vlft report RUN [RUN ...]``: run folders to one comparison (report.md, a self-contained report.html, PNGs).

Every run's loss, learning rate, step time and memory are plotted, and each objective's own figures (the ones
its plan.json names and the metrics hold: DPO's rewards and preference accuracy, GRPO's reward, KL, clip
fraction, completion length and generation time, a plugin objective's), training and validation on one chart.

Each run folder is read as far as it goes: a missing or unreadable file becomes a note in the report
(and a dash in the table), never a traceback. Only a path that is not a run folder at all is an error.
Plots are drawn headless (matplotlib's Agg) and embedded in the HTML as data URIs, so the page needs
nothing beside it and can be mailed or attached as one file.

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import base64
import html
import json
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from vlft.cli import user_errors
from vlft.errors import ConfigError

RUN_FILES = ("plan.json", "config.json", "metrics.jsonl", "eval.json", "summary.json")


# keys that differ between any two runs without being a choice
NOT_CHOICES = {"output", "resume", "dry_run", "local_rank", "rank"}


@dataclass(frozen=True)
class Plot:
    """One chart: ``key``'s values per step for every run (and, dashed, its validation ``val_<key>`` where
    ``validation``), in ``file``."""

    file: str
    key: str
    title: str
    ylabel: str
    validation: bool = False
    scale: float = 1.0  # the logged value is divided by it (bytes to GiB)


PLOTS = (  # every run's
    Plot("loss.png", "loss", "Training loss", "loss"),
    Plot("val_loss.png", "val_loss", "Validation loss", "loss"),
    Plot("lr.png", "lr", "Learning rate", "learning rate"),
    Plot("step_time.png", "step_time_s", "Step time", "seconds per step"),
    Plot("peak_memory.png", "peak_memory_bytes", "Peak device memory", "GiB", scale=2**30),
)


@dataclass
class RunData:
    path: Path
    name: str
    plan: dict | None = None
    config: dict | None = None
    metrics: list[dict] = field(default_factory=list)
    eval: dict | None = None
    summary: dict | None = None
    notes: list[str] = field(default_factory=list)


def read_run(path: str | os.PathLike, name: str) -> RunData:
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{path}: no such folder; give run folders written by `vlft run`")
    if not any((p / f).is_file() for f in RUN_FILES):
        raise ConfigError(
            f"{path}: not a run folder (none of {', '.join(RUN_FILES)} is there); "
            "give folders written by `vlft run` (its --output)"
        )
    run = RunData(p, name)
    for file, attr in (
        ("plan.json", "plan"),
        ("config.json", "config"),
        ("eval.json", "eval"),
        ("summary.json", "summary"),
    ):
        f = p / file
        if not f.is_file():
            run.notes.append(f"{file} is missing" + (" (the run did not finish)" if file == "summary.json" else ""))
            continue
        try:
            setattr(run, attr, json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            run.notes.append(f"{file} cannot be read ({e.__class__.__name__}: {e})")
    f = p / "metrics.jsonl"
    if f.is_file():
        bad = 0
        for line in f.read_text().splitlines():
            if line.strip():
                try:
                    run.metrics.append(json.loads(line))
                except ValueError:
                    bad += 1  # a run killed mid-write leaves a partial last line
        if bad:
            run.notes.append(f"metrics.jsonl: {bad} unreadable line(s) skipped")
    else:
        run.notes.append("metrics.jsonl is missing: no curves for this run")
    return run


def _get(d: Any, *keys, default=None) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _total_time(seconds: list[float]) -> str:
    """``12.3 s (5x)``: the seconds of all the times something ran (evaluations, saves), and how many."""
    return f"{sum(seconds):.2f} s ({len(seconds)}x)" if seconds else "-"


def table_rows(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    """The comparison table: one row per run."""
    fields = sorted({k for r in runs for k in (_get(r.eval, "after", "fields") or {})})
    header = [
        "run",
        "backend",
        "device",
        "method",
        "precision",
        "adapted modules",
        "adapter params",
        "steps",
        "median step time",
        "eval time",
        "checkpoint time",
        "samples/s",
        "tokens/s",
        "effective tokens/s",
        "MFU",
        "peak memory",
        "exact match before",
        "exact match after",
    ]
    header += [f"{f} acc / F1 after" for f in fields]
    figures = scorer_figures(runs)
    header += [f"{f} before / after" for f in figures]
    rows = []
    for r in runs:
        logged = [m for m in r.metrics if "loss" in m]
        # the first logged window holds start-up (compilation, allocator warm-up): left out of the median
        steady = logged[1:] or logged
        step_time = _median([m.get("step_time_s") for m in steady])
        sps = _median([m.get("samples_per_s") for m in steady])
        # evaluation and checkpoint saving are not in the step time: their totals, and how often
        evals = [m["eval_time_s"] for m in r.metrics if m.get("eval_time_s") is not None]
        saves = [m["checkpoint_time_s"] for m in r.metrics if m.get("checkpoint_time_s") is not None]
        tps = _median([m.get("tokens_per_s") for m in steady])
        eff = _median([m.get("effective_tokens_per_s") for m in steady])
        mfu = _median([m.get("mfu") for m in steady])
        peaks = [p for p in (m.get("peak_memory_bytes") for m in r.metrics) if p is not None]
        peak = _get(r.summary, "peak_memory_bytes") or (max(peaks) if peaks else None)
        backend = _get(r.plan, "backend", "name") or _get(r.summary, "backend") or "-"
        devtype, count = _get(r.plan, "backend", "device_type"), _get(r.plan, "backend", "device_count")
        device = f"{devtype} x{count}" if devtype else "-"
        world = _get(r.plan, "training", "world_size") or 1
        if devtype and (world > 1 or _get(r.plan, "sharding", "strategy") == "fsdp"):
            sharded = _get(r.plan, "sharding", "strategy") == "fsdp"
            device += f" ({world} process{'es' if world > 1 else ''}{', FSDP' if sharded else ''})"
        modules = _get(r.plan, "targets", "modules")
        steps = _get(r.summary, "steps") or (logged[-1]["step"] if logged else None)
        row = [
            r.name,
            backend,
            device,
            _get(r.plan, "method", "name") or _get(r.summary, "method") or "-",
            _get(r.plan, "precision", "name") or "-",
            str(len(modules)) if modules is not None else "-",
            f"{_get(r.plan, 'targets', 'adapter_parameters'):,}"
            if _get(r.plan, "targets", "adapter_parameters") is not None
            else "-",
            str(steps) if steps is not None else "-",
            f"{step_time:.3f} s" if step_time is not None else "-",
            _total_time(evals),
            _total_time(saves),
            f"{sps:.2f}" if sps is not None else "-",
            f"{tps:,.0f}" if tps is not None else "-",
            f"{eff:,.0f}" if eff is not None else "-",
            _pct(mfu),
            f"{peak / 2**30:.2f} GiB" if peak else "-",
            _pct(_get(r.eval, "before", "exact_match")),
            _pct(_get(r.eval, "after", "exact_match")),
        ]
        for f in fields:
            m = _get(r.eval, "after", "fields", f)
            row.append(f"{m['accuracy']:.1%} / {m['f1']:.1%}" if m else "-")
        for f in figures:
            row.append(f"{_pct(_number(_get(r.eval, 'before', f)))} / {_pct(_number(_get(r.eval, 'after', f)))}")
        rows.append(row)
    return header, rows


def scorer_figures(runs: list[RunData]) -> list[str]:
    """The figures of the runs' scorers (``--scorer``) beyond exact match and the fields' table, in the order
    the runs' eval.json lists them: ANLS, relaxed accuracy, IoU, BLEU, ..."""
    out: list[str] = []
    for r in runs:
        for keys in (_get(r.eval, "after", "scorers") or _get(r.eval, "before", "scorers") or {}).values():
            out += [k for k in keys if k not in ("exact_match", "fields") and k not in out]
    return out


def _number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _flatten(d, prefix="") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(runs: list[RunData]) -> list[tuple[str, list[str]]]:
    """Settings, asked for or resolved, whose values are not the same in every run."""
    per_run = []
    for r in runs:
        values = {k: v for k, v in _flatten(r.config).items() if k not in NOT_CHOICES}
        resolved = {
            "resolved.backend": _get(r.plan, "backend", "name"),
            "resolved.precision": _get(r.plan, "precision", "name"),
            "resolved.param_dtype": _get(r.plan, "param_dtype", "dtype"),
            "resolved.attention": f"vision={_get(r.plan, 'attention', 'vision')} text={_get(r.plan, 'attention', 'text')}"
            if r.plan
            else None,
            "resolved.lr": _get(r.plan, "method", "lr"),
            "resolved.checkpointing": _get(r.plan, "checkpointing", "enabled"),
            "resolved.model": _get(r.plan, "model"),
        }
        values.update({k: v for k, v in resolved.items() if v is not None})
        values.update({f"method.{k}": v for k, v in (_get(r.plan, "method", "hyperparameters") or {}).items()})
        values.update({f"versions.{k}": v for k, v in (_get(r.plan, "backend", "versions") or {}).items()})
        per_run.append(values)
    keys = sorted({k for v in per_run for k in v})
    diffs = []
    for k in keys:
        shown = [json.dumps(v[k]) if k in v else "(absent)" for v in per_run]
        if len(set(shown)) > 1:
            diffs.append((k, shown))
    return diffs


def objective_plots(runs: list[RunData]) -> list[tuple[str, list[Plot]]]:
    """[(objective, its plots)]: one chart per figure each run's objective logs (its plan.json names them:
    DPO's reward margin and preference accuracy, GRPO's reward, KL and clip fraction, a plugin's own), with the
    validation's ``val_<figure>`` beside the training one, for the figures some run's metrics hold."""
    taken = {plot.key for plot in PLOTS}
    out: dict[str, list[Plot]] = {}
    for r in runs:
        name = _get(r.plan, "objective", "name")
        for figure in _get(r.plan, "objective", "figures") or []:
            plots = out.setdefault(name, [])
            if figure in taken or not any(figure in m for run in runs for m in run.metrics):
                continue
            taken.add(figure)
            plots.append(Plot(f"{figure}.png", figure, f"{figure} ({name})", figure, validation=True))
    return [(name, plots) for name, plots in out.items() if plots]


def series(runs: list[RunData], key: str, scale: float = 1.0) -> list[tuple[str, list, list]]:
    """[(run name, steps, values)] of ``key`` in each run's metrics that logs it."""
    out = []
    for r in runs:
        points = [(m["step"], m[key] / scale) for m in r.metrics if m.get(key) is not None and "step" in m]
        if points:
            xs, ys = zip(*points)
            out.append((r.name, list(xs), list(ys)))
    return out


def draw_plots(runs: list[RunData], plots: list[Plot], folder: Path) -> dict[str, str]:
    """One PNG per plot, every run on one chart; returns {file: note} for charts with no data."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display, same pixels everywhere
    import matplotlib.pyplot as plt

    empty = {}
    for plot in plots:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        lines = [(name, xs, ys, "-") for name, xs, ys in series(runs, plot.key, plot.scale)]
        if plot.validation:
            lines += [
                (f"{name} (validation)", xs, ys, "--") for name, xs, ys in series(runs, f"val_{plot.key}", plot.scale)
            ]
        for name, xs, ys, style in lines:
            ax.plot(xs, ys, style, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
        ax.set_title(plot.title)
        ax.set_xlabel("step")
        ax.set_ylabel(plot.ylabel)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend()
        else:
            note = f"no run logged {plot.key}" + (" (set --eval-every)" if plot.key == "val_loss" else "")
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="gray")
            empty[plot.file] = note
        fig.tight_layout()
        fig.savefig(folder / plot.file, format="png")
        plt.close(fig)
    return empty


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in row] for row in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(runs: list[RunData], output: Path) -> Path:
    """Write report.md, report.html and the PNGs into ``output`` (a new or empty folder, filled atomically)."""
    header, rows = table_rows(runs)
    diffs = config_differences(runs)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        sections = [("Plots", list(PLOTS)), *[(f"{name} figures", plots) for name, plots in objective_plots(runs)]]
        empty = draw_plots(runs, [plot for _, plots in sections for plot in plots], tmp)
        notes = [f"{r.name} ({r.path}): {n}" for r in runs for n in r.notes]
        notes += [f"{file}: {note}" for file, note in empty.items()]
        diff_header = ["setting", *[r.name for r in runs]]
        diff_rows = [[k, *vals] for k, vals in diffs]
        sources = ", ".join(f"{r.name} = {r.path}" for r in runs)

        md = [
            "# vlft report",
            "",
            f"Runs: {sources}",
            "",
            "## Comparison",
            "",
            _md_table(header, rows),
            "",
            "Median step time and samples/s leave out the first logged window (start-up); "
            "accuracy / F1 are per field, after training.",
        ]
        for heading, plots in sections:
            md += ["", f"## {heading}", ""] + [f"![{plot.title}]({plot.file})" for plot in plots]
        md += ["", "## What differs between the runs", ""]
        md += [_md_table(diff_header, diff_rows) if diff_rows else "Nothing: the runs have the same settings."]
        if notes:
            md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
        (tmp / "report.md").write_text("\n".join(md) + "\n")

        figures = "".join(
            f"<h2>{html.escape(heading)}</h2>"
            + "".join(
                f'<figure><img alt="{html.escape(plot.title)}" src="data:image/png;base64,'
                f'{base64.b64encode((tmp / plot.file).read_bytes()).decode()}"><figcaption>{html.escape(plot.title)}'
                f"</figcaption></figure>"
                for plot in plots
            )
            for heading, plots in sections
        )
        page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vlft report</title>
<style>
body{{font-family:sans-serif;margin:2em;max-width:1400px}}
table{{border-collapse:collapse;margin:1em 0;font-size:0.9em}}
th,td{{border:1px solid #bbb;padding:4px 8px;text-align:left}} th{{background:#eee}}
figure{{display:inline-block;margin:0.5em}} img{{max-width:640px}} .note{{color:#a33}}
</style></head><body>
<h1>vlft report</h1><p>Runs: {html.escape(sources)}</p>
<h2>Comparison</h2>{_html_table(header, rows)}
<p>Median step time and samples/s leave out the first logged window (start-up); accuracy / F1 are per field,
after training.</p>
{figures}
<h2>What differs between the runs</h2>
{_html_table(diff_header, diff_rows) if diff_rows else "<p>Nothing: the runs have the same settings.</p>"}
{"<h2>Notes</h2><ul>" + "".join(f'<li class="note">{html.escape(n)}</li>' for n in notes) + "</ul>" if notes else ""}
</body></html>
"""
        (tmp / "report.html").write_text(page)
        if output.exists():
            output.rmdir()  # checked empty by the caller
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def run_names(paths: list[str]) -> list[str]:
    """Short names for the runs: the folder names, made unique with their parents where they clash."""
    names = [Path(p).resolve().name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{Path(p).resolve().parent.name}/{Path(p).resolve().name}" for p in paths]


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--output",
    default="report",
    show_default=True,
    type=click.Path(file_okay=False),
    help="The report folder to write (new or empty).",
)
@user_errors
def report(runs, output):
    """Compare run folders: a table, loss/LR/step-time/memory plots, each objective's figures (DPO's reward
    margin, GRPO's reward and clip fraction, ...) and the settings that differ."""
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output {output} already exists and is not empty; choose a new folder")
    data = [read_run(p, n) for p, n in zip(runs, run_names(list(runs)))]
    write_report(data, out)
    header, rows = table_rows(data)
    width = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for line in [header, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(line, width)).rstrip())
    for r in data:
        for n in r.notes:
            click.echo(f"note: {r.name}: {n}")
    click.echo(f"report written to {out / 'report.html'} and {out / 'report.md'}")
