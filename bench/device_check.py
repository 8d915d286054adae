"""``make device-check``: everything vlft promises about an accelerator, checked on one, in one command.

1. the device tests: those of ``tests/hardware`` and ``tests/parity`` marked ``cuda`` or ``npu`` (the
   accelerator parity tests carry their device's marker); among them a test that runs each device's
   tests again in reverse order (TF32 and other global switches must not leak). The CPU-only tests of
   those folders check nothing on a device and are left to CI and to ``make device-rehearsal``, which
   runs them on the device machine's stack (``--all-tests`` runs them here too);
2. ``vlft parity --backends cpu,<device>`` in the backend's default policy and in fp32;
3. ``bench/device_fsdp.py``: one process with ``--shard fsdp`` against one without on the device (the
   losses, a checkpoint, the adapter loaded with plain PEFT);
4. ``bench/device_scale.py``: Qwen2.5-VL-7B's shape with random bf16 weights on the device, LoRA and
   OFT steps, peak memory beside the memory plan's estimate.

It needs no install step and writes no install metadata: the built-in plugins register directly
(``vlft/plugins.py``), so the checkout first on ``PYTHONPATH`` is vlft, installed or not (a device
machine's own Python, with no setuptools and no registry); the first line printed says where vlft was
imported from and which plugins registered.

The time budget is explicit (``--list`` prints it): each step has a timeout and an estimate on one
large GPU, the timeouts add up to at most 480 s, and the whole check stops at that deadline.
``--quick`` (a machine with little time left) runs the device tests without their reverse-order
re-run, ``vlft parity`` in the default policy, and one scale point (LoRA, no checkpointing), within
240 s.

On a machine without an accelerator it runs the whole of ``tests/hardware`` and ``tests/parity`` (the
device tests skip, each with the probe's reason), says which backend is missing and why, and exits 3
(1 if a test failed): nothing was
checked on a device. Logs, ``device-check.json`` and ``device-check.md`` (the steps, the device tests'
counts, the 7B-shape table beside the memory plan) go to ``--out`` (default ``device-check-results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

from bench import device_report  # noqa: E402 - after the repository is on the path

DEVICE_TESTS = ["tests/hardware", "tests/parity"]
DEVICE_MARKERS = "cuda or npu"


# a child Python with the checkout first on its path: where vlft is imported from, and the plugins its
# registry holds (the built-ins register directly, so an install is neither needed nor consulted for them)
_PROBE = r"""
import json, vlft
from vlft.registry import load_registry
r = load_registry()
print(json.dumps({"vlft": vlft.__file__, "plugins": sorted(n for n, _ in r.pm.list_name_plugin() if n),
                  "broken": r.broken}))
"""


def checkout_way(repo: Path = REPO, python: str = sys.executable) -> dict:
    """How the steps import vlft: this checkout first on ``PYTHONPATH``. Checked in a child process, which
    must import vlft from ``repo`` and register the CPU backend; raises RuntimeError saying what failed."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(repo)]
    pythonpath = os.pathsep.join([str(repo), *inherited])
    proc = subprocess.run(
        [python, "-c", _PROBE],
        env={**os.environ, "PYTHONPATH": pythonpath},
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(found["vlft"]).resolve().is_relative_to(repo.resolve()):
        raise RuntimeError(f"vlft imports from {found['vlft']}, not from this checkout ({repo})")
    if "cpu" not in found["plugins"]:
        raise RuntimeError(f"the built-in plugins did not register: {found['plugins']} (broken: {found['broken']})")
    broken = "; broken: " + ", ".join(sorted(found["broken"])) if found["broken"] else ""
    return {
        "mode": "checkout",
        "pythonpath": pythonpath,
        "vlft": found["vlft"],
        "plugins": found["plugins"],
        "broken": found["broken"],
        "line": f"vlft from this checkout ({repo}), plugins: {', '.join(found['plugins'])}{broken}",
    }


@dataclass(frozen=True)
class Step:
    """One part of the check: its timeout and what it is expected to take on one large GPU (an H200-class
    card, 16 cores); the estimates are until a device run measures them (``device-check.json`` then has
    each step's real time)."""

    name: str
    estimate_s: int
    timeout_s: int
    what: str


FULL = (
    Step("device-tests", 150, 200, "tests/hardware + tests/parity marked cuda/npu, with their reverse-order re-run"),
    Step("parity-auto", 25, 45, "vlft parity cpu,<device>, the backend's default policy, 5 steps"),
    Step("parity-fp32", 25, 45, "vlft parity cpu,<device>, fp32, 5 steps"),
    Step("fsdp-one-process", 50, 80, "bench/device_fsdp.py: 3 runs of 10 steps (unsharded, sharded, resumed)"),
    Step("scale", 80, 110, "bench/device_scale.py: 7B shape, LoRA and OFT, checkpointing off and on, 5 steps each"),
)
QUICK = (
    Step("device-tests", 80, 120, "tests/hardware + tests/parity marked cuda/npu, without the reverse-order re-run"),
    Step("parity-auto", 25, 40, "vlft parity cpu,<device>, the backend's default policy, 5 steps"),
    Step("scale", 30, 45, "bench/device_scale.py: 7B shape, LoRA, checkpointing off, 3 steps"),
)
BUDGET_S = {"full": 480, "quick": 240}  # the whole check, set-up included: the deadline


def plan(quick: bool) -> tuple[tuple[Step, ...], int]:
    return (QUICK, BUDGET_S["quick"]) if quick else (FULL, BUDGET_S["full"])


def budget_table(steps: tuple[Step, ...], budget: int) -> str:
    rows = [
        f"{'step':<18} {'estimate':>9} {'timeout':>8}  what",
        *(f"{s.name:<18} {s.estimate_s:>7} s {s.timeout_s:>6} s  {s.what}" for s in steps),
        f"{'total':<18} {sum(s.estimate_s for s in steps):>7} s {sum(s.timeout_s for s in steps):>6} s  "
        f"(deadline for the whole check: {budget} s)",
    ]
    return "\n".join(rows)


def command(
    step: Step, py: str, backend: str | None, out: Path, quick: bool, pytest_args: tuple = (), all_tests: bool = False
) -> list[str]:
    """The step's command line; ``backend``: the accelerator found (None: none, the device tests skip)."""
    if step.name == "device-tests":
        cmd = [
            py,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            f"--junitxml={out / 'device-tests.xml'}",
            *DEVICE_TESTS,
        ]
        if backend is not None and not all_tests:
            cmd += ["-m", DEVICE_MARKERS]
        if quick:
            cmd += ["-k", "not reverse_order"]
        return [*cmd, *pytest_args]
    if step.name.startswith("parity-"):
        precision = step.name.split("-", 1)[1]
        return [
            py,
            "-m",
            "vlft",
            "parity",
            "--backends",
            f"cpu,{backend}",
            "--steps",
            "5",
            "--precision",
            precision,
            "--output",
            str(out / f"parity-{precision}.json"),
        ]
    if step.name == "fsdp-one-process":
        return [py, "bench/device_fsdp.py", "--backend", backend, "--out", str(out)]
    if step.name == "scale":
        extra = ["--methods", "lora", "--checkpointing", "off", "--steps", "3"] if quick else []
        return [py, "bench/device_scale.py", "--backend", backend, "--out", str(out), *extra]
    raise ValueError(step.name)


def _kill(proc: subprocess.Popen) -> None:
    """The step and everything it started (torchrun workers, vlft run children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def step(name: str, cmd: list[str], out: Path, timeout: float, env: dict | None = None) -> dict:
    """Run one part, its output teed to ``out/<name>.log``, killed (with its children) after ``timeout``
    seconds; never raises."""
    print(f"\n=== {name} (timeout {timeout:.0f} s): {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as e:
            f.write(f"could not start: {e}\n")
            print(f"=== {name}: could not start: {e}", flush=True)
            return {"name": name, "exit": "not started", "seconds": 0.0, "log": log.name}

        def tee():
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.wait()
            code = "timeout"
        reader.join(timeout=10)
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
    ap.add_argument(
        "--quick",
        action="store_true",
        help="device tests (no reverse-order re-run), parity in the default policy, one scale point: "
        f"within {BUDGET_S['quick']} s",
    )
    ap.add_argument("--list", action="store_true", help="print the steps with their estimates and timeouts, run none")
    ap.add_argument(
        "--all-tests",
        action="store_true",
        help="on a device too, the CPU-only tests of tests/hardware and tests/parity (outside the budget)",
    )
    ap.add_argument(
        "--pytest-args",
        default="",
        help="more pytest arguments for the device tests (recorded in the report), e.g. "
        "--pytest-args='-k \"not some_test\"'",
    )
    ap.add_argument(
        "--timeout-factor",
        type=float,
        default=1.0,
        help="stretch every timeout and the deadline (a slower machine than one large GPU's, e.g. the "
        "rehearsal on 2 cores)",
    )
    args = ap.parse_args(argv)
    steps, budget = plan(args.quick)
    pytest_args = tuple(shlex.split(args.pytest_args))
    if args.list:
        print(budget_table(steps, budget))
        return 0
    t_start = time.perf_counter()
    deadline = t_start + budget * args.timeout_factor
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        way = checkout_way()
    except RuntimeError as e:
        print(f"vlft cannot be imported from this checkout: {e}", file=sys.stderr)
        return 2
    print(way["line"], flush=True)
    env = {**os.environ, "PYTHONPATH": way["pythonpath"]}
    # nothing written outside the checkout by the steps, where the caller chose no other place: the
    # embedded model (built once, shared by every step), matplotlib's cache; and no hub look-up
    for key, value in (
        ("VLFT_CACHE", REPO / ".cache" / "vlft"),
        ("MPLCONFIGDIR", REPO / ".cache" / "matplotlib"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        env.setdefault(key, str(value))
    py = sys.executable
    found, missing = accelerators()
    backend = found[0] if found else None
    by_name = {s.name: s for s in steps}
    if args.skip_scale:
        by_name.pop("scale", None)
    results = []

    def run(s: Step) -> dict:
        left = deadline - time.perf_counter()
        timeout = min(s.timeout_s * args.timeout_factor, left)
        if timeout < 5:
            r = {"name": s.name, "exit": "no time left", "seconds": 0.0, "log": ""}
            print(f"\n=== {s.name}: not run, the check's {budget} s deadline is reached", flush=True)
        else:
            r = step(s.name, command(s, py, backend, out, args.quick, pytest_args, args.all_tests), out, timeout, env)
        r.update(timeout_s=round(timeout), estimate_s=s.estimate_s)
        results.append(r)
        return r

    def report(code: int) -> dict:
        counts = device_report.device_test_counts(out / "device-tests.xml", out / "device-tests.log")
        scale = device_report.read_scale(out) if any(r["name"] == "scale" for r in results) else None
        budget_info = {
            "mode": "quick" if args.quick else "full",
            "deadline_s": round(budget * args.timeout_factor),
            "timeout_factor": args.timeout_factor,
            "timeout_total_s": sum(s.timeout_s for s in steps),
            "estimate_total_s": sum(s.estimate_s for s in steps),
            "elapsed_s": round(time.perf_counter() - t_start, 1),
        }
        r = device_report.build(way, found, missing, results, counts, scale, budget_info)
        r.update(python=sys.executable, pytest_args=list(pytest_args), exit_code=code)
        device_report.write(out, r)
        return r

    run(by_name.pop("device-tests"))  # on every machine: without a device, the CPU-only ones, the others skip
    if not found:
        for name, why in missing.items():
            print(f"no {name}: {why}")
        code = 3 if results[0]["exit"] == 0 else 1
        c = report(code)["device_tests"]
        print(f"device tests: {c['passed']} passed, {c['skipped']} skipped, {c['failed']} failed, {c['errors']} errors")
        if code == 1:
            print("\ndevice check FAILED before any device step: the device tests above did not pass")
        else:
            print(
                "\ndevice check stopped here: no accelerator backend is available, so nothing was checked on a "
                "device (the device tests above were skipped with their reasons)"
            )
        print(f"exit {code}; results: {out / 'device-check.md'}")
        return code
    for s in by_name.values():
        run(s)
    code = 0 if all(x["exit"] == 0 for x in results) else 1
    report(code)
    print(
        "\n" + "\n".join(f"{x['name']:<24} exit {x['exit']} ({x['seconds']} s of {x['timeout_s']} s)" for x in results)
    )
    print(f"exit {code}; results: {out / 'device-check.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
