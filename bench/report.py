"""Turn pytest-benchmark's JSON (``make bench``) into a markdown report of ratios and peak memory.

    python bench/report.py bench/results/latest.json [bench/results/nf4.json ...] > bench/results/latest.md

Several files (``make bench`` runs the 4-bit memory case in a second pass, with bitsandbytes on the
path) make one report: their benchmarks together, the machine and commit of the first.

Everything comes from each benchmark's ``extra_info`` (see bench/support/figures.py):
``figures`` (ratios with their targets), ``variants`` (per-variant medians of
the interleaved timing), ``memory`` (peak per variant) and, for the dispatch
group, hook calls and synchronisations per step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GROUP_ORDER = ["train_step", "loop_overhead", "padding", "inference", "data", "dispatch", "memory"]


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_value(v, unit: str = "x") -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and unit != "x"):
        return f"{int(v)}"
    return f"{v:.3f}{unit}" if unit == "x" else f"{v:.3g}"


def fmt_met(met) -> str:
    return {True: "met", False: "**missed**", None: ""}[met]


def fmt_time(s) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def ordered(benchmarks: list[dict]) -> list[dict]:
    def key(b):
        e = b.get("extra_info", {})
        g = e.get("group") or b.get("group") or ""
        return (GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g, e.get("model") or "", b["name"])

    return sorted(benchmarks, key=key)


def _dispatch_rows(extra: dict) -> list[tuple[str, dict]]:
    """(label, counts) per method; a several-process result (a list, one entry per rank) gives a row a rank."""
    rows = []
    for method, r in (extra.get("dispatch") or {}).items():
        if isinstance(r, list):
            rows += [(f"{method}, rank {x.get('rank', i)}", x) for i, x in enumerate(r)]
        else:
            rows.append((method, r))
    return rows


def render(data: dict) -> str:
    benchmarks = ordered([b for b in data.get("benchmarks", []) if b.get("extra_info", {}).get("figures")])
    lines = ["# vlft benchmarks", ""]
    machine = data.get("machine_info", {})
    commit = data.get("commit_info", {})
    first = benchmarks[0]["extra_info"] if benchmarks else {}
    setting = [
        f"backend **{first.get('backend', '?')}** ({first.get('device', '?')}, "
        f"precision {first.get('precision', '?')})",
        f"torch threads {first.get('threads', '?')}, OMP_WAIT_POLICY={first.get('omp_wait_policy')}",
        f"machine {machine.get('cpu', {}).get('brand_raw', machine.get('processor', '?'))}, "
        f"{machine.get('cpu', {}).get('count', '?')} CPUs, Python {machine.get('python_version', '?')}",
        f"commit {str(commit.get('id', '?'))[:12]}{' (dirty)' if commit.get('dirty') else ''}, "
        f"{data.get('datetime', '')}",
    ]
    if any(b["extra_info"].get("benchmark_disabled") for b in benchmarks):
        setting.append("**benchmarks were disabled: the figures below come from a single round and mean nothing**")
    lines += [f"- {s}" for s in setting]
    lines += [
        "",
        "Variants of a group are timed side by side in one run, interleaved round by round; a time "
        "ratio is the median over rounds of the paired ratio (the ratio of the medians beside it). "
        "Targets are reported, never asserted.",
        "",
    ]

    # -- figures -----------------------------------------------------------------------------
    lines += ["## Figures", ""]
    rows = []
    for b in benchmarks:
        e = b["extra_info"]
        for name, f in e["figures"].items():
            rom = f.get("ratio_of_medians")
            rows.append(
                [
                    e.get("group", ""),
                    e.get("model") or "",
                    name,
                    fmt_value(f.get("value"), f.get("unit", "x")),
                    fmt_value(rom) if rom is not None else "",
                    f.get("target") or "",
                    fmt_met(f.get("met")),
                ]
            )
    lines += table(["group", "model", "figure", "value", "ratio of medians", "target", ""], rows)

    # -- peak memory -----------------------------------------------------------------------------
    mem_rows = []
    for b in benchmarks:
        e = b["extra_info"]
        for variant, m in (e.get("memory") or {}).items():
            extra = m.get("activation_bytes", m.get("step_bytes"))
            mem_rows.append(
                [
                    e.get("group", ""),
                    e.get("model") or "",
                    variant,
                    fmt_bytes(m.get("peak_bytes")),
                    fmt_bytes(extra),
                    m.get("measure", ""),
                ]
            )
    if mem_rows:
        lines += ["", "## Peak memory per step", ""]
        lines += table(["group", "model", "variant", "peak", "activations / above resident", "measure"], mem_rows)

    # -- variants --------------------------------------------------------------------------------
    lines += ["", "## Variants", ""]
    var_rows = []
    for b in benchmarks:
        e = b["extra_info"]
        for variant, v in (e.get("variants") or {}).items():
            ips = v.get("items_per_s")
            var_rows.append(
                [
                    e.get("group", ""),
                    e.get("model") or "",
                    variant,
                    fmt_time(v.get("median_s")),
                    fmt_time(v.get("min_s")),
                    fmt_time(v.get("max_s")),
                    v.get("samples", ""),
                    f"{ips:.1f}" if ips is not None else "",
                ]
            )
    lines += table(["group", "model", "variant", "median", "min", "max", "samples", "items/s"], var_rows)

    # -- dispatch ----------------------------------------------------------------------------------
    disp_rows = []
    for b in benchmarks:
        e = b["extra_info"]
        for method, r in _dispatch_rows(e):
            s = r["syncs"]
            owners = ", ".join(f"{k} {v}" for k, v in sorted(s["by_owner"].items(), key=lambda kv: -kv[1]))
            disp_rows.append(
                [e.get("model") or "", method, r.get("hook_calls", "-"), s["total"], s["vlft_own"], owners]
            )
    if disp_rows:
        lines += ["", "## Hook calls and host-device synchronisations in one training step", ""]
        lines += table(["model", "method", "hook calls", "syncs", "by vlft", "syncs by who asked"], disp_rows)
        sites = {}
        for b in benchmarks:
            for _, r in _dispatch_rows(b["extra_info"]):
                for site, n in r["syncs"]["top_sites"].items():
                    sites[site] = max(sites.get(site, 0), n)
        if sites:
            lines += ["", "Where the synchronisations are asked for (most per step over models and methods):", ""]
            lines += [f"- `{site}`: {n}" for site, n in sorted(sites.items(), key=lambda kv: -kv[1])]

    # -- notes -------------------------------------------------------------------------------------
    notes = []
    for b in benchmarks:
        e = b["extra_info"]
        for n in e.get("notes", []):
            line = f"{e.get('group')}: {n}"
            if line not in notes:
                notes.append(line)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def merged(paths: list[str]) -> dict:
    """pytest-benchmark JSON files as one: the first's machine and commit, every file's benchmarks."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    return {**runs[0], "benchmarks": [b for run in runs for b in run.get("benchmarks", [])]}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python bench/report.py RESULTS.json [MORE.json ...] > REPORT.md", file=sys.stderr)
        return 2
    sys.stdout.write(render(merged(argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
