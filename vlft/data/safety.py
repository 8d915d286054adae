"""Hostile input turned into data problems: every check here raises ``ValueError``/``DataError`` with a
message a user can act on, never a traceback, a hang or a huge allocation.

- images: PIL's decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``) applies from the first pixel over the
  limit (PIL only warns up to twice the limit), truncated files are an error (never padded with grey);
- image paths: only regular files, so a symlink to ``/dev/zero`` or to a folder is refused before it is read;
- data files: empty files and files that are not UTF-8 are one clear error naming the byte and line.
"""

from __future__ import annotations

import io
import stat
import warnings
from pathlib import Path

from PIL import Image, ImageFile

from vlft.errors import DataError


def open_image(source: str | bytes) -> Image.Image:
    """Open and fully decode an image from a path or bytes, in RGB; over-large or truncated images raise
    ``ValueError``/``OSError`` (data problems), not PIL's ``DecompressionBombError`` or a partial image."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:  # a process-wide switch another library may have turned on
        ImageFile.LOAD_TRUNCATED_IMAGES = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
            img.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ValueError(
                f"image too large ({e}); vlft refuses images over {Image.MAX_IMAGE_PIXELS} pixels, a guard against "
                f"decompression bombs: resize it"
            ) from None
    return img.convert("RGB")


def image_file_problem(path: Path) -> str | None:
    """Why ``path`` (symlinks followed) is not a regular file to read an image from, or None."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return f"cannot be opened ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    kind = "a folder" if stat.S_ISDIR(mode) else "a device, pipe or socket"
    via = f" (a symlink to {path.resolve()})" if path.is_symlink() else ""
    return f"is {kind}{via}, not an image file"


def read_text_file(path: Path) -> str:
    """A data file's text: an empty file or one that is not UTF-8 is a ``DataError`` naming the place."""
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"{path} is empty; it should hold JSON Lines or a JSON array of records.")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save the file as "
            f"UTF-8 (e.g. iconv -f latin1 -t utf-8)."
        ) from None
