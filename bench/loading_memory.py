"""Host memory and time to step 1 of ``--shard fsdp`` loading, per process, on a generated multi-GB checkpoint.

Not a pytest module (``make bench`` does not run it): a script, since each measurement is a fresh ``vlft run``
of 1 or 2 processes whose peak resident memory (``VmHWM`` in ``/proc/PID/status``, the kernel's high-water
mark: anonymous and file-backed pages, so a memory-mapped checkpoint counts where it is touched) is read from
outside while they run.

    PYTHONPATH=. python bench/loading_memory.py [--out bench/results/loading_memory.json]

For each of 1 and 2 processes, both ways of loading (``--shard-loading auto``: each process reads its own
shares; ``rank0``: rank 0 reads the whole checkpoint and sends the shares out) run one step of batch 1; the
script prints per process its peak resident memory, and the time from the command's start to step 1's line
in metrics.jsonl. The checkpoint is the embedded Qwen2.5-VL recipe made wide enough for a few GB in fp32
(built once into VLFT_CACHE). A process that imports torch and transformers and builds nothing holds
``baseline`` of that, also measured.
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


def big_recipe() -> dict:
    """About 2.4 GB in fp32: 12 text layers of hidden 2048 (MLP 5632), a 32,000-row vocabulary; the vision
    tower as the embedded one. The largest tensor (the embedding, 262 MB) is about a tenth of the whole."""
    import copy

    from vlft_models.qwen2_vl import RECIPE_2_5

    recipe = copy.deepcopy(RECIPE_2_5)
    recipe["text"].update(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2
    )
    recipe["text"]["rope_parameters"] = dict(recipe["text"]["rope_parameters"], mrope_section=[16, 24, 24])
    recipe["vision"].update(out_hidden_size=2048)
    recipe["padded_vocab_size"] = 32_000
    recipe["bench"] = "loading"
    return recipe


def checkpoint() -> Path:
    from vlft.models.embedded import cache_root, tokenizer_corpus
    from vlft_models._tiny import recipe_hash
    from vlft_models.qwen2_vl import build_tiny_2_5

    recipe = big_recipe()
    path = cache_root() / f"bench-loading-qwen2_5_vl-{recipe_hash(recipe)}"
    if not (path / "config.json").exists():
        build_tiny_2_5(path, recipe, corpus=tokenizer_corpus())
    return path


def status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def rank_of(pid: int) -> int | None:
    """The torchrun worker's RANK (None for any other process: the launcher, torchrun's agent)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def measure(model: Path, data: Path, val: Path, out: Path, nproc: int, loading: str) -> dict:
    """One run of 1 step: each worker's peak resident memory and the seconds from start to step 1."""
    cmd = [
        sys.executable,
        "-m",
        "vlft",
        "run",
        "--backend",
        "cpu",
        "--model",
        str(model),
        "--data",
        str(data),
        "--val-data",
        str(val),
        "--output",
        str(out),
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--max-length",
        "256",
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
        "--shard",
        "fsdp",
        "--shard-loading",
        loading,
        "--nproc-per-node",
        str(nproc),
        "--no-memory-check",
        "--quiet",
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    peaks: dict[int, int] = {}
    step1 = None
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        for pid in descendants(proc.pid) + [proc.pid]:
            rank = rank_of(pid)
            if rank is None and nproc > 1:
                continue
            hwm = status_kib(pid, "VmHWM")
            if hwm is not None:
                key = rank if rank is not None else 0
                peaks[key] = max(peaks.get(key, 0), hwm)
        if step1 is None and metrics.exists() and '"loss"' in metrics.read_text():
            step1 = time.monotonic() - start
        time.sleep(0.05)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{loading} x{nproc} failed:\n{err.decode()[-3000:]}")
    if step1 is None:
        step1 = time.monotonic() - start
    plan = json.loads((out / "plan.json").read_text())["sharding"]
    return {
        "processes": nproc,
        "loading_asked": loading,
        "loading": plan["loading"],
        "peak_rss_bytes": {str(rank): kib * 1024 for rank, kib in sorted(peaks.items())},
        "seconds_to_step_1": round(step1, 1),
    }


def baseline_bytes() -> int:
    """A process's peak after importing what a run imports (torch, transformers, vlft) and nothing else."""
    code = (
        "import torch, transformers, vlft.training.trainer; "
        "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
    )
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "loading_memory.json"))
    parser.add_argument("--work", default="/tmp/vlft-loading-bench")
    parser.add_argument(
        "--only", action="append", help="PROCESSES:LOADING (e.g. 2:auto), repeatable; the others kept from --out"
    )
    args = parser.parse_args()
    from vlft.data.demo import write_demo_dataset
    from vlft.models.embedded import cache_root

    model = checkpoint()
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    demo = write_demo_dataset(cache_root() / "demo-data")
    out_file = Path(args.out)
    results = json.loads(out_file.read_text()) if args.only and out_file.exists() else {"runs": []}
    results.update(checkpoint_bytes=weights, baseline_bytes=baseline_bytes())
    print(f"checkpoint {weights / 2**30:.2f} GiB at {model}; baseline {results['baseline_bytes'] / 2**30:.2f} GiB")
    wanted = [(int(n), loading) for n, loading in (x.split(":") for x in args.only)] if args.only else None
    for nproc in (1, 2):
        for loading in ("auto", "rank0"):
            if wanted is not None and (nproc, loading) not in wanted:
                continue
            out = Path(args.work) / f"{loading}-{nproc}"
            if out.exists():
                import shutil

                shutil.rmtree(out)
            r = measure(model, demo.train, demo.val, out, nproc, loading)
            results["runs"] = [x for x in results["runs"] if (x["processes"], x["loading_asked"]) != (nproc, loading)]
            results["runs"].append(r)
            peaks = ", ".join(f"rank {k}: {v / 2**30:.2f} GiB" for k, v in r["peak_rss_bytes"].items())
            print(f"{nproc} process(es), loading {r['loading']}: {peaks}; step 1 after {r['seconds_to_step_1']} s")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
