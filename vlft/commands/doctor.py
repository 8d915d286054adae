"""``vlft doctor``: what each backend needs, what this machine has, and the fix for each gap.

The core knows no vendor: it lists the packages every backend shares, asks
each backend plugin's probe, and collects the ``vlft_doctor_checks`` of all
plugins. The exit status is 0 when the chosen backend (``--backend``,
default ``auto``) can run here, 1 otherwise.

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import sys

import click

from vlft.contracts.backend import DoctorCheck
from vlft.errors import VlftError
from vlft.floors import TORCH_FLOOR, torch_too_old

COMMON_PACKAGES = ("torch", "transformers", "peft", "pluggy")


def common_checks(registry) -> list[DoctorCheck]:
    """Python, the shared packages, and the plugins that failed to load."""
    checks = [DoctorCheck("python", True, f"{platform.python_version()} ({sys.executable})")]
    for name in COMMON_PACKAGES:
        try:
            version = importlib.metadata.version(name)
            checks.append(torch_check(version) if name == "torch" else DoctorCheck(name, True, version))
        except importlib.metadata.PackageNotFoundError:
            checks.append(DoctorCheck(name, False, "not installed", f"pip install {name}"))
    for name, error in sorted(registry.broken.items()):
        checks.append(
            DoctorCheck(
                f"plugin {name}",
                False,
                f"failed to load: {error}",
                f"reinstall it, or block it with VLFT_DISABLE_PLUGINS={name}",
                blocking=False,
            )
        )
    return checks


def torch_check(version: str) -> DoctorCheck:
    """torch at or above the floor vlft's training needs (``floors.TORCH_FLOOR``)."""
    too_old = torch_too_old(version)
    if too_old is None:
        return DoctorCheck("torch", True, version)
    return DoctorCheck("torch", False, too_old, f"pip install 'torch>={TORCH_FLOOR}'")


def backend_checks(registry, name: str) -> list[DoctorCheck]:
    """Every plugin's checks for ``name``; a plugin whose checks raise is reported, not fatal."""
    checks: list[DoctorCheck] = []
    for impl in reversed(registry.pm.hook.vlft_doctor_checks.get_hookimpls()):  # pluggy's call order
        try:
            answer = impl.function(backend=name)
        except Exception as e:  # noqa: BLE001 - one broken plugin must not hide the others
            answer = [
                DoctorCheck(
                    f"checks of plugin {impl.plugin_name}", False, f"raised {e.__class__.__name__}: {e}", blocking=False
                )
            ]
        checks.extend(answer or [])
    return checks


def diagnose(registry, backend: str = "auto") -> dict:
    """The whole report as data: common checks, one section per backend, the chosen one and whether it is usable."""
    from vlft.planning.plan import choose_backend

    if backend != "auto":
        registry.backend(backend)  # an unknown name is a ConfigError listing the valid ones
    sections = []
    ranked = sorted(registry.backends.values(), key=lambda b: (-b.priority, b.name))
    for info in ranked:
        if backend != "auto" and info.name != backend:
            continue
        probe = registry.first("vlft_probe_backend", backend=info.name)
        sections.append(
            {
                "name": info.name,
                "device_type": info.device_type,
                "priority": info.priority,
                "plugin": registry.owners.get(("backend", info.name)),
                "available": probe.available,
                "reason": probe.reason,
                "device_count": probe.device_count,
                "versions": probe.versions,
                "warnings": probe.warnings,
                "checks": [dataclasses.asdict(c) for c in backend_checks(registry, info.name)],
            }
        )
    try:
        choice = choose_backend(registry, backend)
        chosen, why, available = choice.info.name, choice.reason, choice.probe.available
        reason = choice.probe.reason
    except VlftError as e:  # auto, and nothing available
        chosen, why, available, reason = None, str(e), False, str(e)
    section = next((s for s in sections if s["name"] == chosen), None)
    blocking = [c for c in (section["checks"] if section else []) if not c["ok"] and c["blocking"]]
    usable = available and not blocking
    return {
        "asked": backend,
        "chosen": chosen,
        "chosen_because": why,
        "usable": usable,
        "reason": reason if not available else "; ".join(f"{c['name']}: {c['detail']}" for c in blocking),
        "common": [dataclasses.asdict(c) for c in common_checks(registry)],
        "backends": sections,
    }


def _mark(check: dict) -> str:
    if check["ok"]:
        return "ok  "
    return "FAIL" if check["blocking"] else "warn"


def format_report(report: dict) -> str:
    lines = ["common"]
    lines += _format_checks(report["common"])
    for s in report["backends"]:
        state = f"available, {s['device_count']} device(s)" if s["available"] else f"UNAVAILABLE: {s['reason']}"
        head = f"{s['name']} (device type {s['device_type']}, priority {s['priority']}, plugin {s['plugin']})"
        lines += ["", f"{head}: {state}"]
        if s["versions"]:
            lines.append("  versions  " + ", ".join(f"{k} {v}" for k, v in s["versions"].items()))
        lines += _format_checks(s["checks"])
        lines += [f"  warning   {w}" for w in s["warnings"]]
    lines.append("")
    if report["usable"]:
        lines.append(f"backend {report['chosen']} is usable here ({report['chosen_because'].split(';')[0]})")
    elif report["chosen"]:
        lines.append(f"backend {report['chosen']} is NOT usable here: {report['reason']}")
    else:
        lines.append(f"no backend is usable here: {report['reason']}")
    return "\n".join(lines)


def _format_checks(checks: list[dict]) -> list[str]:
    out = []
    for c in checks:
        out.append(f"  {_mark(c)}  {c['name']}: {c['detail']}")
        if not c["ok"] and c["fix"]:
            out.append(f"        fix: {c['fix']}")
    return out


@click.command()
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    help="Backend to check; 'auto' checks all and judges the one `vlft run` would pick.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(backend, as_json):
    """Check what each backend needs against this machine: packages, devices, versions, environment.

    Exit status 0 when the chosen backend can run here, 1 otherwise.
    """
    from vlft.registry import get_registry

    try:
        report = diagnose(get_registry(), backend)
    except VlftError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    if not report["usable"]:
        sys.exit(1)
