"""Host memory and time to step 1 of ``--shard fsdp`` loading, per process, on a generated multi-GB checkpoint,
checked against each process's share of the weights plus a stated overhead.

Not a pytest module (``make bench`` runs ``bench/test_loading.py``, on a smaller checkpoint): a script, since each
measurement is a fresh ``vlft run`` of 1 or 2 processes, each a ``bench/loading_probe.py`` worker that records its
own ``/proc/self/status`` before loading, right after loading (before step 1) and after step 1.

    PYTHONPATH=. python bench/loading_memory.py [--out bench/results/loading_memory.json] [--only 2:auto ...]

For each of 1 and 2 processes, both ways of loading (``--shard-loading auto``: each process reads its own
shares; ``rank0``: rank 0 reads the whole checkpoint and sends the shares out) run one step of batch 1. It prints
per process the loading's peak and the peak through step 1, and exits 1 when a process reading its own shares
holds more than the bound (``bound_violations``); when both ways ran at 2 processes, also when their step-1
losses differ.

The bound, per process, over what it held on entering the model's construction (the interpreter, torch,
transformers, the plan: ``before``):

* its own memory (``RssAnon``, sampled every 5 ms) grows by at most its share of the weights plus the largest
  tensor (the plan's figure: ``vlft.planning.sharding.loading_bytes``) plus ``SLACK``;
* its resident memory (``VmHWM``, the kernel's peak since that point) by at most that plus the pages of the
  safetensors files it touched, at most its share again: safetensors maps the files and copies each slice out;
  those pages are the kernel's page cache (``RssFile``), which it reclaims under pressure, not the process's;
* through step 1, its own memory grows by at most the plan's estimate per process (``estimate_bytes``: its
  shares, the blocks gathered at a time, the adapter's state, the activations) plus ``SLACK``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# allocator and interpreter growth while loading beside the tensors (DCP's read plan, gloo's buffers): measured
# 4-20 MiB on the runs in docs/parallel.md; the bound leaves 64
SLACK = 64 * 2**20
BIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, vocab=32_000)
# a few hundred MB for the suite and make bench: the embedding (32 MB) not the largest part
SMALL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, vocab=8_000)


def sized_recipe(hidden_size: int, intermediate_size: int, num_hidden_layers: int, vocab: int) -> dict:
    """The embedded Qwen2.5-VL recipe made wider and deeper (16 heads of 128 over 2 key-value heads where the
    width allows; the vision tower as the embedded one, its merger projecting to the text width). ``BIG`` is
    2.2 GiB in fp32, its largest tensor the embedding (250 MiB); ``SMALL`` 0.3 GiB."""
    import copy

    from vlft.plugins import serve_checkout

    serve_checkout()
    from vlft_models.qwen2_vl import RECIPE_2_5

    recipe = copy.deepcopy(RECIPE_2_5)
    heads = hidden_size // 128
    recipe["text"].update(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
    )
    recipe["text"]["rope_parameters"] = dict(recipe["text"]["rope_parameters"], mrope_section=[16, 24, 24])
    recipe["vision"].update(out_hidden_size=hidden_size)
    recipe["padded_vocab_size"] = vocab
    recipe["bench"] = "loading"
    return recipe


def checkpoint(size: dict = BIG) -> Path:
    """The generated checkpoint of ``size`` (``BIG``, ``SMALL``), built once into VLFT_CACHE."""
    from vlft.models.embedded import cache_root, tokenizer_corpus
    from vlft.plugins import serve_checkout

    serve_checkout()  # vlft_models from this checkout, as a run's registry takes it
    from vlft_models._tiny import recipe_hash
    from vlft_models.qwen2_vl import build_tiny_2_5

    recipe = sized_recipe(**size)
    path = cache_root() / f"bench-loading-qwen2_5_vl-{recipe_hash(recipe)}"
    if not (path / "config.json").exists():
        build_tiny_2_5(path, recipe, corpus=tokenizer_corpus())
    return path


def weight_bytes(model: Path) -> tuple[int, int]:
    """The checkpoint's tensors in bytes: all of them, and the largest (from the safetensors headers)."""
    import struct

    sizes = []
    for f in model.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        sizes += [end - begin for k, v in header.items() if k != "__metadata__" for begin, end in [v["data_offsets"]]]
    return sum(sizes), max(sizes)


def probed_run(  # params: the run's shape, each a flag the bench and the suite's test set apart
    model: Path,
    data: Path,
    out: Path,
    nproc: int,
    loading: str,
    *extra: str,
    steps: int = 1,
    backend: str = "cpu",
    stop: str | None = None,
) -> dict:
    """One ``vlft run --shard fsdp`` of ``steps`` steps of batch 1, each process a ``loading_probe`` worker: per
    rank the probe's points, the steps' metrics, the plan's sharding, and the seconds from start to step 1.
    ``stop="after_loading"`` ends every process once its weights are read (no metrics then)."""
    # the evaluation before training: 1 generated token of 1 record, the validation loss over every --val-data
    # record (one)
    val = out.parent / f"{out.name}-val.jsonl"
    record = json.loads(Path(data).read_text().splitlines()[0])
    record["image"] = str(Path(data).parent / record["image"])  # relative to the data file's folder
    val.write_text(json.dumps(record) + "\n")
    args = ["run", "--backend", backend, "--model", str(model), "--data", str(data), "--val-data", str(val)]
    args += ["--output", str(out), "--steps", str(steps), "--batch-size", "1", "--max-length", "256"]
    args += [
        "--max-pixels",
        str(28 * 28 * 4),
        "--eval-samples",
        "1",
        "--max-new-tokens",
        "1",
        "--save-every",
        "0",
        "--log-every",
        "1",
    ]
    args += ["--shard", "fsdp"]
    args += ["--shard-loading", loading, "--no-memory-check", "--quiet", *extra]
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    probe = out.parent / f"{out.name}-probe.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"VLFT_PROBE_STOP": stop} if stop else {})}
    start = time.monotonic()
    proc = subprocess.run([*launch, str(HERE / "loading_probe.py"), str(probe), *args], capture_output=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{loading} x{nproc} failed:\n{proc.stderr.decode()[-3000:]}")
    ranks = {str(r): json.loads(Path(f"{probe}.{r}").read_text()) for r in range(nproc)}
    lines = (out / "metrics.jsonl").read_text().splitlines() if stop is None else []
    metrics = [m for m in map(json.loads, lines) if "loss" in m]
    plan = json.loads((out / "plan.json").read_text()) if stop is None else None  # written after loading
    first = min(p["imports"]["t"] for p in ranks.values())
    return {
        "processes": nproc,
        "loading_asked": loading,
        "loading": ranks["0"]["after_loading"]["loading"],
        "offload": plan["sharding"]["offload"] if plan else None,
        "plan_estimate_bytes": plan["memory"]["estimate_bytes"] if plan else None,
        "ranks": ranks,
        "losses": [m["loss"] for m in metrics],
        "step_time_s": [m["step_time_s"] for m in metrics],
        "peak_memory_bytes": [m["peak_memory_bytes"] for m in metrics],  # rank 0's, by the backend's reader
        "seconds_to_step_1": (
            round(max(p["after_step_1"]["t"] for p in ranks.values()) - first, 1) if stop is None else None
        ),
        "seconds_loading": round(max(p["after_loading"]["t"] - p["before_loading"]["t"] for p in ranks.values()), 1),
        "wall_s": round(time.monotonic() - start, 1),
    }


def loading_figures(point: dict, share: int) -> dict:
    """One process's loading, from its probe ``point``s: growth over what it held before, own and resident,
    and each over its ``share`` of the weights."""
    before, after = point["before_loading"], point["after_loading"]
    own = after["anon_peak"] - before["RssAnon"]
    resident = after["VmHWM"] - before["VmRSS"]
    return {
        "before_bytes": before["VmRSS"],
        "before_own_bytes": before["RssAnon"],
        "loading_peak_bytes": after["VmHWM"],
        "own_growth_bytes": own,
        "resident_growth_bytes": resident,
        "mapped_growth_bytes": after["file_peak"] - before["RssFile"],
        "own_growth_over_share": round(own / share, 3),
        "resident_growth_over_share": round(resident / share, 3),
        "peak_through_step_1_bytes": point["after_step_1"]["VmHWM"] if "after_step_1" in point else None,
        "own_growth_through_step_1_bytes": (
            point["after_step_1"]["anon_peak"] - before["RssAnon"] if "after_step_1" in point else None
        ),
    }


def bound_violations(run: dict, whole: int, largest: int) -> list[str]:
    """Each process reading its own shares that held more than its share plus the stated overhead (the module's
    docstring), or whose own memory through step 1 grew past the plan's estimate per process, named with its
    figures; empty when every process kept within it."""
    from vlft.planning.sharding import loading_bytes

    world = run["processes"]
    share = -(-whole // world)
    own_bound = loading_bytes(whole, largest, world, "each") + SLACK
    bad = []
    for rank, point in run["ranks"].items():
        f = loading_figures(point, share)
        if f["own_growth_bytes"] > own_bound:
            bad.append(
                f"rank {rank}: its own memory grew {gib(f['own_growth_bytes'])} while loading, over its share "
                f"{gib(share)} + the largest tensor {gib(largest)} + {gib(SLACK)}"
            )
        if f["resident_growth_bytes"] > own_bound + share:
            bad.append(
                f"rank {rank}: its resident memory grew {gib(f['resident_growth_bytes'])} while loading, over its "
                f"share {gib(share)} + the largest tensor {gib(largest)} + {gib(SLACK)} + its share of mapped pages"
            )
        through = f["own_growth_through_step_1_bytes"]
        if through is not None and run["plan_estimate_bytes"] and through > run["plan_estimate_bytes"] + SLACK:
            bad.append(
                f"rank {rank}: its own memory grew {gib(through)} through step 1, over the plan's estimate per "
                f"process {gib(run['plan_estimate_bytes'])} + {gib(SLACK)}"
            )
    return bad


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "loading_memory.json"))
    parser.add_argument("--work", default="/tmp/vlft-loading-bench")
    parser.add_argument("--small", action="store_true", help="the suite's 0.3 GiB checkpoint, not the 2.2 GiB one")
    parser.add_argument(
        "--only", action="append", help="PROCESSES:LOADING (e.g. 2:auto), repeatable; the others kept from --out"
    )
    args = parser.parse_args()
    from vlft.data.demo import write_demo_dataset
    from vlft.models.embedded import cache_root

    model = checkpoint(SMALL if args.small else BIG)
    whole, largest = weight_bytes(model)
    demo = write_demo_dataset(cache_root() / "demo-data")
    out_file = Path(args.out)
    results: dict = json.loads(out_file.read_text()) if args.only and out_file.exists() else {"runs": []}
    results.update(checkpoint_bytes=whole, largest_tensor_bytes=largest, slack_bytes=SLACK)
    print(f"checkpoint {gib(whole)} at {model}; largest tensor {gib(largest)}")
    wanted = [(int(n), loading) for n, loading in (x.split(":") for x in args.only)] if args.only else None
    failures = []
    for nproc in (1, 2):
        for loading in ("auto", "rank0"):
            if wanted is not None and (nproc, loading) not in wanted:
                continue
            out = Path(args.work) / f"{loading}-{nproc}"
            if out.exists():
                import shutil

                shutil.rmtree(out)
            r = probed_run(model, demo.train, out, nproc, loading)
            results["runs"] = [x for x in results["runs"] if (x["processes"], x["loading_asked"]) != (nproc, loading)]
            results["runs"].append(r)
            share = -(-whole // nproc)
            print(f"{nproc} process(es), loading {r['loading']}: step 1 after {r['seconds_to_step_1']} s")
            for rank, point in r["ranks"].items():
                f = loading_figures(point, share)
                print(
                    f"  rank {rank}: before {gib(f['before_bytes'])} ({gib(f['before_own_bytes'])} own); loading "
                    f"peak {gib(f['loading_peak_bytes'])}: +{gib(f['own_growth_bytes'])} own "
                    f"({f['own_growth_over_share']}x its share), +{gib(f['mapped_growth_bytes'])} mapped; "
                    f"peak through step 1 {gib(f['peak_through_step_1_bytes'] or 0)} "
                    f"(+{gib(f['own_growth_through_step_1_bytes'] or 0)} own; plan {gib(r['plan_estimate_bytes'] or 0)})"
                )
            if r["loading"] == "each":
                failures += [f"{nproc} process(es): {v}" for v in bound_violations(r, whole, largest)]
    both = {x["loading"]: x for x in results["runs"] if x["processes"] == 2}
    if "each" in both and "rank0" in both and both["each"]["losses"] != both["rank0"]["losses"]:
        failures.append(f"2 processes: losses {both['each']['losses']} reading each, {both['rank0']['losses']} rank 0")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(results, indent=1) + "\n")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
