"""``make device-check``: everything vlft promises about an accelerator, checked on one, in one command.

1. the device tests (``-m "cuda or npu"``) and the parity tests; among them a test that runs each
   device's tests again in reverse order (TF32 and other global switches must not leak);
2. ``vlft parity --backends cpu,<device>`` in the backend's default policy and in fp32;
3. ``bench/device_fsdp.py``: one process with ``--shard fsdp`` against one without on the device (the
   losses, a checkpoint, the adapter loaded with plain PEFT);
4. ``bench/device_scale.py``: Qwen2.5-VL-7B's shape with random bf16 weights on the device, LoRA and
   OFT steps, peak memory beside the memory plan's estimate.

On a machine without an accelerator it runs the device tests (which skip, each with the probe's
reason), says which backend is missing and why, and exits 3: nothing was checked on a device.
Logs, JSON and Markdown go to ``--out`` (default ``device-check-results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step(name: str, cmd: list[str], out: Path, timeout: int) -> dict:
    """Run one part, its output teed to ``out/<name>.log``; never raises."""
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
            code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "timeout"
    seconds = time.perf_counter() - t0
    print(f"=== {name}: exit {code} in {seconds:.0f} s", flush=True)
    return {"name": name, "exit": code, "seconds": round(seconds, 1), "log": log.name}


def accelerators() -> tuple[list[str], dict[str, str]]:
    """(available accelerator backends, why each unavailable one is not)."""
    from vlft.registry import load_registry

    registry = load_registry()
    found, missing = [], {}
    for name, info in sorted(registry.backends.items(), key=lambda kv: -kv[1].priority):
        if info.device_type == "cpu":
            continue
        probe = registry.first("vlft_probe_backend", backend=name)
        (found.append(name) if probe.available else missing.__setitem__(name, probe.reason))
    return found, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="device-check-results")
    ap.add_argument("--skip-scale", action="store_true", help="leave out the 7B-shape benchmark")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    found, missing = accelerators()
    tests = ["tests/hardware", "tests/parity"]
    results = [step("device-tests", [py, "-m", "pytest", "-q", "-rs", "-p", "no:randomly", "-p", "no:cacheprovider",
                                     *tests], out, 420)]
    if not found:
        for name, why in missing.items():
            print(f"no {name}: {why}")
        print("\ndevice check stopped here: no accelerator backend is available, so nothing was checked on a "
              "device (the device tests above were skipped with their reasons)")
        (out / "device-check.json").write_text(json.dumps({"accelerators": [], "missing": missing,
                                                           "steps": results}, indent=2))
        return 3
    backend = found[0]
    for precision in ("auto", "fp32"):
        cmd = [py, "-m", "vlft", "parity", "--backends", f"cpu,{backend}", "--steps", "5",
               "--precision", precision, "--output", str(out / f"parity-{precision}.json")]
        results.append(step(f"parity-{precision}", cmd, out, 300))
    results.append(step("fsdp-one-process", [py, "bench/device_fsdp.py", "--backend", backend, "--out", str(out)],
                        out, 300))
    if not args.skip_scale:
        results.append(step("scale", [py, "bench/device_scale.py", "--backend", backend, "--out", str(out)], out,
                            480))
    summary = {"accelerators": found, "missing": missing, "steps": results}
    (out / "device-check.json").write_text(json.dumps(summary, indent=2))
    print("\n" + "\n".join(f"{r['name']:<24} exit {r['exit']} ({r['seconds']} s)" for r in results))
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
