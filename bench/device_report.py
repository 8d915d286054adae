"""What ``make device-check`` reports: ``device-check.json`` and ``device-check.md`` in its ``--out`` folder.

- where vlft was imported from (the checkout, first on PYTHONPATH) and the plugins that registered;
- each step: its exit, its time, its timeout and its estimate on one large GPU;
- the device tests' pass/skip/fail counts, read from pytest's JUnit XML (pytest's closing summary line
  where the XML is missing, e.g. after a timeout);
- the Qwen2.5-VL-7B-shape benchmark (``device-scale.json``) in the field report's table shape: method
  (LoRA, OFT), s/step, peak memory, beside the memory plan's estimate.

Only plain reading and formatting here: no vlft import, so the report is written whatever broke.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

GIB = 2**30
COUNTS = ("passed", "skipped", "failed", "errors")
_SUMMARY = re.compile(r"(\d+) (passed|skipped|failed|errors?|deselected|xfailed|xpassed|warnings?)\b")


def counts_from_junit(path: Path) -> dict | None:
    """{passed, skipped, failed, errors, total} from pytest's ``--junitxml`` file, or None if unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        return None
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {
        "passed": total - failed - errors - skipped,
        "skipped": skipped,
        "failed": failed,
        "errors": errors,
        "total": total,
        "source": "junitxml",
    }


def counts_from_summary(text: str) -> dict | None:
    """The counts in pytest's last summary line (``== 3 passed, 2 skipped in 4.1s ==`` or ``-q``'s form)."""
    for line in reversed(text.splitlines()):
        found = dict((kind, int(n)) for n, kind in _SUMMARY.findall(line))
        if found and re.search(r"\bin [\d.]+s\b", line):
            c = {
                "passed": found.get("passed", 0),
                "skipped": found.get("skipped", 0),
                "failed": found.get("failed", 0),
                "errors": found.get("errors", found.get("error", 0)),
            }
            c["total"] = sum(c.values())
            c["source"] = "summary line"
            return c
    return None


def device_test_counts(junit: Path, log: Path) -> dict:
    c = counts_from_junit(junit)
    if c is None:
        try:
            c = counts_from_summary(log.read_text(errors="replace"))
        except OSError:
            c = None
    return c or {
        "passed": 0,
        "skipped": 0,
        "failed": 0,
        "errors": 0,
        "total": 0,
        "source": "none (pytest wrote no result)",
    }


def scale_rows(scale: dict | None) -> list[dict]:
    """The benchmark's runs as the field report's rows: LoRA then OFT, checkpointing off then on."""
    if not scale:
        return []
    rows = []
    for r in scale.get("runs", []):
        rows.append(
            {
                "method": {"lora": "LoRA", "oft": "OFT"}.get(r["method"], r["method"]),
                "checkpointing": bool(r.get("checkpointing")),
                "s_per_step": r["median_step_s"],
                "peak_gib": r["peak_bytes"] / GIB,
                "estimate_gib": r["estimate_bytes"] / GIB,
                "estimate_over_measured": r["estimate_bytes"] / r["peak_bytes"] if r["peak_bytes"] else None,
                "precision": r.get("precision"),
                "attention": r.get("attention"),
            }
        )
    rows.sort(key=lambda x: (x["checkpointing"], x["method"] != "LoRA", x["method"]))
    return rows


def build(
    way: dict, accelerators: list, missing: dict, steps: list[dict], counts: dict, scale: dict | None, budget: dict
) -> dict:
    return {
        "vlft_source": way.get("mode"),
        "way": way,
        "accelerators": accelerators,
        "missing": missing,
        "budget": budget,
        "steps": steps,
        "device_tests": counts,
        "scale": scale_rows(scale),
        "scale_settings": (scale or {}).get("settings"),
        "scale_backend": (scale or {}).get("backend"),
        "scale_model": (scale or {}).get("model"),
    }


def markdown(r: dict) -> str:
    lines = ["# make device-check", "", r["way"].get("line", ""), ""]
    if "exit_code" in r:
        lines += [
            f"Exit {r['exit_code']} (0: every step passed; 3: no accelerator here, the device tests passed; "
            "1: something failed).",
            "",
        ]
    if r.get("pytest_args"):
        lines += [f"The device tests ran with extra pytest arguments: `{' '.join(r['pytest_args'])}`.", ""]
    acc = ", ".join(r["accelerators"]) or "none"
    lines += [f"Accelerators: {acc}."]
    lines += [f"- no {k}: {v}" for k, v in r["missing"].items()]
    b = r["budget"]
    lines += [
        "",
        f"## Steps ({b['mode']}; timeouts {b['timeout_total_s']} s in all, estimate {b['estimate_total_s']} s"
        f" on one large GPU)",
        "",
        "| step | exit | time | timeout | estimate (one large GPU) |",
        "|---|---|---|---|---|",
    ]
    for s in r["steps"]:
        lines.append(f"| {s['name']} | {s['exit']} | {s['seconds']:.0f} s | {s['timeout_s']} s | {s['estimate_s']} s |")
    c = r["device_tests"]
    lines += [
        "",
        "## Device tests (tests/hardware, tests/parity)",
        "",
        "| passed | skipped | failed | errors |",
        "|---|---|---|---|",
        f"| {c['passed']} | {c['skipped']} | {c['failed']} | {c['errors']} |",
        "",
        f"(from {c['source']})",
    ]
    lines += ["", f"## {r.get('scale_model') or 'qwen2.5-vl-7b'} shape, one device (random weights)", ""]
    if r["scale"]:
        if r.get("scale_settings"):
            s = r["scale_settings"]
            lines += [
                f"On {r.get('scale_backend')}: batch {s.get('batch')}, {s.get('image')} images, "
                f"{s.get('text_tokens')} text tokens, {s.get('targets')}.",
                "",
            ]
        lines += [
            "| method | checkpointing | s/step | peak memory | memory plan estimate | estimate/measured |",
            "|---|---|---|---|---|---|",
        ]
        for x in r["scale"]:
            ratio = f"{x['estimate_over_measured']:.3f}" if x["estimate_over_measured"] else "-"
            lines.append(
                f"| {x['method']} | {'on' if x['checkpointing'] else 'off'} | {x['s_per_step']:.3f} | "
                f"{x['peak_gib']:.2f} GiB | {x['estimate_gib']:.2f} GiB | {ratio} |"
            )
    else:
        lines.append("Not run" + ("" if r["accelerators"] else ": no accelerator here") + ".")
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device-check.json").write_text(json.dumps(report, indent=2))
    (out / "device-check.md").write_text(markdown(report))


def read_scale(out: Path) -> dict | None:
    try:
        return json.loads((out / "device-scale.json").read_text())
    except (OSError, ValueError):
        return None
