"""The house rules, read from the imports with ``ast``: the pipeline's floors, no circles, no import upward.

Floors, bottom-up: the face (``vlft/*.py``: hook specs, policies, errors, config, the registry, the meters, and
``vlft/contracts/``, what each plugin kind answers), then ``data``, the package ``vlft`` itself (the plugin
surface: it re-exports the face and the data helpers a family builds with), ``models``, ``planning``, ``training``, ``evaluation``,
``commands``, and on top the built-in plugins (``builtin``) and the two entry points that drive a whole
run (``__main__``, ``testing``). The CLI's group and option helpers are face: the commands build on them,
and it reaches the commands only through the plugin registry (the ``commands`` entry point). A module imports only from its own floor or below; every import counts,
at module level, under ``TYPE_CHECKING`` or inside a function.

The plugin packages (``plugins/`` as vlft/plugins.py maps them, and each plugin under ``examples/``) stand on
top of all of it: ``vlft`` imports none of them, none imports another, and inside one a part never imports
its package's hook module (``__init__``), which imports the parts. Their imports of vlft modules outside the
face (``vlft``'s private floors) are listed in ``PRIVATE_IMPORTS`` (none today: issue 41 gave plugins a public
surface); a new one fails, named. A plugin imports only ``vlft`` and ``vlft.testing`` (the guide names no
other module), so an import of ``vlft.errors`` or ``vlft.policies`` counts as private too; so do the guide's
code examples (``docs/*.md``), read the same way.

A function-local import outside the face gives its reason: a comment on its line(s) or directly above it, or
once for the module in its docstring (a paragraph starting with ``Imports inside functions:``). A reason is
at least three words once tool directives (``noqa``, ``type: ignore``, ``pyright: ignore``, ``pragma``) are taken out: a bare
``#`` or ``# noqa: E402`` says nothing about why.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLFT = ROOT / "vlft"
FLOORS = [
    "face",
    "data",
    "surface",
    "models",
    "planning",
    "training",
    "evaluation",
    "commands",
    "builtin",
    "entry",
    "plugins",
]
ENTRY = {"vlft.__main__", "vlft.testing"}
# what a plugin may import from vlft, as the guide names it: the package (``from vlft import ...``) and, in its
# tests, vlft.testing; not the modules behind the package (vlft.policies, vlft.errors, vlft.contracts.family)
PUBLIC_MODULES = ("vlft", "vlft.testing")
MODULE_REASON = "Imports inside functions:"
DIRECTIVE = re.compile(
    r"\b(noqa|type:\s*ignore|pyright:\s*ignore|pragma|isort|fmt|pylint)\b(:\s*[\w,\[\]-]+(\s*,\s*[\w\[\]-]+)*)?", re.I
)
WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
REASON_WORDS = 3

# Every import of a private vlft module (a floor above the face) by a plugin, with the reason it has one
# today; a new one fails. None is left: GRPO reads the layouts and the label id from ``vlft`` and moves its
# batches through ``vlft.Passes``.
PRIVATE_IMPORTS: dict[tuple[str, str], str] = {}


def plugin_packages(root: Path = ROOT) -> dict[str, Path]:
    """{package: folder} of every plugin in the checkout: the built-in ones (``plugins/``, as
    ``vlft.plugins.builtin_packages`` maps them) and each package of an example plugin
    (``examples/*/<package>/``)."""
    from vlft.plugins import builtin_packages

    mapped = builtin_packages(root)
    examples = {p.parent.name: p.parent for p in sorted((root / "examples").glob("*/*/__init__.py"))}
    return {**mapped, **examples}


def module_name(path: Path, root: Path = VLFT, package: str | None = None) -> str:
    """The dotted name of ``path`` inside the package at ``root`` (named ``package``, else the folder's name)."""
    parts = (package or root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> str:
    if module in ENTRY:
        return "entry"
    if module == "vlft":
        return "surface"
    parts = module.split(".")
    if parts[0] != "vlft":
        return "plugins"
    if len(parts) > 1 and parts[1] in FLOORS and (VLFT / parts[1]).is_dir():
        return parts[1]
    return "face"  # vlft/*.py: vlft/plugins.py (the built-in list) is face, not the plugins above it


def has_reason(comment: str) -> bool:
    """A comment (or a docstring's reason paragraph) that says why: three words or more besides tool
    directives (``# noqa: F401 - torch's writer needs it`` has a reason, ``# noqa: E402`` has none)."""
    text = DIRECTIVE.sub(" ", comment.lstrip("#").split(MODULE_REASON, 1)[-1])
    return len(WORD.findall(text)) >= REASON_WORDS


def _comments(lines: list[str], first: int, last: int) -> list[str]:
    """The comments on lines ``first``..``last`` (1-based) and the comment lines directly above ``first``."""
    found = [line.split("#", 1)[1] for line in lines[first - 1 : last] if "#" in line]
    above = first - 2
    while above >= 0 and lines[above].strip().startswith("#"):
        found.append(lines[above].strip())
        above -= 1
    return found


def _module_reason(doc: str) -> bool:
    """The docstring's ``Imports inside functions: <why>`` paragraph, with a reason in it."""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    return any(p.startswith(MODULE_REASON) and has_reason(p) for p in paragraphs)


class Import:
    def __init__(self, source: str, target: str, line: int, local: bool, reasoned: bool, typing_only: bool):
        self.source, self.target, self.line, self.local, self.reasoned = source, target, line, local, reasoned
        self.typing_only = typing_only  # under `if TYPE_CHECKING:`: read by type checkers, never run

    def __repr__(self):
        return f"{self.source}:{self.line} -> {self.target}"


def read_imports(root: Path = VLFT, packages: dict[str, Path] | None = None) -> tuple[dict[str, Path], list[Import]]:
    """Every module of the package at ``root`` (and of ``packages``, {name: folder}) and every import in them."""
    modules = {}
    for package, folder in {root.name: root, **(packages or {})}.items():
        modules.update({module_name(p, folder, package): p for p in folder.rglob("*.py")})
    found = []
    for name, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.splitlines()
        module_reason = _module_reason(ast.get_docstring(tree) or "")
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
            reasoned = module_reason or any(has_reason(c) for c in _comments(lines, node.lineno, node.end_lineno))
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
    """Imports of a higher floor; and, inside a plugin package, a part importing the package's hook module."""
    edges = vlft_edges(imports, modules)
    return [
        i
        for i in edges
        if FLOORS.index(floor(i.target)) > FLOORS.index(floor(i.source))
        or (floor(i.source) == "plugins" and i.target == i.source.split(".")[0])
    ]


def across_plugins(imports: list[Import], modules: dict) -> list[Import]:
    """Imports of one plugin package by another (each installs, loads and is disabled on its own)."""
    return [
        i
        for i in vlft_edges(imports, modules)
        if floor(i.source) == floor(i.target) == "plugins" and i.source.split(".")[0] != i.target.split(".")[0]
    ]


def private_imports(imports: list[Import], modules: dict) -> dict[tuple[str, str], list[Import]]:
    """{(plugin module, vlft module): imports} of vlft modules above the face, by plugins."""
    found: dict[tuple[str, str], list[Import]] = {}
    for i in vlft_edges(imports, modules):
        if floor(i.source) == "plugins" and i.target.split(".")[0] == "vlft" and i.target not in PUBLIC_MODULES:
            found.setdefault((i.source, i.target), []).append(i)
    return found


def circles(imports: list[Import], modules: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in vlft_edges(imports, modules):
        if i.target != "vlft":  # the package itself: the plugin surface, which imports only the face and data
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
    """vlft and every plugin package, read together (imports between them are edges like any other)."""
    return read_imports(VLFT, plugin_packages())


def test_every_python_file_under_plugins_and_examples_is_read(house):
    modules, _ = house
    read = {p.resolve() for p in modules.values()}
    missed = [
        str(p.relative_to(ROOT))
        for folder in ("plugins", "examples")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p.resolve() not in read
    ]
    assert missed == []
    assert {"vlft_cuda", "vlft_ascend", "vlft_methods", "vlft_models", "vlft_example_plugin"} <= set(modules)


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
    importers = {
        i.source
        for i in vlft_edges(imports, modules)
        if floor(i.target) == "commands" and floor(i.source) != "commands"
    }
    # the commands plugin adds them to the CLI; vlft.testing runs `vlft run` as a user would
    assert importers <= {"vlft.builtin.commands", "vlft.testing"}


def test_only_commands_import_evaluation_and_training_together(house):
    modules, imports = house
    both = {}
    for i in vlft_edges(imports, modules):
        both.setdefault(i.source, set()).add(floor(i.target))
    assert [
        m
        for m, floors in both.items()
        if {"evaluation", "training"} <= floors and floor(m) not in ("commands", "evaluation")
    ] == []


def test_no_import_circles(house):
    modules, imports = house
    assert circles(imports, modules) == []


def test_function_local_imports_only_in_the_face_or_with_a_reason(house):
    modules, imports = house
    unexplained = [
        i for i in imports if i.local and floor(i.source) not in ("face", "surface", "entry") and not i.reasoned
    ]
    assert unexplained == []


def test_the_face_imports_no_torch_at_module_level(house):
    modules, imports = house
    assert [
        i
        for i in imports
        if floor(i.source) in ("face", "surface", "entry")
        and not i.local
        and not i.typing_only
        and i.target.split(".")[0] in ("torch", "transformers", "peft")
    ] == []


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


def test_no_plugin_imports_another_plugin(house):
    modules, imports = house
    assert across_plugins(imports, modules) == []


def test_every_private_vlft_import_of_a_plugin_is_listed_with_its_reason(house):
    """A plugin importing a vlft module outside the face is named here unless ``PRIVATE_IMPORTS`` lists it;
    a listed import no plugin makes any more is named too, so the list is the current state."""
    modules, imports = house
    found = private_imports(imports, modules)
    assert {k: v for k, v in found.items() if k not in PRIVATE_IMPORTS} == {}
    assert sorted(set(PRIVATE_IMPORTS) - set(found)) == []
    assert all("issue 30" in why and has_reason(why.replace("issue 30", "")) for why in PRIVATE_IMPORTS.values())


# The guide's code (every ```python block of docs/ and the READMEs) is plugin code a reader copies: it imports
# only the public modules too. The objective examples below still reach into the core; issue 41 item 2 writes
# them on the objectives' own interface, and this list then empties (a listed import no block makes fails).
DOC_PRIVATE_IMPORTS: dict[tuple[str, str], str] = {}  # (guide, module): why; none left (issue 41)
GUIDES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", *sorted((ROOT / "examples").glob("*/README.md"))]
CODE_IMPORT = re.compile(r"^\s*(?:from\s+(vlft(?:\.\w+)*)\s+import|import\s+(vlft(?:\.\w+)*))", re.M)


def guide_private_imports(paths=GUIDES) -> set[tuple[str, str]]:
    """{(guide, vlft module)} for each import of a vlft module other than ``PUBLIC_MODULES`` in a python block."""
    found = set()
    for path in paths:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            for m in CODE_IMPORT.finditer(block):
                module = m.group(1) or m.group(2)
                if module not in PUBLIC_MODULES:
                    found.add((str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), module))
    return found


def test_the_guides_code_imports_only_vlft_and_vlft_testing(tmp_path):
    found = guide_private_imports()
    assert sorted(found - set(DOC_PRIVATE_IMPORTS)) == []
    assert sorted(set(DOC_PRIVATE_IMPORTS) - found) == []
    # the rule can fail: a guide whose family example imports the contract's module
    planted = tmp_path / "guide.md"
    planted.write_text("```python\nfrom vlft.contracts.family import ModelFamily\nfrom vlft import hookimpl\n```\n")
    assert guide_private_imports([planted]) == {(str(planted), "vlft.contracts.family")}


# -- no hidden process-wide state in the stages ---------------------------------------------------------------------
#
# The stages below the commands take the registry and the model family they work with as arguments: nothing in
# data/, models/ or planning/ reaches for the process-wide registry (vlft.registry.get_registry) or defaults a
# `registry` or `family` parameter to None to fall back on it.


def hidden_state(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "vlft.registry"
            and any(a.name == "get_registry" for a in node.names)
        ):
            found.append(f"{where}:{node.lineno}: imports get_registry")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = a.posonlyargs + a.args
            defaults = dict(zip([p.arg for p in params[len(params) - len(a.defaults) :]], a.defaults))
            defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
            for name in ("registry", "family"):
                if isinstance(defaults.get(name), ast.Constant) and defaults[name].value is None:
                    found.append(f"{where}:{node.lineno}: {node.name}({name}=None)")
    return found


def test_the_stages_take_the_registry_and_the_family_as_arguments():
    found = [
        o
        for folder in ("data", "models", "planning")
        for p in sorted((VLFT / folder).rglob("*.py"))
        for o in hidden_state(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    ]
    assert found == []


def test_the_hidden_state_rule_catches_a_fallback():
    source = (
        "def f(model, family=None, *, registry=None):\n"
        "    from vlft.registry import get_registry\n    return registry or get_registry()\n"
    )
    assert hidden_state(source, "x.py") == [
        "x.py:1: f(registry=None)",
        "x.py:1: f(family=None)",
        "x.py:2: imports get_registry",
    ]


@pytest.mark.parametrize(
    "comment, reason",
    [
        ("#", False),
        ("# noqa: E402", False),
        ("# noqa: E402,F401", False),
        ("# type: ignore[import]", False),
        ("# TODO", False),
        ("# lazy", False),
        ("# noqa: F401 - the stand-in fixtures", True),
        ("# pyright: ignore[reportMissingImports]", False),
        ("# pyright: ignore[reportX]  # the liger extra, opt-in", True),
        ("# only when a MoE plan traces its experts", True),
        ("# optional: PyAV is needed only for video records", True),
    ],
)
def test_a_reason_is_three_words_besides_tool_directives(comment, reason):
    assert has_reason(comment) is reason


def test_a_local_import_with_a_comment_that_gives_no_reason_is_named(tmp_path):
    """The reason rule can fail: a copy of vlft with function-local imports under comments that say nothing."""
    import shutil

    copy = tmp_path / "vlft"
    shutil.copytree(VLFT, copy, ignore=shutil.ignore_patterns("__pycache__", "configs"))
    (copy / "training" / "extra.py").write_text(
        '"""Imports inside functions: yes."""\n\n\n'  # a docstring reason of one word is none
        "def a():\n    import json  # noqa: F401\n\n\n"
        "def b():\n    #\n    import os\n\n\n"
        "def c():\n    # json loads only when a report is written\n    import json\n"
    )
    modules, imports = read_imports(copy)
    unexplained = [
        (i.source, i.target) for i in imports if i.local and floor(i.source) not in ("face", "entry") and not i.reasoned
    ]
    assert unexplained == [("vlft.training.extra", "json"), ("vlft.training.extra", "os")]


def test_the_plugin_rules_catch_a_new_private_import_a_cross_import_and_a_core_import_of_a_plugin(tmp_path):
    """A copy of vlft and two plugins with one of each added: every rule names its import."""
    import shutil

    copies = {}
    for name, folder in {"vlft": VLFT, **plugin_packages()}.items():
        if name in ("vlft", "vlft_cuda", "vlft_methods"):
            copies[name] = tmp_path / name
            shutil.copytree(folder, copies[name], ignore=shutil.ignore_patterns("__pycache__", "configs"))
    kernels = copies["vlft_cuda"] / "kernels.py"
    kernels.write_text(
        kernels.read_text() + "\nfrom vlft.training.step import StepPolicy\n"
        "from vlft.errors import ConfigError\nfrom vlft_methods import lora\nimport vlft_cuda\n"
    )
    plan = copies["vlft"] / "planning" / "plan.py"
    plan.write_text(plan.read_text() + "\nimport vlft_cuda.probing\n")
    modules, imports = read_imports(copies["vlft"], {k: v for k, v in copies.items() if k != "vlft"})
    new = {k for k in private_imports(imports, modules) if k not in PRIVATE_IMPORTS}
    # a module of the face (vlft.errors) is private to plugins too: they import the package
    assert new == {("vlft_cuda.kernels", "vlft.training.step"), ("vlft_cuda.kernels", "vlft.errors")}
    crossing = [(i.source, i.target) for i in across_plugins(imports, modules)]
    assert crossing == [("vlft_cuda.kernels", "vlft_methods.lora")]
    assert sorted((i.source, i.target) for i in upward(imports, modules)) == [
        ("vlft.planning.plan", "vlft_cuda.probing"),
        ("vlft_cuda.kernels", "vlft_cuda"),
    ]
    # vlft_cuda imports vlft_cuda.kernels, which now imports vlft_cuda back
    assert any({"vlft_cuda", "vlft_cuda.kernels"} <= set(c) for c in circles(imports, modules))


# -- the core names no family's input keys ----------------------------------------------------------------------
#
# What a family's model takes besides input_ids, attention_mask, labels and pixel_values (every transformers VLM's
# pixels) is the family's to say (``ImageInputs.batch_inputs``, ``.pixels``, ``VideoInputs.pixels``); the core
# joins and moves them without knowing their names. Read like the family-name rule in test_docs.py: identifiers
# and one-word string constants; docstrings, comments and prose strings may name them. The exemption is the
# family-name rule's: vlft/models/embedded.py builds today's embedded default model byte for byte (issue 30
# item 5 moves it into its family's plugin).

FAMILY_INPUT_KEYS = (
    "image_grid_thw",
    "video_grid_thw",
    "merge_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "second_per_grid_ts",
    "mm_token_type_ids",
    "token_type_ids",
    "pixel_values_videos",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "mm_tokens_per_image",
    "batch_num_images",
    "image_grid_pinpoints",
)
INPUT_KEYS_EXEMPT = {"vlft/models/embedded.py"}
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def input_key_offenders(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    found = []
    for node in ast.walk(tree):
        texts = [
            getattr(node, f) for f in ("id", "attr", "arg", "name", "asname") if isinstance(getattr(node, f, None), str)
        ]
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and not any(c.isspace() for c in node.value)
        ):
            texts.append(node.value)
        for text in texts:
            if any(word in FAMILY_INPUT_KEYS for word in IDENTIFIER.findall(text)) or any(
                key in text for key in FAMILY_INPUT_KEYS if "." in text or "[" in text
            ):
                found.append((getattr(node, "lineno", 0), text))
    return [f"{where}:{line}: {text}" for line, text in sorted(set(found))]


def test_the_core_names_no_family_input_key():
    offenders = [
        o
        for p in sorted(VLFT.rglob("*.py"))
        if str(p.relative_to(ROOT)) not in INPUT_KEYS_EXEMPT
        for o in input_key_offenders(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    ]
    assert not offenders, (
        "a family's input keys named in the core (the family's image inputs say them: "
        "ImageInputs.batch_inputs, .pixels, VideoInputs.pixels):\n" + "\n".join(offenders)
    )


def test_the_input_key_rule_catches_a_key_and_lets_prose_pass():
    assert input_key_offenders('batch["image_grid_thw"] = x\n', "x.py")
    assert input_key_offenders("n = grid.prod() // processor.image_processor.merge_size ** 2\n", "x.py")
    assert input_key_offenders("def f(second_per_grid_ts=None):\n    pass\n", "x.py")
    assert input_key_offenders('keys = {"video": "pixel_values_videos"}\n', "x.py")
    assert not input_key_offenders(
        '"""Qwen reads image_grid_thw."""\nhelp = "joins image_grid_thw along dim 0"\n', "x.py"
    )
    assert not input_key_offenders('x = batch["pixel_values"]\n', "x.py")
