"""Video decoding with PyAV (FFmpeg's libraries, wheels on PyPI): frames sampled at a fixed rate, capped.

The frames go through the processor's own video processor (``Qwen2VLVideoProcessor``), so resizing and
temporal patching are the model's; only the decoding and the sampling rate are decided here.
"""

from __future__ import annotations

import numpy as np


class VideoError(Exception):
    pass


def _open(path: str):
    try:
        import av  # optional: PyAV is needed only for video records
    except ImportError:  # pragma: no cover - av is a dependency
        raise VideoError("video needs PyAV: pip install av") from None
    try:
        return av.open(path)
    except Exception as e:  # noqa: BLE001 - PyAV raises its own FFmpeg error classes; each becomes a VideoError
        raise VideoError(f"{e.__class__.__name__}: {e}") from None


def probe_video(path: str) -> None:
    """Raise VideoError unless the file holds a video stream whose first frame decodes."""
    with _open(path) as container:
        if not container.streams.video:
            raise VideoError("no video stream in the file")
        try:
            next(container.decode(video=0))
        except StopIteration:
            raise VideoError("the video stream holds no frame") from None
        except Exception as e:  # noqa: BLE001 - a bad stream's decoder errors, whatever their class
            raise VideoError(f"{e.__class__.__name__}: {e}") from None


def read_frames(path: str, fps: float, max_frames: int) -> tuple[np.ndarray, float]:
    """(frames as (T, H, W, 3) uint8, the frame rate they were sampled at).

    Frames are taken every 1/``fps`` seconds of presentation time, at most ``max_frames`` of them (spread over
    the whole clip when there are more), and an even count, because Qwen2.5-VL patches 2 frames together.
    """
    with _open(path) as container:
        frames, times = [], []
        try:
            for frame in container.decode(video=0):
                frames.append(frame.to_ndarray(format="rgb24"))
                times.append(float(frame.time) if frame.time is not None else len(times) / fps)
        except Exception as e:  # noqa: BLE001 - a bad stream's decoder errors, whatever their class
            raise VideoError(f"{e.__class__.__name__}: {e}") from None
    if not frames:
        raise VideoError("the video stream holds no frame")
    picks, next_t = [], times[0]
    for i, t in enumerate(times):
        if t + 1e-6 >= next_t:
            picks.append(i)
            next_t = t + 1.0 / fps
    rate = fps
    if len(picks) > max_frames:
        spread = np.linspace(0, len(picks) - 1, max_frames).round().astype(int)
        picks = [picks[i] for i in spread]
        span = max(times[-1] - times[0], 1e-6)
        rate = len(picks) / span
    if len(picks) % 2:
        picks.append(picks[-1])  # repeat the last frame: a temporal patch is 2 frames
    return np.stack([frames[i] for i in picks]), rate
