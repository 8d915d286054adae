"""Meta-tests: every plugin hook is documented, called by some test and listed in the README; the core names no vendor.

Each check is a function over plain inputs (spec functions, document text, source text) returning the
problems it finds, so the tests at the bottom can feed it a broken input and see it fail.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vlft import hookspecs

ROOT = Path(__file__).resolve().parent.parent
HOOKS_DOC = ROOT / "docs" / "plugin-hooks.md"
README = ROOT / "README.md"
CORE = ROOT / "vlft"
TEST_DIRS = (ROOT / "tests", ROOT / "bench")
VENDORS = {"cuda", "npu", "ascend", "nvidia", "hccl", "nccl"}


def spec_functions(module=hookspecs) -> dict:
    """The hook specs of ``module``: functions pluggy marked ``vlft_spec``, by name."""
    return {name: f for name, f in inspect.getmembers(module, inspect.isfunction) if hasattr(f, "vlft_spec")}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# -- docs/plugin-hooks.md ---------------------------------------------------------------------------------


@dataclass
class Section:
    """What one ``## vlft_name(a, b)`` section of the hooks page says."""

    heading_params: list[str]
    params: dict[str, str] = field(default_factory=dict)  # from "- `name: type`" lines
    returns: str | None = None  # from "- **Returns**: `type`"
    answers: str | None = None  # the "- **Answers**: ..." line


HEADING = re.compile(r"^## (vlft_\w+)\(([^)]*)\)\s*$")
PARAM = re.compile(r"^\s*- `(\w+): ([^`]+)`")
RETURNS = re.compile(r"^\s*- \*\*Returns\*\*: `([^`]+)`")
ANSWERS = re.compile(r"^\s*- \*\*Answers\*\*: (.+)$")


def doc_sections(text: str) -> dict[str, Section]:
    sections: dict[str, Section] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            m = HEADING.match(line)
            current = None
            if m:
                current = sections[m.group(1)] = Section([p.strip() for p in m.group(2).split(",") if p.strip()])
            continue
        if current is None:
            continue
        if m := RETURNS.match(line):
            current.returns = m.group(1)
        elif m := ANSWERS.match(line):
            current.answers = m.group(1)
        elif m := PARAM.match(line):
            current.params[m.group(1)] = m.group(2)
    return sections


def doc_problems(specs: dict, text: str, where: str = "docs/plugin-hooks.md") -> list[str]:
    """Every spec has a section with its parameters (names, order, types), return type and call mode."""
    sections = doc_sections(text)
    problems = []
    for name, spec in sorted(specs.items()):
        sig = inspect.signature(spec)
        params = list(sig.parameters)
        if name not in sections:
            problems.append(
                f"{where}: no section '## {name}({', '.join(params)})' for the hook {name} (vlft/hookspecs.py)"
            )
            continue
        s = sections[name]
        if s.heading_params != params:
            problems.append(
                f"{where}: the heading of {name} lists ({', '.join(s.heading_params)}); "
                f"the spec has ({', '.join(params)})"
            )
        for p, parameter in sig.parameters.items():
            if s.params.get(p) != parameter.annotation:
                problems.append(
                    f"{where}: {name} should document '- `{p}: {parameter.annotation}`' (found {s.params.get(p)!r})"
                )
        for extra in sorted(set(s.params) - set(params)):
            problems.append(f"{where}: {name} documents a parameter '{extra}' the spec does not have")
        if s.returns != sig.return_annotation:
            problems.append(
                f"{where}: {name} should say '- **Returns**: `{sig.return_annotation}`' (found {s.returns!r})"
            )
        first = spec.vlft_spec.get("firstresult", False)
        expected = "first answer wins" if first else "every plugin is called"
        if not s.answers or not s.answers.startswith(expected):
            problems.append(
                f"{where}: {name} is {'firstresult' if first else 'not firstresult'}: its "
                f"'- **Answers**:' line should start with '{expected}' (found {s.answers!r})"
            )
    for name in sorted(set(sections) - set(specs)):
        problems.append(f"{where}: documents {name}, which vlft/hookspecs.py does not define")
    return problems


def test_every_hook_is_documented_with_the_specs_parameters():
    problems = doc_problems(spec_functions(), HOOKS_DOC.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


# -- every hook is called by some test ---------------------------------------------------------------------


def sources_of_tests() -> dict[str, str]:
    """The text of every test and benchmark module except this one (which names hooks only as data)."""
    here = Path(__file__).resolve()
    return {
        rel(p): p.read_text(encoding="utf-8") for d in TEST_DIRS for p in sorted(d.rglob("*.py")) if p.resolve() != here
    }


# the registry's way of calling a hook by name: registry.first("vlft_x", ...)
CALL_BY_NAME = {"first"}


def hook_calls(source: str) -> set[str]:
    """The names called in ``source``: ``x.hook.NAME(...)``, ``plugin.NAME(...)``, ``NAME(...)`` and
    ``registry.first("NAME", ...)``. A definition, an import, a string in a message or a module path
    (``vlft_methods.lora``) is not a call."""
    called = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name is None:
            continue
        called.add(name)
        if (
            name in CALL_BY_NAME
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            called.add(node.args[0].value)
    return called


def uncalled_hooks(names, sources: dict[str, str]) -> list[str]:
    """Hooks that no source calls (see ``hook_calls``)."""
    called = set().union(*(hook_calls(text) for text in sources.values()))
    return [f"no test or benchmark under tests/ or bench/ calls {name}" for name in sorted(names) if name not in called]


def test_every_hook_is_called_in_a_test():
    problems = uncalled_hooks(spec_functions(), sources_of_tests())
    assert not problems, "\n".join(problems)


# -- the README lists every hook ----------------------------------------------------------------------------


def readme_problems(names, text: str) -> list[str]:
    """The README's "## Plugins" section names, in backticks, exactly the hooks of the specs."""
    m = re.search(r"^## Plugins\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not m:
        return ["README.md has no '## Plugins' section"]
    listed = set(re.findall(r"`(vlft_\w+)`", m.group(1)))
    problems = [f"README.md, section Plugins: does not list `{n}`" for n in sorted(set(names) - listed)]
    problems += [
        f"README.md, section Plugins: lists `{n}`, which vlft/hookspecs.py does not define"
        for n in sorted(listed - set(names))
    ]
    return problems


def test_the_readme_lists_every_hook():
    problems = readme_problems(spec_functions(), README.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


# -- the README fits on a few screens, and every relative link of the docs resolves -------------------------

README_MAX_LINES = 300
DOCS = ROOT / "docs"


def readme_length_problems(text: str, limit: int = README_MAX_LINES) -> list[str]:
    """The README stays an overview: under ``limit`` lines, the detail in the guides under docs/."""
    lines = len(text.splitlines())
    return (
        [f"README.md has {lines} lines; keep it under {limit} (move the detail to a guide in docs/)"]
        if lines >= limit
        else []
    )


def test_the_readme_fits_on_a_few_screens():
    problems = readme_length_problems(README.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+).+?\1")
HEADING_LINE = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose_lines(text: str, code_spans: bool = False):
    """(line number, line) outside fenced code blocks, with inline code spans taken out unless ``code_spans``."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None:
            yield number, line if code_spans else CODE_SPAN.sub("", line)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors, seen = set(), {}
    for _, line in prose_lines(text, code_spans=True):
        if m := HEADING_LINE.match(line):
            title = INLINE_LINK.sub(lambda link: link.group(0)[1 : link.group(0).index("]")], m.group(1))
            title = title.replace("`", "")
            slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def link_problems(text: str, path: Path) -> list[str]:
    """Every relative link of the markdown file ``path`` (its text: ``text``) names a file or folder that
    exists, and a heading of the page where it names one (``page.md#heading``, ``#heading``)."""
    problems = []
    for number, line in prose_lines(text):
        targets = INLINE_LINK.findall(line) + ([m.group(1)] if (m := REFERENCE_LINK.match(line)) else [])
        for target in targets:
            if not target or SCHEME.match(target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{rel(path)}:{number}"
            if not linked.exists():
                problems.append(f"{where}: the link ({target}) names {rel(linked)}, which does not exist")
            elif (
                anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text(encoding="utf-8"))
            ):
                problems.append(f"{where}: the link ({target}) names a heading {rel(linked)} does not have")
    return problems


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_every_relative_link_in_the_readme_and_the_guides_resolves():
    problems = [p for path in markdown_files() for p in link_problems(path.read_text(encoding="utf-8"), path)]
    assert not problems, "\n".join(problems)


# -- docs/options.md: the flags and defaults of `vlft run` ----------------------------------------------------

OPTIONS_DOC = DOCS / "options.md"
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
NO_DEFAULT = object()


def run_flags() -> dict[str, object]:
    """Every flag of `vlft run` (its own and the installed objectives'), with its default where a RunConfig
    field holds it (NO_DEFAULT otherwise: an objective's option has one default per objective)."""
    import dataclasses

    import click

    from vlft.builtin.commands import run
    from vlft.config import user_fields

    defaults = {
        f.metadata.get("cli", "--" + f.name.replace("_", "-")): f.default
        for f in user_fields()
        if f.default is not dataclasses.MISSING
    }
    return {
        opt: defaults.get(opt, NO_DEFAULT)
        for param in run.get_params(click.Context(run))
        for opt in [*param.opts, *param.secondary_opts]
        if opt.startswith("--")
    }


def options_problems(text: str, flags: dict[str, object], where: str = "docs/options.md") -> list[str]:
    """Each row of the options table names flags `vlft run` has. A default cell that writes a value in backticks
    gives one value per flag of its row (in order, comma-separated), and each value in backticks is that
    flag's default (a flag in backticks, `--lr`, says the default is that flag's value)."""
    problems = []
    for line in text.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        named = FLAG.findall(cells[0])
        problems += [
            f"{where}: the row of {cells[0]} names {flag}, which `vlft run` does not have"
            for flag in named
            if flag not in flags
        ]
        values = [v.strip() for v in cells[1].split(", ")]
        if "`" not in cells[1]:
            continue
        if len(values) != len(named):
            problems.append(
                f"{where}: the row of {cells[0]} gives {len(values)} default(s) for "
                f"{len(named)} flag(s); give one per flag, in order"
            )
            continue
        for flag, value in zip(named, values):
            if (
                re.fullmatch(r"`[^`-][^`]*`", value)
                and flags.get(flag, NO_DEFAULT) is not NO_DEFAULT
                and value.strip("`") != str(flags[flag])
            ):
                problems.append(f"{where}: says {flag} defaults to {value}; `vlft run` defaults it to {flags[flag]!r}")
    return problems


def test_the_options_guide_names_the_flags_and_defaults_of_vlft_run():
    text = OPTIONS_DOC.read_text(encoding="utf-8")
    assert text.count("| `--") >= 20  # the table is there and read
    problems = options_problems(text, run_flags())
    assert not problems, "\n".join(problems)


# -- the core names no vendor -------------------------------------------------------------------------------
#
# The rule: split every identifier (variable, attribute, argument, function, class, import) into words
# at underscores, digits, punctuation and case changes (torch_npu -> torch npu, HCCL_EXEC_TIMEOUT ->
# hccl exec timeout, isCuda -> is cuda), and every string constant that has no whitespace in it the
# same way (such a string is a value the code acts on: a device type, module or variable name, a key).
# A word equal to a vendor name, or its plural, is an offence. Strings with whitespace are prose
# (messages, help), and docstrings and comments are prose too: all allowed. The tree (not the token
# stream) is read so that names inside f-strings are seen and docstrings are known exactly.

WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


def vendor_words(text: str) -> list[str]:
    words = [w.lower() for w in WORDS.findall(text)]
    return [w for w in words if w in VENDORS or (w.endswith("s") and w[:-1] in VENDORS)]


def docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                ids.add(id(first.value))
    return ids


IDENTIFIER_FIELDS = ("id", "attr", "arg", "name", "asname", "module")


def vendor_offenders(source: str, where: str) -> list[str]:
    """``where:line: text`` for each identifier or one-word string in ``source`` that names a vendor."""
    tree = ast.parse(source)
    docstrings = docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        texts = [getattr(node, f) for f in IDENTIFIER_FIELDS if isinstance(getattr(node, f, None), str)]
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and not any(c.isspace() for c in node.value)
        ):
            texts.append(repr(node.value))
        for text in texts:
            if vendor_words(text):
                found.append((getattr(node, "lineno", 0), text))
    return [f"{where}:{line}: {text}" for line, text in sorted(set(found))]


def test_the_core_names_no_vendor():
    offenders = [o for p in sorted(CORE.rglob("*.py")) for o in vendor_offenders(p.read_text(encoding="utf-8"), rel(p))]
    assert not offenders, (
        "vendor names in the core (move the code into the backend plugin that owns it):\n" + "\n".join(offenders)
    )


# -- each check above can fail --------------------------------------------------------------------------------


@hookspecs.hookspec(firstresult=True)
def vlft_not_yet_documented(backend: str, budget: int) -> str | None:
    """A spec as a new hook would arrive: no docs, no test, not in the README."""


def with_new_hook() -> dict:
    return {**spec_functions(), "vlft_not_yet_documented": vlft_not_yet_documented}


def test_a_new_hook_without_docs_is_reported():
    problems = doc_problems(with_new_hook(), HOOKS_DOC.read_text(encoding="utf-8"))
    assert problems == [
        "docs/plugin-hooks.md: no section '## vlft_not_yet_documented(backend, budget)' for the "
        "hook vlft_not_yet_documented (vlft/hookspecs.py)"
    ]


def test_a_section_that_drifts_from_its_spec_is_reported():
    text = HOOKS_DOC.read_text(encoding="utf-8")
    heading = "## vlft_seed(backend, seed, deterministic)"
    assert heading in text and "- `seed: int`" in text and "- **Returns**: `ProbeResult | None`" in text
    drifted = (
        text.replace(heading, "## vlft_seed(backend, seed)")
        .replace("- `seed: int`", "- `seed: str`")
        .replace("- **Returns**: `ProbeResult | None`", "- **Returns**: `ProbeResult`")
    )
    problems = doc_problems(spec_functions(), drifted)
    assert any(
        "heading of vlft_seed lists (backend, seed); the spec has (backend, seed, deterministic)" in p for p in problems
    ), problems
    assert any("vlft_seed should document '- `seed: int`' (found 'str')" in p for p in problems), problems
    assert any("vlft_probe_backend should say '- **Returns**: `ProbeResult | None`'" in p for p in problems), problems


def test_a_wrong_call_mode_and_a_stale_section_are_reported():
    text = HOOKS_DOC.read_text(encoding="utf-8")
    stale = text + "\n## vlft_gone(backend)\n\n- **Answers**: every plugin is called\n"
    first = spec_functions()["vlft_probe_backend"]
    every = spec_functions()["vlft_seed"]
    # swap the call modes: each section now contradicts its spec
    problems = doc_problems({"vlft_probe_backend": every, "vlft_seed": first}, stale)
    assert any("documents vlft_gone, which vlft/hookspecs.py does not define" in p for p in problems), problems
    assert any("vlft_seed is firstresult" in p for p in problems), problems
    assert any("vlft_probe_backend is not firstresult" in p for p in problems), problems


def test_a_hook_no_test_calls_is_reported():
    assert uncalled_hooks(["vlft_not_yet_documented"], sources_of_tests()) == [
        "no test or benchmark under tests/ or bench/ calls vlft_not_yet_documented"
    ]
    # a plugin that only defines the hook is not a test of it, nor is a name in a module path, an import, a
    # test's name or a message; a call through the hook relay, the plugin or registry.first is
    not_calls = [
        "def vlft_x(backend):\n    pass\n",
        "from vlft_x.lora import f\nf()\n",
        "import vlft_x\n",
        "def test_vlft_x_works():\n    assert 'vlft_x' in str(vlft_x)\n",
        "hooks = ['vlft_x']\n",
        "registry.other('vlft_x')\n",
    ]
    for source in not_calls:
        assert uncalled_hooks(["vlft_x"], {"t.py": source}), source
    for source in [
        "pm.hook.vlft_x(backend='cpu')\n",
        "plugin.vlft_x(backend='cpu')\n",
        "vlft_x()\n",
        "registry.first('vlft_x', backend='cpu')\n",
    ]:
        assert not uncalled_hooks(["vlft_x"], {"t.py": source}), source


def test_a_hook_missing_from_the_readme_is_reported():
    readme = README.read_text(encoding="utf-8")
    assert readme_problems(with_new_hook(), readme) == [
        "README.md, section Plugins: does not list `vlft_not_yet_documented`"
    ]
    assert "`vlft_seed`" in readme
    assert readme_problems(spec_functions(), readme.replace("`vlft_seed`", "`vlft_sed`")) == [
        "README.md, section Plugins: does not list `vlft_seed`",
        "README.md, section Plugins: lists `vlft_sed`, which vlft/hookspecs.py does not define",
    ]


def test_a_readme_grown_past_a_few_screens_is_reported():
    assert readme_length_problems("line\n" * 299) == []
    assert readme_length_problems("line\n" * 300) == [
        "README.md has 300 lines; keep it under 300 (move the detail to a guide in docs/)"
    ]


def test_a_dead_link_or_a_missing_heading_is_reported():
    readme = README.read_text(encoding="utf-8")
    assert link_problems(readme, README) == []
    broken = readme + (
        "\nSee [the guide](docs/no-such-guide.md), [packing](docs/packing.md#no-such-heading),"
        " [this page](#nowhere) and [a folder](examples/no-such-plugin).\n"
    )
    where = f"README.md:{len(broken.splitlines())}"
    assert link_problems(broken, README) == [
        f"{where}: the link (docs/no-such-guide.md) names docs/no-such-guide.md, which does not exist",
        f"{where}: the link (docs/packing.md#no-such-heading) names a heading docs/packing.md does not have",
        f"{where}: the link (#nowhere) names a heading README.md does not have",
        f"{where}: the link (examples/no-such-plugin) names examples/no-such-plugin, which does not exist",
    ]
    # links in code, to other sites and to a heading that exists are fine
    fine = (
        "`[a](gone.md)`\n```\n[b](gone.md)\n```\n[c](https://example.org/x.md) [d](mailto:a@b.c)\n"
        "[e](docs/packing.md#how-it-works) [f](#plugins) [g]: docs/data.md\n"
    )
    assert link_problems(readme + fine, README) == []
    assert link_problems("[h]: docs/gone.md\n", README) == [
        "README.md:1: the link (docs/gone.md) names docs/gone.md, which does not exist"
    ]


def test_the_options_rule_catches_a_renamed_flag_and_a_wrong_default():
    text = OPTIONS_DOC.read_text(encoding="utf-8")
    assert "| `--shard` | `none` |" in text and "| `--group-by-length` |" in text
    drifted = text.replace("| `--shard` | `none` |", "| `--shard` | `fsdp` |").replace(
        "| `--group-by-length` |", "| `--group-by-len` |"
    )
    assert options_problems(drifted, run_flags()) == [
        "docs/options.md: the row of `--group-by-len` names --group-by-len, which `vlft run` does not have",
        "docs/options.md: says --shard defaults to `fsdp`; `vlft run` defaults it to 'none'",
    ]
    short = text.replace(
        "| `--targets`, `--vision-last-n` | `both`, `6` |", "| `--targets`, `--vision-last-n` | `both` |"
    )
    assert options_problems(short, run_flags()) == [
        "docs/options.md: the row of `--targets`, `--vision-last-n` gives 1 default(s) for 2 flag(s); give one "
        "per flag, in order"
    ]


VENDOR_SAMPLE = '''"""Module docstring: works on CUDA and Ascend alike."""
import torch_npu
from torch import cuda as accel
# a comment about nccl is fine


def pick(device, input_ids, cudnn_benchmark):
    """cuda"""
    if torch.cuda.is_available():
        return "cuda:0"
    os.environ["HCCL_EXEC_TIMEOUT"] = "1800"
    print(f"{torch.npu.device_count()} devices; install the NVIDIA driver first")
    return device.type == "npus", isAscend(), "gloo"
'''


@pytest.mark.parametrize(
    "line, text",
    [
        (2, "torch_npu"),
        (3, "cuda"),
        (9, "cuda"),
        (10, "'cuda:0'"),
        (11, "'HCCL_EXEC_TIMEOUT'"),
        (12, "npu"),
        (13, "'npus'"),
        (13, "isAscend"),
    ],
)
def test_vendor_names_in_code_are_reported(line, text):
    assert f"sample.py:{line}: {text}" in vendor_offenders(VENDOR_SAMPLE, "sample.py")


def test_prose_comments_and_lookalike_words_are_not_reported():
    # docstrings (lines 1, 8), the comment (4), the message (12), input_ids and cudnn (7) and "gloo" (13) pass
    reported = {int(o.split(":")[1]) for o in vendor_offenders(VENDOR_SAMPLE, "sample.py")}
    assert reported == {2, 3, 9, 10, 11, 12, 13}
    assert not [o for o in vendor_offenders(VENDOR_SAMPLE, "sample.py") if o.endswith(("input_ids", "cudnn_benchmark"))]


# -- the core names no model family ---------------------------------------------------------------------------
#
# The same reading as the vendor rule (identifiers and one-word strings; prose, docstrings and comments
# allowed): no family name and none of one family's own module or token names. What a family is lives in
# its plugin (plugins/models, answering vlft_model_families), the embedded default's recipe too (the default
# family's tiny model, named by vlft_default_model_family). One module is exempt, on purpose:
# vlft/data/formats.py reads dataset files written for other tools, whose inline placeholder tokens it
# turns into vlft's <image>/<video>: a data-format fact, not how any model runs.

MODEL_FAMILY_WORDS = {"qwen", "gemma", "llava", "idefics", "internvl", "smolvlm", "visual", "deepstack"}
MODEL_FAMILY_STRINGS = ("smart_resize", "image_pad", "video_pad", "im_end", "patch_embed")
FAMILY_EXEMPT = {"vlft/data/formats.py"}


def family_offenders(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    docstrings = docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        texts = [getattr(node, f) for f in IDENTIFIER_FIELDS if isinstance(getattr(node, f, None), str)]
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and not any(c.isspace() for c in node.value)
        ):
            texts.append(repr(node.value))
        for text in texts:
            words = [w.lower() for w in WORDS.findall(text)]
            if any(w in MODEL_FAMILY_WORDS for w in words) or any(s in text.lower() for s in MODEL_FAMILY_STRINGS):
                found.append((getattr(node, "lineno", 0), text))
    return [f"{where}:{line}: {text}" for line, text in sorted(set(found))]


def test_the_core_names_no_model_family():
    offenders = [
        o
        for p in sorted(CORE.rglob("*.py"))
        if rel(p) not in FAMILY_EXEMPT
        for o in family_offenders(p.read_text(encoding="utf-8"), rel(p))
    ]
    assert not offenders, (
        "model-family names in the core (move the knowledge into the family plugin, "
        "plugins/models, and reach it through the ModelFamily of the plan):\n" + "\n".join(offenders)
    )


def test_the_model_family_rule_catches_a_family_name():
    assert family_offenders("from transformers import Qwen2VLImageProcessor\nx = m.visual.blocks\n", "x.py")
    assert family_offenders("from t.qwen2_vl.image_processing_qwen2_vl import smart_resize\n", "x.py")
    assert not family_offenders('"""Qwen2.5-VL in a docstring is prose."""\nmsg = "a Qwen model"\n', "x.py")


# -- docs/writing-plugins.md: testing a family with vlft.testing.check_family -----------------------------------

PLUGINS_DOC = ROOT / "docs" / "writing-plugins.md"
CHECK_FAMILY_HEADING = "### Testing a family: `vlft.testing.check_family`"


def check_family_doc_problems(text: str, where: str = "docs/writing-plugins.md") -> list[str]:
    """The guide's check_family section: its table names every check vlft.testing runs (and no other), and its
    code block compiles, imports only what vlft.testing offers, and calls check_family as its signature allows,
    skipping only checks that exist."""
    from vlft import testing

    if CHECK_FAMILY_HEADING not in text:
        return [f"{where}: no section '{CHECK_FAMILY_HEADING}'"]
    section = text.split(CHECK_FAMILY_HEADING, 1)[1].split("\n## ", 1)[0]
    problems = []
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    if listed != list(testing.FAMILY_CHECKS):
        problems.append(
            f"{where}: the check table lists {listed}; vlft.testing.FAMILY_CHECKS has {list(testing.FAMILY_CHECKS)}"
        )
    block = re.search(r"```python\n(.*?)```", section, re.S)
    if block is None:
        return problems + [f"{where}: the check_family section has no python code block"]
    try:
        tree = ast.parse(block.group(1))
    except SyntaxError as e:
        return problems + [f"{where}: the check_family example does not compile: {e}"]
    signature = inspect.signature(testing.check_family)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "vlft.testing":
            problems += [
                f"{where}: imports {a.name}, which vlft.testing does not export"
                for a in node.names
                if a.name not in testing.__all__
            ]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_family":
            try:
                signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
            except TypeError as e:
                problems.append(f"{where}: check_family called as the signature does not allow: {e}")
            skip = next((k.value for k in node.keywords if k.arg == "skip"), None)
            if isinstance(skip, ast.Dict):
                problems += [
                    f"{where}: skips '{k.value}', which is no check"
                    for k in skip.keys
                    if isinstance(k, ast.Constant) and k.value not in testing.FAMILY_CHECKS
                ]
    if "check_family(" not in block.group(1):
        problems.append(f"{where}: the check_family example never calls check_family")
    return problems


def test_the_guide_shows_check_family_as_vlft_testing_has_it():
    assert check_family_doc_problems(PLUGINS_DOC.read_text(encoding="utf-8")) == []


def test_a_check_family_section_that_drifts_is_reported():
    text = PLUGINS_DOC.read_text(encoding="utf-8")
    renamed = text.replace("| `packing` |", "| `pack` |")
    assert any("the check table lists" in p for p in check_family_doc_problems(renamed))
    drifted = text.replace('skip={"packing":', 'skips={"packing":')
    assert any("signature does not allow" in p for p in check_family_doc_problems(drifted))
    unknown = text.replace('skip={"packing":', 'skip={"pack":')
    assert any("which is no check" in p for p in check_family_doc_problems(unknown))
    assert any(
        "does not export" in p
        for p in check_family_doc_problems(
            text.replace("from vlft.testing import check_family,", "from vlft.testing import check_families,")
        )
    )
