"""``vlft data convert``: a checked data set written again, as Parquet with its images embedded as bytes, or as
JSON Lines with its images written to a folder beside it.

Both outputs use the messages layout with string content and one ``<image>`` (``<video>``) where each image
(clip) stands, the layout ms-swift and LLaMA-Factory read and vlft reads back to the same records:
``{"messages": [{"role", "content", "loss"?}], "images": [...], "videos"?: [...], "id"?}``. In Parquet each
image is a ``{"bytes", "path"}`` struct, described as a ``datasets.Image`` column in the schema's metadata (so
`datasets` and TRL open the images as pictures); the bytes are the source file's own, never re-encoded. Videos stay paths (absolute).

The input is read and checked first, as ``vlft run`` reads it: a bad record stops the conversion before
anything is written. Records are written in row groups of ``ROW_GROUP_ROWS`` (a sample's image is read
with its row group's image column, so groups stay small).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from vlft.data.columnar import StoredImage
from vlft.data.records import Record, read_records
from vlft.errors import DataError

ROW_GROUP_ROWS = 100
_EXTENSIONS = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tiff"}


@dataclass
class Converted:
    records: int
    images: int  # image entries written (one per image per record)
    image_files: int  # distinct image files written beside JSON Lines (0 for Parquet)
    out: Path
    images_dir: Path | None = None


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    image_root: str | None = None,
    add_placeholders: bool = False,
    columns: dict[str, str] | None = None,
) -> Converted:
    """Read and check ``src`` (any format ``--data`` takes), then write it to ``out`` (``.parquet``, ``.jsonl``)."""
    out = Path(out)
    kind = {".parquet": "parquet", ".jsonl": "jsonl"}.get(out.suffix)
    if kind is None:
        raise DataError(f"{out}: write to a .parquet or a .jsonl file")
    if out.exists():
        raise DataError(f"{out} already exists; choose another name (nothing was written)")
    records = read_records(Path(src), image_root=image_root, add_placeholders=add_placeholders, columns=columns)
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "parquet":
        return _write_parquet(records, out)
    return _write_jsonl(records, out)


def _messages(record: Record, with_loss: bool) -> list[dict]:
    messages = []
    for t in record.turns:
        message: dict[str, Any] = {"role": t.role, "content": t.text}
        if with_loss:
            message["loss"] = None if t.trained else False
        messages.append(message)
    return messages


def _image_bytes(source: str | bytes | StoredImage) -> tuple[bytes, str | None]:
    """(the image's bytes as stored, its file name where it had one)."""
    if isinstance(source, StoredImage):
        return source.read(), None
    if isinstance(source, bytes):
        return source, None
    return Path(source).read_bytes(), Path(source).name


def _write_parquet(records: list[Record], out: Path) -> Converted:
    # only a conversion to Parquet needs the writer
    import pyarrow as pa
    import pyarrow.parquet as pq  # (the writer itself)

    with_loss = any(not t.trained for r in records for t in r.turns)
    message = [("role", pa.string()), ("content", pa.string())] + ([("loss", pa.bool_())] if with_loss else [])
    fields = [
        ("messages", pa.list_(pa.struct(message))),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ]
    if any(r.videos for r in records):
        fields.append(("videos", pa.list_(pa.string())))
    if any(r.id is not None for r in records):
        fields.append(("id", pa.string()))
    schema = pa.schema(
        fields,
        metadata={"huggingface": json.dumps(_features(schema_names=[n for n, _ in fields], with_loss=with_loss))},
    )
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    images = 0
    try:
        with pq.ParquetWriter(str(tmp), schema) as writer:
            for start in range(0, len(records), ROW_GROUP_ROWS):
                rows = []
                for r in records[start : start + ROW_GROUP_ROWS]:
                    row = {
                        "messages": _messages(r, with_loss),
                        "images": [dict(zip(("bytes", "path"), _image_bytes(s))) for s in r.images],
                    }
                    if "videos" in schema.names:
                        row["videos"] = list(r.videos)
                    if "id" in schema.names:
                        row["id"] = None if r.id is None else str(r.id)
                    images += len(r.images)
                    rows.append(row)
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return Converted(len(records), images, 0, out)


def _features(schema_names: list[str], with_loss: bool) -> dict:
    """`datasets`' description of the columns (the schema metadata it reads), so `datasets` and TRL open the
    images as ``Image`` features. The list-of-dict and ``Sequence`` forms: read by `datasets` 2 to 5."""

    def value(dtype: str) -> dict:
        return {"dtype": dtype, "_type": "Value"}

    message = {"role": value("string"), "content": value("string"), **({"loss": value("bool")} if with_loss else {})}
    known = {
        "messages": [message],
        "images": {"feature": {"_type": "Image"}, "_type": "Sequence"},
        "videos": {"feature": value("string"), "_type": "Sequence"},
        "id": value("string"),
    }
    return {"info": {"features": {name: known[name] for name in schema_names}}}


def _write_jsonl(records: list[Record], out: Path) -> Converted:
    """Each distinct image once, named by its content's hash, in ``OUT-images/`` beside the file."""
    folder = out.with_name(f"{out.stem}-images")
    written: dict[str, str] = {}  # digest -> the path the records name
    lines, images = [], 0
    for r in records:
        names = []
        for source in r.images:
            data, _ = _image_bytes(source)
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            if digest not in written:
                with Image.open(io.BytesIO(data)) as img:
                    suffix = _EXTENSIONS.get(img.format or "", ".img")
                folder.mkdir(exist_ok=True)
                (folder / f"{digest}{suffix}").write_bytes(data)
                written[digest] = f"{folder.name}/{digest}{suffix}"
            names.append(written[digest])
            images += 1
        line = {"messages": _messages(r, with_loss=False), "images": names}
        for m, t in zip(line["messages"], r.turns):
            if not t.trained:
                m["loss"] = False
        if r.videos:
            line["videos"] = list(r.videos)
        if r.id is not None:
            line["id"] = r.id
        lines.append(json.dumps(line, ensure_ascii=False))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return Converted(len(records), images, len(written), out, folder if written else None)
