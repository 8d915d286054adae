"""``make device-check`` step: one process with ``--shard fsdp`` on the device against one without.

The same 10 seeded steps on the embedded model (LoRA, dropout off, the backend's default precision),
sharded over a world of one and unsharded: FSDP's mixed-precision policy (weights gathered in the compute
dtype, gradients reduced in fp32) must give the unsharded losses within the precision's parity tolerance,
its checkpoint must resume, and its adapter must load with plain PEFT. Figures go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


def run(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vlft", "run", "--quiet", *args], capture_output=True, text=True, timeout=400
    )
    if proc.returncode != 0:
        sys.exit(f"vlft run {' '.join(args)} failed:\n{proc.stderr[-4000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", default="device-check-results")
    a = ap.parse_args(argv)
    out = Path(a.out)
    common = [
        "--backend",
        a.backend,
        "--steps",
        "10",
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-samples",
        "4",
        "--max-new-tokens",
        "8",
        "--seed",
        "5",
        "--lr",
        "2e-3",
        "--warmup-ratio",
        "0",
        "--adapter-opt",
        "lora_dropout=0.0",
    ]
    plain, sharded, resumed = out / "fsdp-unsharded", out / "fsdp-sharded", out / "fsdp-resumed"
    run([*common, "--save-every", "0", "--output", str(plain)])
    run([*common, "--shard", "fsdp", "--save-every", "5", "--output", str(sharded)])
    # the sharded run cut back to its step-5 checkpoint, continued with --resume
    shutil.rmtree(resumed, ignore_errors=True)
    shutil.copytree(sharded, resumed)
    shutil.rmtree(resumed / "adapter")
    run([*common, "--shard", "fsdp", "--save-every", "5", "--output", str(resumed), "--resume"])
    losses = {
        name: [json.loads(x)["loss"] for x in (p / "metrics.jsonl").read_text().splitlines()]
        for name, p in (("unsharded", plain), ("sharded", sharded), ("resumed", resumed))
    }
    worst = max(abs(s - u) / abs(u) for u, s in zip(losses["unsharded"], losses["sharded"]))
    worst_resumed = max(abs(s - u) / abs(u) for u, s in zip(losses["sharded"], losses["resumed"]))
    summary = json.loads((sharded / "summary.json").read_text())
    plan = json.loads((sharded / "plan.json").read_text())
    tolerance = 1e-4 if plan["precision"]["name"] == "fp32" else 3e-2
    from peft import PeftModel  # the adapter loads without vlft
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(plan["model"])
    PeftModel.from_pretrained(base, str(sharded / "adapter"))
    result = {
        "backend": a.backend,
        "precision": plan["precision"]["name"],
        "losses": losses,
        "worst_relative_difference": worst,
        "worst_relative_difference_resumed": worst_resumed,
        "tolerance": tolerance,
        "sharding": summary["sharding"],
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "train_time_s": summary["train_time_s"],
    }
    (out / "fsdp.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if worst <= tolerance and worst_resumed <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
