"""The groups' data: the mixed-length set written beside the demo set, and batches encoded and moved."""

from __future__ import annotations

from pathlib import Path

from bench.support.env import BATCH_SIZE, BenchEnv
from bench.support.models import ModelSize

FOLLOW_UPS = [
    ("Where on the product is the defect?", "It is near the middle of the product."),
    ("Is the defect large enough to reject the product?", "Yes, it should be rejected at inspection."),
    ("Describe the surface of the product around the defect.", "The surface is smooth apart from the defect."),
    ("What shape is the product?", "It is a rounded box seen from above."),
]
CONTEXT = (
    "You are inspecting products on a production line. Look at the whole product, left and right, top "
    "and bottom, and name the colour of the product and the kind of damage you see, if any. "
)


def write_mixed_dataset(demo_train: Path) -> Path:
    """Mixed lengths, as real instruction data has: the demo records, half of them made longer.

    Of every four records two stay single-turn with a short question, one gets
    a long question (an inspection brief repeated one to three times before
    it), one becomes a multi-turn conversation (two to four more question and
    answer rounds). Same images; written beside the demo set.
    """
    import json
    import random

    rng = random.Random(11)
    out = Path(demo_train).parent / "mixed.jsonl"
    lines = []
    for i, line in enumerate(Path(demo_train).read_text().splitlines()):
        rec = json.loads(line)
        convo = rec["conversations"]
        if i % 4 == 2:
            convo[0]["value"] = "<image>\n" + CONTEXT * rng.randint(1, 3) + convo[0]["value"].split("\n", 1)[1]
        elif i % 4 == 3:
            for q, a in rng.sample(FOLLOW_UPS, rng.randint(2, 4)):
                convo += [{"from": "user", "value": q}, {"from": "assistant", "value": a}]
        lines.append(json.dumps(rec))
    out.write_text("\n".join(lines) + "\n")
    return out


def encode_batches(size: ModelSize, records, batch_size: int = BATCH_SIZE, **collate_kw) -> list[dict]:
    collate = size.collator(**collate_kw)
    return [
        collate([size.encoder.encode(r) for r in records[i : i + batch_size]])
        for i in range(0, len(records) - batch_size + 1, batch_size)
    ]


def to_device(env: BenchEnv, batch: dict) -> dict:
    from vlft.data.batching import to_device as move

    return move(batch, env.device)


def write_preflight_dataset(
    out: Path, n_records: int = 16_000, n_images: int = 2_000, side: int = 448, seed: int = 0
) -> Path:
    """The field report's shape: ``n_records`` records over ``n_images`` JPEG images of ``side`` x ``side``
    (each image in ``n_records / n_images`` records), one or two turns. Written once per shape."""
    import json
    import random

    from PIL import Image

    out = Path(out)
    train = out / "train.jsonl"
    if train.exists():
        return train
    (out / "imgs").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n_images):
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        img = Image.new("RGB", (side, side), colour)
        img.paste(
            (255 - colour[0], 80, 160),
            (rng.randrange(side // 2), rng.randrange(side // 2), side // 2 + 40, side // 2 + 40),
        )
        img.save(out / "imgs" / f"{i:05d}.jpg", quality=85)
    words = "the part shows a scratch near the left edge no defect visible dent on the surface".split()
    tmp = out / "train.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in range(n_records):
            answer = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 40)))
            turns = [
                {"role": "user", "content": "<image>What do you see on this part?"},
                {"role": "assistant", "content": answer},
            ]
            if r % 3 == 0:
                turns += [
                    {"role": "user", "content": "Is it acceptable?"},
                    {"role": "assistant", "content": rng.choice(["yes", "no, reject it"])},
                ]
            f.write(json.dumps({"messages": turns, "images": [f"imgs/{r % n_images:05d}.jpg"]}) + "\n")
    tmp.rename(train)
    return train


def write_parquet_set(
    out: Path,
    n_records: int,
    n_images: int,
    shard_rows: int = 10_000,
    group_rows: int = 1_000,
    side: int = 224,
    seed: int = 0,
) -> Path:
    """A hub-shaped Parquet set in ``out``: ``n_records`` rows in shards of ``shard_rows`` (row groups of
    ``group_rows``), LLaVA-OneVision's columns (``id``, ``image`` as ``{bytes, path}``, ``conversations``,
    ``data_source``), the images' JPEG bytes drawn in turn from ``n_images`` distinct ones of ``side`` x
    ``side`` (each row holds its own copy, as hub sets do). Written once per shape; returns the folder."""
    import io
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    out = Path(out)
    done = out / "done"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pool = []
    for _ in range(n_images):
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        img = Image.new("RGB", (side, side), colour)
        img.paste(
            (255 - colour[0], 80, 160),
            (rng.randrange(side // 2), rng.randrange(side // 2), side // 2 + 20, side // 2 + 20),
        )
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=85)
        pool.append(buf.getvalue())
    words = "the part shows a scratch near the left edge no defect visible dent on the surface".split()
    shards = (n_records + shard_rows - 1) // shard_rows
    for s in range(shards):
        rows = []
        for r in range(s * shard_rows, min(n_records, (s + 1) * shard_rows)):
            answer = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 40)))
            convo = [
                {"from": "human", "value": "<image>\nWhat do you see on this part?"},
                {"from": "gpt", "value": answer},
            ]
            if r % 3 == 0:
                convo += [
                    {"from": "human", "value": "Is it acceptable?"},
                    {"from": "gpt", "value": rng.choice(["yes", "no, reject it"])},
                ]
            rows.append(
                {
                    "id": f"r{r}",
                    "image": {"bytes": pool[r % n_images], "path": f"{r % n_images:05d}.jpg"},
                    "conversations": convo,
                    "data_source": "bench",
                }
            )
        pq.write_table(
            pa.Table.from_pylist(rows), out / f"train-{s:05d}-of-{shards:05d}.parquet", row_group_size=group_rows
        )
    done.touch()
    return out
