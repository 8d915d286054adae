"""The option index's evidence: which ``vlft run`` options the runs of each test set on their command line.

``vlft run`` appends a JSON line naming the options its command line set (click's parameter source: not a
default) and those its ``--config`` file set to the file ``VLFT_OPTION_LOG`` names (``vlft.cli.record_options``). This
plugin (tests/conftest.py loads it) gives each pytest process, the controller or an xdist worker, a file of
its own in one folder of the session. What is appended while a test runs is that test's, whether its run
was in this process (``cli_invoke``, ``CliRunner``) or a subprocess (the ``vlft`` script, torchrun's
workers): they inherit the variable, and the test waits for them. What is appended while a fixture is set up
is the fixture's, and counts for every test that uses it (a module's shared run).

At the end of the session the controller reads ``RUN_OPTION_TESTS`` (test_run_options.py: option -> the test
that asserts its effect) and fails the session for each option whose named test passed here but none of
whose runs set it, naming both. A test that names an option in a string, a keyword argument or a folder
name, or runs without the CLI (``execute``, ``vlft.testing.run``), earns nothing: only a run's input does.
Tests that did not run here (another file, ``-k``) are not checked.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest

LOG_ENV = "VLFT_OPTION_LOG"  # vlft.cli.OPTION_LOG_ENV (not imported: loading this plugin imports no vlft)
INDEX_MODULE = "test_run_options"  # the module holding RUN_OPTION_TESTS, imported from sys.path
FOLDER_KEY = "vlft_option_records"  # the records folder, as xdist hands it to each worker
PARAMETRIZED = re.compile(r"\[.*\]$")  # test_y[cpu]: any parametrization's runs count for test_y


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # the controller, or the only process: the folder is made here, once
        folder, name = Path(tempfile.mkdtemp(prefix="vlft-option-records-")), "main"
        config.pluginmanager.register(Index(folder), "vlft-option-index")
    else:
        folder, name = Path(workerinput[FOLDER_KEY]), workerinput["workerid"]
    config.pluginmanager.register(Recorder(folder, name), "vlft-option-recorder")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist: each worker writes into the controller's folder."""
    index = node.config.pluginmanager.get_plugin("vlft-option-index")
    node.workerinput[FOLDER_KEY] = str(index.folder)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Recorder:
    """In each pytest process: the options each test's runs set, through the file its runs append to."""

    def __init__(self, folder: Path, name: str):
        self.log, self.credit = folder / f"runs-{name}.jsonl", folder / f"credit-{name}.jsonl"
        self.offset = 0
        self.owners: list = []  # the running test, then the fixtures being set up inside it (innermost last)
        self.options: dict = defaultdict(set)  # owner -> options its runs set
        # set before any test module is imported: modules that copy os.environ at import pass it on too
        self.saved = os.environ.get(LOG_ENV)
        os.environ[LOG_ENV] = str(self.log)

    def pytest_unconfigure(self):
        if self.saved is None:
            os.environ.pop(LOG_ENV, None)
        else:
            os.environ[LOG_ENV] = self.saved

    def _take(self) -> None:
        """The runs recorded since the last look, credited to whoever runs now (before the first test: no one)."""
        if not self.log.exists():
            return
        with self.log.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self.offset += len(whole)
        for line in whole.splitlines():
            record = json.loads(line)
            if self.owners and record["command"] == "run":  # set on the command line or in its --config file
                self.options[self.owners[-1]].update(record["options"], record["config_file"])

    @contextmanager
    def _owning(self, owner):
        """The runs recorded inside are ``owner``'s; those before it, whoever ran then."""
        self._take()
        self.owners.append(owner)
        try:
            yield
        finally:
            self._take()
            self.owners.pop()

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef):
        self.options[fixturedef] = set()  # this execution's runs only: a test is given the newest value
        with self._owning(fixturedef):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item):
        try:
            with self._owning(item):
                return (yield)
        finally:
            self._credit(item)

    def _credit(self, item) -> None:
        """The test's own runs and those of every fixture it was given (set up for it or for a test before)."""
        given = self.options.pop(item, set())
        info = getattr(item, "_fixtureinfo", None)  # a python test's fixture closure; other items have none
        for name in item.fixturenames if info else ():
            defs = info.name2fixturedefs.get(name)
            if defs:  # the definition that applies here (an override, not the fixture it overrides)
                given |= self.options.get(defs[-1], set())
        if given:
            with self.credit.open("a") as f:
                f.write(json.dumps({"test": item.nodeid, "options": sorted(given)}) + "\n")


class Index:
    """In the controller: the tests that passed and, at the end, RUN_OPTION_TESTS against the evidence."""

    def __init__(self, folder: Path):
        self.folder, self.passed, self.problems = folder, set(), []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.passed.add(report.nodeid)

    def pytest_sessionfinish(self, session):
        try:
            index = importlib.import_module(INDEX_MODULE)
        except ImportError:  # a session of files that keeps no index
            return
        root, home = session.config.rootpath, Path(index.__file__).resolve().parent
        credit: dict = defaultdict(set)
        for path in self.folder.glob("credit-*.jsonl"):
            for line in read_lines(path):
                credit[index_key(line["test"], root, home)] |= set(line["options"])
        passed = {index_key(nodeid, root, home) for nodeid in self.passed}
        self.problems = missing_credit(index.RUN_OPTION_TESTS, passed, credit)
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.problems:
            terminalreporter.section("option index (tests/run_option_index.py)", red=True)
            for line in self.problems:
                terminalreporter.line(line, red=True)

    def pytest_unconfigure(self):
        shutil.rmtree(self.folder, ignore_errors=True)


def index_key(nodeid: str, root: Path, home: Path) -> str | None:
    """``tests/parity/test_x.py::test_y[cpu]`` as RUN_OPTION_TESTS names it: ``parity/test_x.py::test_y``
    (relative to the index's folder, any parametrization's runs counting for the test); None outside it."""
    path, _, name = nodeid.partition("::")
    try:
        where = (root / path).resolve().relative_to(home).as_posix()
    except ValueError:
        return None
    return f"{where}::{PARAMETRIZED.sub('', name)}"


def missing_credit(index: dict[str, str], passed: set, credit: dict[str, set]) -> list[str]:
    """One line per option of ``index`` whose test passed but whose runs never set it."""
    return [
        f"{option}: {test} passed, but none of its `vlft run`s set {option} (on the command line or in a "
        f"--config file; naming it in a string, a keyword or a folder, or a run through execute(), sets nothing)"
        for option, test in index.items()
        if test in passed and option not in credit.get(test, ())
    ]


def defined_tests(home: Path) -> set[str]:
    """Every test function of the test files under ``home``, as RUN_OPTION_TESTS names them (read, not
    imported): a misspelt name there would never run, so never be checked."""
    found = set()
    for path in home.rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        found |= {
            f"{path.relative_to(home).as_posix()}::{node.name}"
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        }
    return found
