"""``vlft data check FILE...``: read and measure data files as ``vlft run`` would, train nothing.

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from vlft.cli import user_errors

PROGRESS_FROM = 1_000  # records in a file from which `vlft data check` draws a progress bar


@click.group()
def data():
    """Work with data files."""


@data.command()
@click.argument("files", nargs=-1, required=True)
@click.option("--model", default=None, help="Model whose processor measures the lengths; default: the embedded one.")
@click.option("--image-root", default=None, help="Folder relative image/video paths start from (as `vlft run`).")
@click.option("--add-placeholders", is_flag=True, help="As `vlft run --add-placeholders`.")
@click.option("--columns", default=None, metavar="OURS=THEIRS,...", help="As `vlft run --columns`.")
@click.option("--max-pixels", type=int, default=None, help="As `vlft run --max-pixels`.")
@click.option("--video-fps", type=float, default=2.0, show_default=True)
@click.option("--video-max-frames", type=int, default=16, show_default=True)
@click.option(
    "--objective",
    default="sft",
    show_default=True,
    help="As `vlft run --objective`: the records are read and checked in its layout (dpo: chosen and "
    "rejected; see `vlft objectives`).",
)
@click.option(
    "--reward",
    "rewards",
    multiple=True,
    metavar="NAME|MODULE:FUNCTION",
    help="As `vlft run --reward` (grpo): each reward must score every record's reference.",
)
@click.option("--longest", default=5, show_default=True, help="How many of the longest records to list.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors  # params: click passes each option as an argument of its own
def check(
    files,
    model,
    image_root,
    add_placeholders,
    columns,
    max_pixels,
    video_fps,
    video_max_frames,
    objective,
    rewards,
    longest,
    as_json,
):
    """Validate FILE... (records, turns, images, videos, token lengths) with the messages `vlft run` gives.

    A FILE is JSON, JSONL, Parquet or Arrow, a saved `datasets` folder, a folder of shards or a glob.
    Exits non-zero when any record has a problem."""
    from tqdm.auto import tqdm

    from vlft.config import RunConfig, parse_columns
    from vlft.data.columnar import unread_columns
    from vlft.data.encoding import SampleEncoder
    from vlft.data.layouts import record_format
    from vlft.data.lengths import measure_all
    from vlft.data.records import read_records_collecting
    from vlft.errors import DataError
    from vlft.models.loading import (
        load_processor,
        model_config_and_family,
        resolve_model_path,
    )
    from vlft.registry import get_registry

    # the objective as a run resolves it: its layout reader, its samples' encoder, its own checks
    registry = get_registry()
    config = RunConfig(objective=objective, objective_options={"reward": list(rewards)} if rewards else {})
    chosen = registry.objective_for(config)
    layout = record_format(chosen.layout)
    path = resolve_model_path(model, registry)
    _, family = model_config_and_family(path, registry)
    encoder = SampleEncoder(
        load_processor(path, family, registry),
        max_pixels=max_pixels,
        video_fps=video_fps,
        video_max_frames=video_max_frames,
        family=family,
    )
    encoder = layout.encoder(encoder)
    mapping = parse_columns(columns)
    report: dict[str, Any] = {"files": [], "problems": [], "notes": []}
    measured = []
    for name in files:
        entry = {"file": name}
        try:
            records, problems = read_records_collecting(
                Path(name),
                image_root=image_root,
                add_placeholders=add_placeholders,
                columns=mapping,
                parse=layout.parse,
            )
            unread = unread_columns(name, mapping)
        except DataError as e:
            report["problems"].append(str(e))
            report["files"].append(entry)
            continue
        report["problems"] += problems.items + (
            [f"... and {problems.count - len(problems.items)} more in {name}"]
            if problems.count > len(problems.items)
            else []
        )
        layouts: dict[str, int] = {}
        for r in records:
            layouts[r.layout] = layouts.get(r.layout, 0) + 1
        # long sets: measured by parallel workers, with a progress bar on stderr (not in --json's stdout)
        with tqdm(
            total=len(records),
            desc=f"checking {Path(name).name}",
            unit="record",
            leave=False,
            disable=len(records) < PROGRESS_FROM,
            file=sys.stderr,
        ) as bar:
            results = measure_all(records, encoder, bar.update)
        for r, result in zip(records, results):
            if isinstance(result, DataError):
                report["problems"].append(str(result))
                continue
            measured.append((result[0], f"{Path(name).parent / r.where}"))
        report["problems"] += chosen.check(records)  # the objective's own problems (GRPO: unscorable references)
        report["notes"] += [
            f"{file}: columns not read: {', '.join(cols)} (--columns OURS=THEIRS reads one as a key vlft knows)"
            for file, cols in unread.items()
        ]
        entry.update(
            records=len(records),
            problems=problems.count,
            layouts=layouts,
            unread_columns=unread,
            turns=sum(len(r.turns) for r in records),
            images=sum(len(r.images) for r in records),
            videos=sum(len(r.videos) for r in records),
            max_images_per_record=max((len(r.images) for r in records), default=0),
            max_videos_per_record=max((len(r.videos) for r in records), default=0),
        )
        report["files"].append(entry)
    lengths = sorted(n for n, _ in measured)
    if lengths:
        report["tokens"] = {
            "min": lengths[0],
            "median": lengths[len(lengths) // 2],
            "p95": lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))],
            "max": lengths[-1],
        }
    report["longest"] = [{"where": w, "tokens": n} for n, w in sorted(measured, reverse=True)[:longest]]
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for f in report["files"]:
            if "records" in f:
                click.echo(
                    f"{f['file']}: {f['records']} records ({', '.join(f'{k} {v}' for k, v in f['layouts'].items())}), "
                    f"{f['turns']} turns, {f['images']} images, {f['videos']} videos; "
                    f"{f['problems']} problem(s)"
                )
        if lengths:
            t = report["tokens"]
            click.echo(
                f"tokens (image tokens included): min {t['min']}, median {t['median']}, p95 {t['p95']}, max {t['max']}"
            )
            for item in report["longest"]:
                click.echo(f"  {item['where']}: {item['tokens']} tokens")
        for n in report["notes"]:
            click.echo(f"note: {n}")
        for p in report["problems"]:
            click.echo(f"problem: {p}", err=True)
    if report["problems"]:
        raise click.ClickException(f"{len(report['problems'])} problem(s) found; fix them and check again")
