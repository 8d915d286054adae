"""The checked data, kept: a run's preflight check of its data files is cached in the user's cache
(``VLFT_CACHE``, else ``~/.cache/vlft``) under ``checked/``, so ``--resume`` and later runs on unchanged
files skip it, and under torchrun one process per machine (local rank 0) checks while the others wait for
its result.

The cache key covers what decides the result: every data file's path, size, modification time and SHA-256
(each shard of a folder or glob), the options that read and measure them (``--objective``, ``--columns``,
``--max-new-tokens``: a generating objective's rows are measured with it,
``--image-root``, ``--add-placeholders``, ``--max-length``,
``--skip-too-long``, ``--max-pixels``, video rate and frames, the seed, the data weights) and the processor
(its chat template, tokenizer and image processor settings). A cached result also lists every image and
video file it read with its size and modification time; it is used only while each of them is unchanged,
so nothing is trained on data that was not checked as it is now. An objective's own check of the records
(``Objective.check``: GRPO's rewards on the references) runs every time, outside this cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from pathlib import Path

from vlft.errors import DataError
from vlft.models.embedded import cache_root

VERSION = 1
WAIT_S = 1800  # how long a process waits for local rank 0's check before checking itself
POLL_S = 0.5


def cache_dir() -> Path:
    return cache_root() / "checked"


def _file_digest(path: Path) -> dict:
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}


def _processor_identity(encoder) -> dict:
    proc = encoder.processor
    tok = encoder.tokenizer
    ip = getattr(proc, "image_processor", None)
    return {
        "class": type(proc).__name__,
        "chat_template": getattr(proc, "chat_template", None) or "",
        "tokenizer": getattr(tok, "name_or_path", ""),
        "vocab": len(tok),
        "eos": tok.eos_token,
        "family": encoder.family.name,
        "image_processor": json.dumps(ip.to_dict(), sort_keys=True, default=str) if ip is not None else "",
        "max_pixels": encoder.max_pixels,
        "video": [encoder.video_fps, encoder.video_max_frames],
    }


def cache_key(config, encoder, files: list[Path]) -> str:
    """The key of ``config``'s checked data: data files' contents, the options that read them, the processor."""
    options = {
        k: getattr(config, k, None)
        for k in (
            "data",
            "val_data",
            "columns",
            "image_root",
            "add_placeholders",
            "max_length",
            "skip_too_long",
            "max_pixels",
            "video_fps",
            "video_max_frames",
            "seed",
            "objective",
            "max_new_tokens",
        )
    }
    payload = {
        "version": VERSION,
        "files": [_file_digest(f) for f in files],
        "options": options,
        "processor": _processor_identity(encoder),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def media_files(records) -> dict[str, tuple[int, int]]:
    """Every image and video file the records name, with (size, mtime_ns) as they were checked (images stored
    in a data file are covered by that file's digest)."""
    seen: dict[str, tuple[int, int]] = {}
    for rec in records:
        for source in [*rec.images, *rec.videos]:
            if isinstance(source, str) and source not in seen:
                st = os.stat(source)
                seen[source] = (st.st_size, st.st_mtime_ns)
    return seen


def _unchanged(media: dict[str, tuple[int, int]]) -> bool:
    for path, (size, mtime) in media.items():
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return False
    return True


def load(key: str):
    """The cached result for ``key`` while every file it read is unchanged, a DataError it stopped on, or None."""
    path = cache_dir() / f"{key}.pkl"
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None
    if entry.get("version") != VERSION:
        return None
    if "error" in entry:  # a problem is shared with the other processes of the same job only
        return DataError(entry["error"]) if entry.get("job") and entry["job"] == _job() else None
    return entry["result"] if _unchanged(entry["media"]) else None


def store(key: str, result=None, media: dict | None = None, error: str | None = None) -> None:
    """Write the entry atomically; a cache that cannot be written only costs the next run its check."""
    folder = cache_dir()
    entry = {"version": VERSION, "media": media or {}}
    if error is not None:
        entry["error"], entry["job"] = error, _job()
    else:
        entry["result"] = result
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, folder / f"{key}.pkl")
    except OSError:
        pass


def checked(config, encoder, files: list[Path], check, media_of):
    """``check()``'s result (train, val, lengths), from the cache where it holds one for these files. Under
    torchrun only local rank 0 runs ``check``; the others wait for its entry (up to ``WAIT_S``, then check
    themselves). ``media_of(result)`` lists the media files the result was checked against."""
    key = cache_key(config, encoder, files)
    found = load(key)
    if found is None and getattr(config, "world_size", 1) > 1 and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        deadline = time.monotonic() + WAIT_S
        while found is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            found = load(key)
    if isinstance(found, DataError):
        raise found
    if found is not None:
        return found
    try:
        result = check()
    except DataError as e:
        if _job():
            store(key, error=str(e))
        raise
    store(key, result, media_of(result))
    return result


def _job() -> str:
    """torchrun's id of this job (the same in every process of it), or "" outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")
