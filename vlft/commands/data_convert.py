"""``vlft data convert IN OUT``: a data set checked and written again, as Parquet with its images embedded or as
JSON Lines with its images in a folder beside it (``vlft.data.convert``).

Imports inside functions: the CLI imports this module at start to register its command, so the data stage
loads only when the command runs.
"""

from __future__ import annotations

import click

from vlft.cli import user_errors


@click.command()
@click.argument("src")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--image-root", default=None, help="Folder relative image/video paths start from (as `vlft run`).")
@click.option("--add-placeholders", is_flag=True, help="As `vlft run --add-placeholders`.")
@click.option("--columns", default=None, metavar="OURS=THEIRS,...", help="As `vlft run --columns`.")
@user_errors
def convert(src, out, image_root, add_placeholders, columns):
    """Write SRC (any data `vlft run` reads) to OUT: a .parquet file (messages with <image> placeholders, images
    embedded as {bytes, path}) or a .jsonl file (images written once each to OUT-images/ beside it).

    SRC is read and checked first; a bad record stops it before anything is written."""
    from vlft.config import parse_columns
    from vlft.data.convert import convert as run_conversion

    done = run_conversion(
        src, out, image_root=image_root, add_placeholders=add_placeholders, columns=parse_columns(columns)
    )
    beside = f", {done.image_files} image file(s) in {done.images_dir}" if done.images_dir else ""
    click.echo(f"wrote {done.records} records with {done.images} image(s) to {done.out}{beside}")
