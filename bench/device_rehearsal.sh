#!/usr/bin/env bash
# `make device-rehearsal`: `make device-check` on a Python shaped like the lent GPU machine's, here.
#
# Run by hand, not in CI (it downloads torch's CUDA wheel once, several GB). It
#   1. builds (once) a venv at $REHEARSAL_VENV with the device machine's stack, pinned where its
#      package list names a version: torch 2.11.0 + torchvision 0.26.0, transformers 5.17.0, peft
#      0.21.2, accelerate 1.15.0, ..., and no av, no flash-attn; then removes setuptools from it;
#   2. checks that shape: setuptools, av, flash_attn and vlft itself do not import or resolve;
#   3. runs `make device-check` with that Python: it must take the source-tree way, run the device
#      check's own test set (tests/hardware + tests/parity) with no failure, and stop at the
#      "no accelerator" exit (3);
#   4. checks that nothing was installed into the venv (no vlft metadata, .pth or egg-link there).
#
#   REHEARSAL_VENV=/work/rehearsal-venv REHEARSAL_PYTHON=python3.12 bench/device_rehearsal.sh
#   REHEARSAL_STEP=install bench/device_rehearsal.sh     # step 1 only (e.g. in the background)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${REHEARSAL_VENV:-/work/rehearsal-venv}
PYTHON=${REHEARSAL_PYTHON:-python3.12}
OUT=${REHEARSAL_OUT:-device-check-results/rehearsal}
# The 2-core machines here are several times slower than the device machine: its per-step timeouts
# are stretched by this factor (the budget the device check states is for the device machine).
FACTOR=${REHEARSAL_TIMEOUT_FACTOR:-6}
# The device machine's stack (docs/../KINDS.md package list; versions where it gives them).
STACK=(
    torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 peft==0.21.2 accelerate==1.15.0
    tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0 numpy==2.5.2
    pluggy click pytest pytest-benchmark matplotlib tensorboard pyyaml tqdm pillow
)
PY="$VENV/bin/python"
say() { printf '\n### rehearsal: %s\n' "$*"; }

if [ ! -x "$PY" ]; then
    say "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.rehearsal-stack"
if [ "$(cat "$STAMP" 2>/dev/null)" != "${STACK[*]}" ]; then
    say "installing the device stack into $VENV (torch's CUDA wheel: several GB, once)"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet "${STACK[@]}"
    echo "${STACK[*]}" > "$STAMP"
fi
# torch asks for setuptools on Python >= 3.12; the device machine's cannot be relied on: remove it.
"$PY" -m pip uninstall --quiet -y setuptools av flash-attn flash_attn vlft 2>/dev/null || true
[ "${REHEARSAL_STEP:-all}" = install ] && { say "installed"; exit 0; }

say "the venv's shape"
"$PY" -P - <<'EOF'  # -P: not the checkout on sys.path (its vlft.egg-info from `make install` is no install here)
import importlib.metadata as md
import importlib.util
import sys

print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "torchvision", "transformers", "peft", "accelerate", "pluggy", "click", "pytest",
             "pytest-benchmark", "matplotlib", "tensorboard", "pyyaml", "tqdm", "pillow", "safetensors"):
    print(f"  {name} {md.version(name)}")
bad = [m for m in ("setuptools", "av", "flash_attn") if importlib.util.find_spec(m) is not None]
try:
    md.distribution("vlft")
    bad.append("vlft (installed)")
except md.PackageNotFoundError:
    pass
if bad:
    sys.exit(f"the rehearsal venv is not shaped like the device machine: {', '.join(bad)} present")
print("  absent, as on the device machine: setuptools, av, flash_attn, an installed vlft")
EOF

say "make device-check DEVICE_PY=$PY (timeouts x$FACTOR for this machine)"
rm -rf "$OUT"
set +e
ARGS=(--timeout-factor "$FACTOR")
# e.g. REHEARSAL_PYTEST_ARGS='-k "not some_known_failure"': said in the report and in the verdict
[ -n "${REHEARSAL_PYTEST_ARGS:-}" ] && ARGS+=("--pytest-args=$REHEARSAL_PYTEST_ARGS")
"$PY" bench/device_check.py --list
make --no-print-directory device-check DEVICE_PY="$PY" DEVICE_OUT="$OUT" \
    DEVICE_ARGS="$(printf '%q ' "${ARGS[@]}")" 2>&1 | tee "$VENV/rehearsal.log"
code=${PIPESTATUS[0]}
set -e

say "verdict"
"$PY" - "$OUT" "$code" "$VENV" <<'EOF'
import json
import pathlib
import sys

out, code, venv = pathlib.Path(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
problems = []
report = json.loads((out / "device-check.json").read_text())
if report.get("vlft_source") != "source-tree":
    problems.append(f"the check took the way {report.get('vlft_source')!r}, not the source tree")
tests = report.get("device_tests") or {}
check = report.get("exit_code")
print(f"device check: exit {check} (make {code}); accelerators {report['accelerators'] or 'none'}; device tests "
      + ", ".join(f"{tests.get(k, '?')} {k}" for k in ("passed", "skipped", "failed", "errors"))
      + f" in {next((s['seconds'] for s in report['steps'] if s['name'] == 'device-tests'), '?')} s")
if report.get("pytest_args"):
    print(f"NOTE: the device tests ran with extra pytest arguments: {' '.join(report['pytest_args'])}")
if check not in (0, 3) or code != (0 if check == 0 else 2):  # make says 2 for any failing recipe
    problems.append(f"bench/device_check.py exited {check}, make {code} (3 is the no-accelerator exit, 0 a full pass)")
if tests.get("failed", 1) or tests.get("errors", 1) or not tests.get("passed"):
    problems.append("the device check's own test set did not pass")
site = [p for p in venv.glob("lib/python*/site-packages/*")
        if p.name.lower().startswith(("vlft", "__editable__.vlft", "_vlft")) or p.name.endswith(".egg-link")]
if site:
    problems.append(f"something was installed into the venv: {[p.name for p in site]}")
for p in problems:
    print("FAIL:", p)
extra = f" (device tests run with: {' '.join(report['pytest_args'])})" if report.get("pytest_args") else ""
print("rehearsal", "FAILED" if problems else "PASSED", extra)
sys.exit(1 if problems else 0)
EOF
