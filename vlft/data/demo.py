"""The synthetic product-inspection data set of the embedded default.

Each image shows one product (a rounded box) in one colour, with at most one
defect drawn on it; the assistant must name both, as ``colour: X, defect: Y``.
Generation is deterministic for a given seed: the same files, byte for byte.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 205, 40),
}


DEFECTS: tuple[str, ...] = ("none", "scratch", "crack", "stain", "hole")


QUESTIONS: tuple[str, ...] = (
    "Inspect this product. What is its colour and which defect does it have?",
    "Report the colour of the product and its defect.",
    "What colour is this item, and is it damaged?",
)


IMAGE_SIZE = 112


# what `vlft run` trains on this set when no --epochs/--steps is given: the embedded model
# (random weights, adapters only) needs about 3,200 steps of 4 samples to name the defects
# (LoRA: 97.5% exact match; OFT at its lr of 1e-4: about 60%)
RECOMMENDED_EPOCHS = 8


@dataclass(frozen=True)
class DemoDataset:
    """Where a generated data set lies."""

    root: Path
    train: Path
    val: Path


def answer_for(colour: str, defect: str) -> str:
    return f"colour: {colour}, defect: {defect}"


def draw_product(colour: str, defect: str, rng: random.Random) -> Image.Image:
    """One product photo: light background, jittered box, a bold defect."""
    size = IMAGE_SIZE
    bg = tuple(rng.randint(200, 240) for _ in range(3))
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    margin = rng.randint(8, 18)
    box = (
        margin + rng.randint(-4, 4),
        margin + rng.randint(-4, 4),
        size - margin + rng.randint(-4, 4),
        size - margin + rng.randint(-4, 4),
    )
    base = COLOURS[colour]
    fill = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in base)
    d.rounded_rectangle(box, radius=rng.randint(6, 16), fill=fill, outline=(60, 60, 60), width=2)
    x0, y0, x1, y1 = box
    # defects are bold and near the middle: the embedded model is small and sees 16 image tokens
    cx, cy = size // 2 + rng.randint(-12, 12), size // 2 + rng.randint(-12, 12)
    if defect == "scratch":
        # long, straight gouges across the surface: a bright groove with dark rims
        tilt = rng.choice([-1, 1]) * rng.randint(10, 24)
        for off in (-10, 0, 10):
            line = (x0 + 6, cy + off - tilt, x1 - 6, cy + off + tilt)
            d.line(line, fill=(40, 40, 40), width=6)
            d.line(line, fill=(250, 250, 250), width=2)
    elif defect == "crack":
        # a black zig-zag from top to bottom
        pts, y, k = [], y0 + 4, 0
        while y < y1 - 4:
            pts.append((cx + (9 if k % 2 else -9), y))
            y += rng.randint(8, 12)
            k += 1
        d.line(pts, fill=(10, 10, 10), width=6)
    elif defect == "stain":
        r = rng.randint(22, 28)
        d.ellipse((cx - r, cy - int(r * 0.75), cx + r, cy + int(r * 0.75)), fill=(115, 70, 25))
    elif defect == "hole":
        # a dark hole with a bright rim, where the surface tore
        r = rng.randint(14, 18)
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(0, 0, 0), outline=(255, 255, 255), width=4)
    return img


def _records(n: int, rng: random.Random, prefix: str, img_dir: Path):
    colours, defects = list(COLOURS), list(DEFECTS)
    for i in range(n):
        # cycle through every combination so both splits are balanced
        colour = colours[i % len(colours)]
        defect = defects[(i // len(colours)) % len(defects)]
        name = f"{prefix}_{i:05d}.png"
        draw_product(colour, defect, rng).save(img_dir / name, optimize=False)
        yield {
            "id": f"{prefix}-{i}",
            "image": f"imgs/{name}",
            "conversations": [
                {"from": "user", "value": "<image>\n" + rng.choice(QUESTIONS)},
                {"from": "assistant", "value": answer_for(colour, defect)},
            ],
        }


def write_demo_dataset(out: str | os.PathLike, n_train: int = 1600, n_val: int = 400, seed: int = 0) -> DemoDataset:
    """Write ``train.jsonl``, ``val.jsonl`` and ``imgs/`` under ``out``.

    Written into a temporary folder beside ``out`` and renamed into place, so
    an interrupted run never leaves a half-written data set behind.
    """
    out = Path(out)
    if (out / "train.jsonl").exists() and (out / "val.jsonl").exists():
        return DemoDataset(out, out / "train.jsonl", out / "val.jsonl")
    return write_splits(out, _records, n_train, n_val, seed)


def write_splits(out: Path, records, n_train: int, n_val: int, seed: int, prefix: str = ".demo-data-") -> DemoDataset:
    """``train.jsonl`` and ``val.jsonl`` of ``records(n, rng, split, imgs_folder)`` (one seeded ``rng`` for
    both), with ``imgs/``, written into a temporary folder beside ``out`` and renamed into place, so an
    interrupted write never leaves a half-written data set behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        (tmp / "imgs").mkdir()
        rng = random.Random(seed)
        for split, n in (("train", n_train), ("val", n_val)):
            with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for rec in records(n, rng, split, tmp / "imgs"):
                    f.write(json.dumps(rec) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return DemoDataset(out, out / "train.jsonl", out / "val.jsonl")


PREFERENCE_FILES = ("preferences-train.jsonl", "preferences-val.jsonl")


def wrong_answer(answer: str, rng: random.Random, field: str) -> str:
    """``answer`` (``colour: X, defect: Y``) with ``field`` ("colour" or "defect") changed to another value."""
    values = dict(part.split(": ", 1) for part in answer.split(", "))
    choices = [v for v in (COLOURS if field == "colour" else DEFECTS) if v != values[field]]
    values[field] = rng.choice(choices)
    return answer_for(values["colour"], values["defect"])


def write_demo_preferences(out: str | os.PathLike, n_train: int = 1600, n_val: int = 400, seed: int = 0) -> DemoDataset:
    """The demo task as preference pairs, beside the demo data set in ``out`` (written first if missing) and
    on its images: each record's question with the right answer chosen and, rejected, the same answer with the
    colour (even records) or the defect (odd ones) changed to another value, in LLaMA-Factory's preference
    layout. Deterministic for a seed; each file is written whole and renamed into place."""
    ds = write_demo_dataset(out, n_train=n_train, n_val=n_val, seed=seed)
    rng = random.Random(seed + 1)
    paths = []
    for source, name in zip((ds.train, ds.val), PREFERENCE_FILES):
        target = ds.root / name
        paths.append(target)
        if target.exists():
            continue
        lines = []
        for i, line in enumerate(source.read_text(encoding="utf-8").splitlines()):
            rec = json.loads(line)
            *prompt, reply = rec["conversations"]
            rejected = wrong_answer(reply["value"], rng, "colour" if i % 2 == 0 else "defect")
            lines.append(
                json.dumps(
                    {
                        "id": rec["id"],
                        "images": [rec["image"]],
                        "conversations": prompt,
                        "chosen": reply,
                        "rejected": {"from": reply["from"], "value": rejected},
                    }
                )
            )
        tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
        os.replace(tmp, target)
    return DemoDataset(ds.root, paths[0], paths[1])


UNPAIRED_FILES = ("unpaired-train.jsonl", "unpaired-val.jsonl")


def write_demo_unpaired(out: str | os.PathLike, n_train: int = 1600, n_val: int = 400, seed: int = 0) -> DemoDataset:
    """The demo task as unpaired preferences (KTO's), from the preference pairs beside it (written first if
    missing): each record's question with one reply, in LLaMA-Factory's KTO layout (``messages`` and ``label``):
    the pair's chosen answer (desirable) for records 0, 3, 5, 6 of every 8, its rejected one (undesirable: a
    wrong colour or a wrong defect, as the pair has it) for the others. Half of each, every prompt once, one of
    each kind in every two records in a row (a validation batch of 2 holds both), and every product colour
    (the record's index modulo 4) desirable once and undesirable once in every 8: the label cannot be read
    from the colour alone."""
    ds = write_demo_preferences(out, n_train=n_train, n_val=n_val, seed=seed)
    paths = []
    for source, name in zip((ds.train, ds.val), UNPAIRED_FILES):
        target = ds.root / name
        paths.append(target)
        if target.exists():
            continue
        lines = []
        for i, line in enumerate(source.read_text(encoding="utf-8").splitlines()):
            rec = json.loads(line)
            desirable = i % 8 in (0, 3, 5, 6)
            reply = rec["chosen" if desirable else "rejected"]
            messages = [{"role": t["from"], "content": t["value"]} for t in [*rec["conversations"], reply]]
            lines.append(
                json.dumps({"id": rec["id"], "images": rec["images"], "messages": messages, "label": desirable})
            )
        tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
        os.replace(tmp, target)
    return DemoDataset(ds.root, paths[0], paths[1])


WORDS = (
    "the",
    "product",
    "box",
    "surface",
    "left",
    "right",
    "corner",
    "edge",
    "colour",
    "scratch",
    "crack",
    "stain",
    "hole",
    "small",
    "large",
    "near",
    "top",
    "bottom",
    "visible",
    "clean",
    "worn",
    "label",
    "seal",
    "panel",
)


def write_varied_dataset(
    out: str | os.PathLike,
    n: int = 64,
    seed: int = 0,
    min_side: int = 224,
    max_side: int = 1024,
    max_images: int = 3,
    answer_words: tuple[int, int] = (5, 200),
    max_turns: int = 3,
) -> Path:
    """A variable-length set with the shapes of real fine-tuning data, written to ``out/train.jsonl``:
    0 to ``max_images`` images per record (some records text-only) of random sides in
    [``min_side``, ``max_side``] (dynamic resolution: each is resized by the processor's own rule), 1 to
    ``max_turns`` user/assistant turns, answers of ``answer_words`` words. Deterministic for a seed; for
    bench/ and the packing tests (the demo set above is uniform: one image, short answers)."""
    out = Path(out)
    (out / "imgs").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    colours, defects = list(COLOURS), list(DEFECTS)
    with open(out / "train.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            images = []
            for k in range(rng.randint(0, max_images)):
                w, h = rng.randint(min_side, max_side), rng.randint(min_side, max_side)
                img = draw_product(rng.choice(colours), rng.choice(defects), rng).resize((w, h))
                name = f"v{i:05d}_{k}.png"
                img.save(out / "imgs" / name, optimize=False)
                images.append(f"imgs/{name}")
            turns = rng.randint(1, max_turns)
            # the placeholders go into the user turns, spread over them
            spread = [[] for _ in range(turns)]
            for _ in images:
                spread[rng.randrange(turns)].append("<image>")
            conv = []
            for t in range(turns):
                question = "".join(p + "\n" for p in spread[t]) + rng.choice(QUESTIONS)
                answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*answer_words)))
                conv += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"id": f"v-{i}", "messages": conv, "images": images}) + "\n")
    return out / "train.jsonl"
