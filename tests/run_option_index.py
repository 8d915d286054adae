"""What test_run_options.py reads: the tests of this folder as source, each test with the fixtures it asks for
(those defined in its module or a conftest, followed through the fixtures they ask for), so a check can
ask "does this test, with what it is given, make a real run that uses this option?".
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# a real `vlft run` is started by one of these (in-process through the command's own entry point, or a process)
RUN_ENTRIES = ("execute(", "testing.run(", "vlft_command()", "torch.distributed.run", "\"run\"", "'run'",
               "_run(", "_cli(", "_short_run(", "straight_run", "family_run", "invoke(cli",
               "cli_invoke(")


@dataclass
class TestSource:
    where: str  # "file.py::test_name"
    text: str  # the test's source and its fixtures'


@functools.lru_cache(maxsize=None)
def _text(path: Path) -> str:
    return path.read_text()


@functools.lru_cache(maxsize=None)
def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(_text(path))
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def _source(path: Path, node: ast.FunctionDef) -> str:
    lines = _text(path).splitlines()
    return "\n".join(lines[node.lineno - 1:node.end_lineno])


@functools.lru_cache(maxsize=None)
def collect() -> dict[str, TestSource]:
    """Every test function under tests/, by "relative/path.py::name", with the source it runs."""
    files = sorted(p for p in HERE.rglob("test_*.py"))
    conftests = {p.parent: p for p in HERE.rglob("conftest.py")}
    out: dict[str, TestSource] = {}
    for path in files:
        own = _functions(path)
        helpers: dict[str, tuple[Path, ast.FunctionDef]] = {}
        folder = path.parent
        while folder == HERE or HERE in folder.parents:
            if folder in conftests:
                for name, node in _functions(conftests[folder]).items():
                    helpers.setdefault(name, (conftests[folder], node))
            folder = folder.parent
        for name, node in own.items():
            helpers[name] = (path, node)
        for name, node in own.items():
            if not name.startswith("test_"):
                continue
            seen, todo, parts = set(), [name], []
            while todo:
                fn = todo.pop()
                if fn in seen or fn not in helpers:
                    continue
                seen.add(fn)
                where, fnode = helpers[fn]
                text = _source(where, fnode)
                parts.append(text)
                todo += [a.arg for a in fnode.args.args]
                # module-level helpers it calls (short_config(...), _values(...)) carry flags too
                todo += [c for c in re.findall(r"\b([A-Za-z_]\w*)\(", text) if c in helpers]
            out[f"{path.relative_to(HERE)}::{name}"] = TestSource(f"{path.relative_to(HERE)}::{name}",
                                                                  "\n".join(parts))
    return out


def uses(text: str, flag: str, key: str) -> bool:
    """The source names the option: as a flag, or as a config key (``key=...``, ``"key": ...``)."""
    return (flag in text or re.search(rf"\b{key}\s*=", text) is not None
            or re.search(rf"[\"']{key}[\"']\s*:", text) is not None)


def runs(text: str) -> bool:
    return any(entry in text for entry in RUN_ENTRIES)
