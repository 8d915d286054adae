"""Synthetic sets for the scorers' kinds of task (``vlft demo-data OUT --task counting|grounding``), written as the
product-inspection set is (JSONL with relative image paths, ``imgs/``, deterministic for a seed).

- ``counting``: one to three large dark discs on a light background; "How many discs are there?" is answered
  with the number alone (``2``), so ``--scorer auto`` picks relaxed accuracy.
- ``grounding``: one coloured square (64 pixels, in one of 9 places); "Where is the square?" is answered with its
  box ``[x1, y1, x2, y2]`` in the model family's coordinate convention (``absolute``: pixels of the 112-pixel
  image, which Qwen2.5-VL's processor keeps at that size; ``relative-1000``; ``relative-1``), so ``auto`` picks IoU.

The embedded model starts from random weights: in 40 steps of 4 it learns to count the discs (relaxed accuracy
0 to 1.0 on 12 validation records); in 60 it learns where the square is for most images (IoU 0 to 0.67), and
GRPO with ``--reward iou`` raises that (docs/scorers.md has the figures).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from vlft.data.demo import IMAGE_SIZE, DemoDataset, write_splits

TASKS = ("counting", "grounding")
COUNTS = (1, 2, 3)
SIDE = 64  # the square's side in pixels: large, so a box near the middle overlaps most answers
CORNERS = (8, 24, 40)  # where its top-left corner lies, on each axis: 9 places


def _background(rng: random.Random) -> Image.Image:
    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(rng.randint(215, 240) for _ in range(3)))


def draw_discs(n: int, rng: random.Random) -> Image.Image:
    """``n`` dark discs of radius 19 to 23 near the middles of separate cells of a 2 x 2 grid: each darkens most of
    its cell (about 12% of the image a disc), so the count shows in how much of the image is dark. Discs of
    radius 10 to 13 anywhere in their cells darkened too little of it: in 100 steps the embedded model answered
    one count for every image."""
    img = _background(rng)
    d = ImageDraw.Draw(img)
    half = IMAGE_SIZE // 2
    for cell in rng.sample(range(4), n):
        r = rng.randint(19, 23)
        cx = (cell % 2) * half + half // 2 + rng.randint(-3, 3)
        cy = (cell // 2) * half + half // 2 + rng.randint(-3, 3)
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(30, 30, 30))
    return img


def draw_square(rng: random.Random) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """A coloured square somewhere in the image, and its box in pixels."""
    img = _background(rng)
    x1, y1 = rng.choice(CORNERS), rng.choice(CORNERS)
    box = (x1, y1, x1 + SIDE, y1 + SIDE)
    ImageDraw.Draw(img).rectangle(box, fill=(200, 40, 40), outline=(60, 60, 60), width=2)
    return img, box


def box_text(box: tuple[int, int, int, int], box_coordinates: str) -> str:
    """``[x1, y1, x2, y2]`` in the family's convention (vlft never converts: the set is written in it)."""
    if box_coordinates == "absolute":
        values = [str(v) for v in box]
    elif box_coordinates == "relative-1000":
        values = [str(round(v * 1000 / IMAGE_SIZE)) for v in box]
    elif box_coordinates == "relative-1":
        values = [f"{v / IMAGE_SIZE:.3f}" for v in box]
    else:
        raise ValueError(f"unknown box convention {box_coordinates!r}")
    return "[" + ", ".join(values) + "]"


def _records(task: str, n: int, rng: random.Random, prefix: str, img_dir: Path, box_coordinates: str):
    for i in range(n):
        name = f"{prefix}_{i:05d}.png"
        if task == "counting":
            count = COUNTS[i % len(COUNTS)]
            draw_discs(count, rng).save(img_dir / name, optimize=False)
            question, answer = "How many discs are there? Answer with a number.", str(count)
        else:
            img, box = draw_square(rng)
            img.save(img_dir / name, optimize=False)
            question = "Where is the square? Answer with its box [x1, y1, x2, y2]."
            answer = box_text(box, box_coordinates)
        yield {
            "id": f"{prefix}-{i}",
            "image": f"imgs/{name}",
            "conversations": [
                {"from": "user", "value": "<image>\n" + question},
                {"from": "assistant", "value": answer},
            ],
        }


def write_task_dataset(
    out: str | os.PathLike,
    task: str,
    n_train: int = 400,
    n_val: int = 40,
    seed: int = 0,
    box_coordinates: str = "absolute",
) -> DemoDataset:
    """Write ``train.jsonl``, ``val.jsonl`` and ``imgs/`` of ``task`` under ``out`` (a temporary folder renamed into
    place, as the product set is)."""
    if task not in TASKS:
        raise ValueError(f"unknown demo task {task!r}; one of {', '.join(TASKS)}")
    return write_splits(
        Path(out),
        lambda n, rng, split, imgs: _records(task, n, rng, split, imgs, box_coordinates),
        n_train,
        n_val,
        seed,
        prefix=".demo-task-",
    )
