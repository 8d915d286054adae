"""A house rule read from the code with ``ast``: no function in ``vlft/`` or ``plugins/`` takes more than
``MAX_PARAMETERS`` parameters unless a comment says why.

Counted: every parameter a caller can pass (positional-only, positional, keyword-only), ``*args`` and
``**kwargs`` once each; ``self`` and ``cls`` leading a method are not. The reason is a comment ``# params: <why>``
on the ``def`` line or on the line directly above it (a decorator's line, for a click command), at least three
words: a long signature usually means related values that want a dataclass, or a function doing two things.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("vlft", "plugins")
MAX_PARAMETERS = 8
REASON = re.compile(r"#\s*params:\s*(?P<why>.*)$")
WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    args = node.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    if method and positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    return len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)


def has_reason(lines: list[str], def_line: int) -> bool:
    """``# params: <why>`` (three words or more) on the ``def`` line (1-based) or the line above it."""
    for line in lines[max(def_line - 2, 0) : def_line]:
        found = REASON.search(line)
        if found and len(WORD.findall(found["why"])) >= 3:
            return True
    return False


def long_signatures(source: str) -> list[tuple[int, str, int]]:
    """(line, name, parameters) of every function of ``source`` over the limit without a reason."""
    tree, lines = ast.parse(source), source.splitlines()
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = parameter_count(node, id(node) in methods)
        if n > MAX_PARAMETERS and not has_reason(lines, node.lineno):
            found.append((node.lineno, node.name, n))
    return sorted(found)


def test_no_function_takes_more_than_eight_parameters_without_saying_why():
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name}() takes {n}"
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name, n in long_signatures(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, (
        f"functions over {MAX_PARAMETERS} parameters: group related values into a dataclass (or split the "
        f"function), or say why on the def line or the line above (# params: <why>):\n  " + "\n  ".join(offenders)
    )


def test_the_rule_counts_as_it_says():
    source = """
def nine(a, b, c, d, e, f, g, h, i): pass

def eight_and_star(a, b, c, d, e, f, g, *rest, **named): pass

def keyword_only(a, b, c, d, e, f, *, g, h, i): pass

class Owner:
    def method(self, a, b, c, d, e, f, g, h): pass

    @classmethod
    def builder(cls, a, b, c, d, e, f, g, h, i): pass

# params: the caller's nine values, one for one
def explained(a, b, c, d, e, f, g, h, i): pass

def explained_here(a, b, c, d, e, f, g, h, i):  # params: click passes one argument per option
    pass

# params: why
def too_short_a_reason(a, b, c, d, e, f, g, h, i): pass

def self_is_counted_outside_a_class(self, a, b, c, d, e, f, g, h): pass
"""
    assert [(name, n) for _, name, n in long_signatures(source)] == [
        ("nine", 9),
        ("eight_and_star", 9),
        ("keyword_only", 9),
        ("builder", 9),
        ("too_short_a_reason", 9),
        ("self_is_counted_outside_a_class", 9),
    ]
