"""The house rules, read from the imports with ``ast``: the pipeline's floors, no circles, no import upward.

Floors, bottom-up: the face (``vlft/*.py``: the plugin API, hook specs, policies, errors, config, the
registry, the meters), then ``data``, ``models``, ``planning``, ``training``, ``evaluation``,
``commands``, and on top the built-in plugins (``builtin``) and the two entry points that drive a whole
run (``__main__``, ``testing``). The CLI's group and option helpers are face: the commands build on them,
and it reaches the commands only through the plugin registry (the ``commands`` entry point). A module imports only from its own floor or below; every import counts,
at module level, under ``TYPE_CHECKING`` or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

VLFT = Path(__file__).resolve().parents[1] / "vlft"
FLOORS = ["face", "data", "models", "planning", "training", "evaluation", "commands", "builtin", "entry"]
ENTRY = {"vlft.__main__", "vlft.testing"}
# a function-local import outside the face says why, in a comment on its line or the line above, or once
# for the module in its docstring (a line starting with this)
MODULE_REASON = "Imports inside functions:"


def module_name(path: Path, root: Path = VLFT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> str:
    if module in ENTRY:
        return "entry"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FLOORS:
        return parts[1]
    return "face"


class Import:
    def __init__(self, source: str, target: str, line: int, local: bool, reasoned: bool, typing_only: bool):
        self.source, self.target, self.line, self.local, self.reasoned = source, target, line, local, reasoned
        self.typing_only = typing_only  # under `if TYPE_CHECKING:`: read by type checkers, never run

    def __repr__(self):
        return f"{self.source}:{self.line} -> {self.target}"


def read_imports(root: Path = VLFT) -> tuple[dict[str, Path], list[Import]]:
    """Every module under ``root`` and every import of another vlft module (or of torch, in the face)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    found = []
    for name, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.splitlines()
        doc = ast.get_docstring(tree) or ""
        module_reason = any(line.startswith(MODULE_REASON) for line in doc.splitlines())
        top_level, typing_only = set(), set()
        for node in tree.body:
            for inner in ast.walk(node) if isinstance(node, (ast.If, ast.Try, ast.Import, ast.ImportFrom)) else ():
                top_level.add(id(inner))
                if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                    typing_only.add(id(inner))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            local = id(node) not in top_level
            before = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            reasoned = (module_reason or before.startswith("#")
                        or any("#" in line for line in lines[node.lineno - 1:node.end_lineno]))
            for target in _targets(node, package, modules):
                found.append(Import(name, target, node.lineno, local, reasoned, id(node) in typing_only))
    return modules, found


def _targets(node, package: str, modules: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(up + ([node.module] if node.module else []))
    # `from vlft.planning import memory` imports the submodule
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def vlft_edges(imports: list[Import], modules: dict) -> list[Import]:
    return [i for i in imports if i.target in modules and i.target != i.source]


def upward(imports: list[Import], modules: dict) -> list[Import]:
    return [i for i in vlft_edges(imports, modules)
            if FLOORS.index(floor(i.target)) > FLOORS.index(floor(i.source))]


def circles(imports: list[Import], modules: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in vlft_edges(imports, modules):
        if i.target != "vlft":  # the package itself: the face's __init__, which imports only the face
            graph[i.source].add(i.target)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def house():
    return read_imports()


def test_no_module_imports_from_a_floor_above_its_own(house):
    modules, imports = house
    assert upward(imports, modules) == []


def test_planning_never_imports_training_and_data_and_models_import_nothing_above_them(house):
    modules, imports = house
    edges = vlft_edges(imports, modules)
    assert [i for i in edges if floor(i.source) == "planning" and floor(i.target) == "training"] == []
    allowed = {"data": {"face", "data"}, "models": {"face", "data", "models"}}
    assert [i for i in edges if floor(i.source) in allowed and floor(i.target) not in allowed[floor(i.source)]] == []


def test_only_the_cli_imports_the_commands(house):
    modules, imports = house
    importers = {i.source for i in vlft_edges(imports, modules)
                 if floor(i.target) == "commands" and floor(i.source) != "commands"}
    # the commands plugin adds them to the CLI; vlft.testing runs `vlft run` as a user would
    assert importers <= {"vlft.builtin.commands", "vlft.testing"}


def test_only_commands_import_evaluation_and_training_together(house):
    modules, imports = house
    both = {}
    for i in vlft_edges(imports, modules):
        both.setdefault(i.source, set()).add(floor(i.target))
    assert [m for m, floors in both.items()
            if {"evaluation", "training"} <= floors and floor(m) not in ("commands", "evaluation")] == []


def test_no_import_circles(house):
    modules, imports = house
    assert circles(imports, modules) == []


def test_function_local_imports_only_in_the_face_or_with_a_reason(house):
    modules, imports = house
    unexplained = [i for i in imports if i.local and floor(i.source) not in ("face", "entry") and not i.reasoned]
    assert unexplained == []


def test_the_face_imports_no_torch_at_module_level(house):
    modules, imports = house
    assert [i for i in imports if floor(i.source) in ("face", "entry") and not i.local and not i.typing_only
            and i.target.split(".")[0] in ("torch", "transformers", "peft")] == []


def test_the_rules_catch_a_planning_to_training_import(tmp_path):
    """The checks above can fail: a copy of the house with one planning -> training import added."""
    import shutil

    copy = tmp_path / "vlft"
    shutil.copytree(VLFT, copy, ignore=shutil.ignore_patterns("__pycache__", "configs"))
    plan = copy / "planning" / "plan.py"
    plan.write_text(plan.read_text() + "\nfrom vlft.training.step import StepPolicy\n")
    modules, imports = read_imports(copy)
    bad = upward(imports, modules)
    assert [(i.source, i.target) for i in bad] == [("vlft.planning.plan", "vlft.training.step")]
    # and a circle, once training.step (which planning.plan now imports) imports planning.plan back
    step = copy / "training" / "step.py"
    step.write_text(step.read_text() + "\nimport vlft.planning.plan\n")
    _, imports = read_imports(copy)
    assert any({"vlft.planning.plan", "vlft.training.step"} <= set(c) for c in circles(imports, modules))
