"""``make device-check``'s own tooling, on the CPU: the checkout way (no install step, no metadata), the time
budget, the step runner's timeout, and the report's counts and 7B-shape table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a package of the repository, not an installed one
    sys.path.insert(0, str(ROOT))

from bench import device_check, device_report  # noqa: E402 - after the repository is on sys.path


def test_the_checkout_way_imports_vlft_from_this_checkout_and_writes_no_metadata():
    """The device check's way to vlft: the checkout first on PYTHONPATH, nothing generated. The child it
    checks in imports vlft from here and registers the built-in plugins."""
    before = sorted(p.name for p in ROOT.iterdir())
    way = device_check.checkout_way()
    assert way["pythonpath"].split(os.pathsep)[0] == str(ROOT)
    assert Path(way["vlft"]).resolve().is_relative_to(ROOT)
    assert {"cpu", "cuda", "lora", "oft", "models", "sft"} <= set(way["plugins"]) and not way["broken"]
    assert way["line"].startswith(f"vlft from this checkout ({ROOT}), plugins: ")
    assert sorted(p.name for p in ROOT.iterdir()) == before  # no .device-site, no dist-info


def test_the_checkout_way_refuses_a_vlft_imported_from_elsewhere(tmp_path, monkeypatch):
    """A checkout without vlft in it, while the inherited PYTHONPATH holds another: refused, naming both."""
    empty = tmp_path / "checkout"
    empty.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    with pytest.raises(RuntimeError, match=f"vlft imports from {ROOT}.*not from this checkout"):
        device_check.checkout_way(repo=empty)


# what installs a package: an installer program, or Python running one as a module or a setup script
INSTALLERS = {"pip", "pip3", "uv", "easy_install", "conda", "mamba", "ensurepip"}


def installs(argv: list[str]) -> bool:
    """Whether ``argv`` (one process's command line) runs an installer."""
    names = [Path(a).name for a in argv]
    if not names:
        return False
    if names[0] in INSTALLERS or re.fullmatch(r"pip3?(\.\d+)*", names[0]):
        return True
    modules = [b for a, b in zip(names, names[1:]) if a == "-m"]
    return any(m.split(".")[0] in INSTALLERS for m in modules) or (
        "setup.py" in names and any(a in ("install", "develop", "bdist_egg") for a in names)
    )


@pytest.mark.parametrize(
    "argv, yes",
    [
        (["pip", "install", "x"], True),
        (["/usr/bin/pip3.11", "install", "-e", "."], True),
        (["python3", "-m", "pip", "install", "torch"], True),
        (["py", "-m", "ensurepip"], True),
        (["uv", "pip", "install", "x"], True),
        (["python", "setup.py", "develop"], True),
        (["python", "bench/device_check.py", "--out", "o"], False),
        (["py", "-m", "pytest", "-q"], False),
        (["py", "-m", "vlft", "parity"], False),
        (["git", "describe"], False),
    ],
)
def test_installs_knows_an_installer_from_the_device_checks_commands(argv, yes):
    assert installs(argv) is yes


def test_the_makefile_device_check_runs_one_command_and_no_installer():
    """What `make device-check` would run with every prerequisite out of date (``make -n -B``): an install step
    that crept in as a recipe line or as a prerequisite (the venv's ``$(STAMP)``) is printed and named."""
    import shlex
    import shutil

    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed here")
    # under `make test` the parent make's MAKEFLAGS/MAKELEVEL would make this one a sub-make, which prints
    # "Entering directory" lines among the commands: run it as a user would, from a shell
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    proc = subprocess.run(
        [make, "-n", "-B", "device-check", "DEVICE_PY=py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [c for c in commands if installs(c)] == []
    assert [c[:2] for c in commands] == [["py", "bench/device_check.py"]]


SPAWN_LOGGER = textwrap.dedent("""\
    # Records, for a test, every process this Python starts and every installer module it imports.
    import json
    import os
    import sys

    _LOG = os.environ["VLFT_SPAWN_LOG"]


    def _write(event, argv):
        with open(_LOG, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "argv": [str(a) for a in argv]}) + "\\n")


    def _hook(event, args):
        if event == "subprocess.Popen":
            _write(event, [args[1]] if isinstance(args[1], (str, bytes)) else list(args[1]))
        elif event in ("os.exec", "os.posix_spawn"):
            _write(event, list(args[1]))
        elif event == "os.spawn":
            _write(event, list(args[2]))
        elif event == "os.system":
            _write(event, [args[0]])
        elif event == "import" and args[0].split(".")[0] in ("pip", "ensurepip"):
            _write(event, ["-m", args[0]])


    sys.addaudithook(_hook)
    """)


def test_the_device_check_starts_no_installer_and_changes_no_site_packages(tmp_path):
    """``bench/device_check.py`` as `make device-check` runs it, on this machine (no accelerator: the source-tree
    check, the backend probe and the device-tests step run; ``--collect-only`` keeps that step to collecting),
    watched from inside: an audit hook in it and in every Python it starts (a ``sitecustomize`` on PYTHONPATH)
    records each process started and each import of pip or ensurepip, and stand-ins for the installer
    programs come first on PATH. None of it installs, and this Python's site-packages are as they were."""
    import sysconfig

    hooks, bin_dir, log = tmp_path / "hooks", tmp_path / "bin", tmp_path / "spawned.jsonl"
    hooks.mkdir()
    bin_dir.mkdir()
    (hooks / "sitecustomize.py").write_text(SPAWN_LOGGER)
    for name in ("pip", "pip3", "uv", "easy_install", "conda"):
        stand_in = bin_dir / name
        stand_in.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path / "installer-ran"}"\nexit 1\n')
        stand_in.chmod(0o755)
    site = Path(sysconfig.get_paths()["purelib"])
    before = sorted(p.name for p in site.iterdir())
    env = {
        **os.environ,
        "VLFT_SPAWN_LOG": str(log),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p),
        "CUDA_VISIBLE_DEVICES": "",
    }  # whatever this machine has, the device steps stay unrun
    proc = subprocess.run(
        [sys.executable, "bench/device_check.py", "--out", str(tmp_path / "out"), "--pytest-args=--collect-only"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]  # 3: no accelerator, tests collected
    spawned = [json.loads(line) for line in log.read_text().splitlines()]
    started = [s["argv"] for s in spawned if s["event"] != "import"]
    # the watch saw the check's own children: the device tests' pytest, started by the check's process
    assert any(argv[1:3] == ["-m", "pytest"] and "tests/hardware" in argv for argv in started), started
    assert [s for s in spawned if s["event"] == "import" or installs(s["argv"])] == []
    assert not (tmp_path / "installer-ran").exists()
    assert sorted(p.name for p in site.iterdir()) == before


def test_the_time_budget_adds_up():
    full, full_budget = device_check.plan(quick=False)
    quick, quick_budget = device_check.plan(quick=True)
    assert full_budget <= 480 and sum(s.timeout_s for s in full) <= full_budget
    # the quick plan leaves room for the set-up (the source-tree check, the backend probe) in 4 minutes
    assert quick_budget <= 240 and sum(s.timeout_s for s in quick) <= quick_budget - 10
    for s in (*full, *quick):
        assert 0 < s.estimate_s <= s.timeout_s, s
    names = [s.name for s in quick]
    assert names[0] == "device-tests" and any(n.startswith("parity-") for n in names) and "scale" in names
    scale = device_check.command(next(s for s in quick if s.name == "scale"), "py", "cuda", Path("o"), True)
    assert scale[scale.index("--methods") + 1] == "lora" and scale[scale.index("--checkpointing") + 1] == "off"

    # on a device its tests only (the accelerator parity tests carry its marker); without one, all of them
    def values(cmd, flag):
        return [b for a, b in zip(cmd, cmd[1:]) if a == flag]

    tests = device_check.command(quick[0], "py", "cuda", Path("o"), True)
    assert values(tests, "-m") == ["pytest", "cuda or npu"] and values(tests, "-k") == ["not reverse_order"]
    assert values(device_check.command(full[0], "py", None, Path("o"), False), "-m") == ["pytest"]
    assert values(device_check.command(full[0], "py", "cuda", Path("o"), False), "-k") == []
    assert {s.name for s in full} >= {"device-tests", "parity-auto", "parity-fp32", "fsdp-one-process", "scale"}


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(120)\n"
    )
    r = device_check.step("sleeper", [sys.executable, "-c", code], tmp_path, timeout=3)
    assert r["exit"] == "timeout"
    assert "started" in (tmp_path / "sleeper.log").read_text()
    child = int(pid_file.read_text())

    def child_state() -> str:
        try:
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return "gone"

    # the kill was sent; on a loaded machine the child may take a moment to be scheduled and die (5 s at most)
    deadline = time.monotonic() + 5
    while (state := child_state()) not in ("gone", "Z", "X") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state in ("gone", "Z", "X"), f"the step's child {child} outlived the timeout ({state})"
    ok = device_check.step("ok", [sys.executable, "-c", "print('fine')"], tmp_path, timeout=60)
    assert ok["exit"] == 0 and (tmp_path / "ok.log").read_text() == "fine\n"


def test_the_device_tests_counts_come_from_junit_xml_and_from_the_summary_line(tmp_path):
    (tmp_path / "test_three.py").write_text(
        textwrap.dedent("""\
        import pytest
        def test_passes(): pass
        def test_passes_too(): pass
        def test_fails(): assert False
        @pytest.mark.skip(reason="no device here")
        def test_skips(): pass
        """)
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    xml = tmp_path / "r.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            f"--junitxml={xml}",
            "test_three.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = {"passed": 2, "skipped": 1, "failed": 1, "errors": 0, "total": 4}
    c = device_report.counts_from_junit(xml)
    assert {k: c[k] for k in expected} == expected
    s = device_report.counts_from_summary(proc.stdout)
    assert {k: s[k] for k in expected} == expected, proc.stdout[-500:]
    log = tmp_path / "log"
    log.write_text(proc.stdout)
    assert device_report.device_test_counts(tmp_path / "missing.xml", log)["source"] == "summary line"
    assert device_report.device_test_counts(tmp_path / "missing.xml", tmp_path / "no-log")["total"] == 0


def test_the_report_puts_the_7b_table_in_the_field_reports_shape(tmp_path):
    gib = 2**30

    def run(method, ckpt, s, peak, est):
        return {
            "method": method,
            "checkpointing": ckpt,
            "median_step_s": s,
            "peak_bytes": peak * gib,
            "estimate_bytes": est * gib,
            "precision": "bf16",
            "attention": "sdpa",
        }

    scale = {
        "backend": "cuda",
        "settings": {
            "batch": 4,
            "text_tokens": 256,
            "image": "448x448",
            "targets": "text attention + last 6 vision blocks",
        },
        "runs": [
            run("oft", True, 0.9, 20.0, 21.0),
            run("lora", False, 0.5, 30.0, 33.0),
            run("oft", False, 0.6, 31.0, 30.0),
            run("lora", True, 0.7, 19.0, 19.5),
        ],
    }
    (tmp_path / "device-scale.json").write_text(json.dumps(scale))
    steps = [{"name": "device-tests", "exit": 0, "seconds": 12.0, "timeout_s": 200, "estimate_s": 150}]
    counts = {"passed": 5, "skipped": 2, "failed": 0, "errors": 0, "total": 7, "source": "junitxml"}
    budget = {"mode": "full", "timeout_total_s": 480, "estimate_total_s": 330}
    report = device_report.build(
        {"mode": "source-tree", "line": "vlft not installed: ..."},
        ["cuda"],
        {},
        steps,
        counts,
        device_report.read_scale(tmp_path),
        budget,
    )
    device_report.write(tmp_path, report)
    assert json.loads((tmp_path / "device-check.json").read_text())["device_tests"]["passed"] == 5
    md = (tmp_path / "device-check.md").read_text()
    table = [line for line in md.splitlines() if line.startswith(("| LoRA", "| OFT"))]
    assert table == [
        "| LoRA | off | 0.500 | 30.00 GiB | 33.00 GiB | 1.100 |",
        "| OFT | off | 0.600 | 31.00 GiB | 30.00 GiB | 0.968 |",
        "| LoRA | on | 0.700 | 19.00 GiB | 19.50 GiB | 1.026 |",
        "| OFT | on | 0.900 | 20.00 GiB | 21.00 GiB | 1.050 |",
    ]
    assert "| method | checkpointing | s/step | peak memory | memory plan estimate | estimate/measured |" in md
    assert "| 5 | 2 | 0 | 0 |" in md
    empty = device_report.markdown(
        device_report.build({"line": ""}, [], {"cuda": "no GPU"}, steps, counts, None, budget)
    )
    assert "Not run: no accelerator here." in empty and "- no cuda: no GPU" in empty
