"""The option index (run_option_index.py) credits an option only to a test whose `vlft run` set it on the command
line or in its --config file: a planted session of tests that name options in a string, a keyword argument or a
folder name fails at its end, naming each option and its test; the runs that set theirs (in the test's process,
in a subprocess, in a fixture another test set up first, in a --config file) are accepted. Each planted run
stops at once (an lr of 0 is refused before anything loads), so the session takes seconds."""

from __future__ import annotations

import os
from pathlib import Path

import run_option_index

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent

PLANTED_INDEX = """
RUN_OPTION_TESTS = {
    "--lr-vision": "test_planted.py::test_names_it_in_a_string",
    "--lr-merger": "test_planted.py::test_names_it_in_a_keyword",
    "--warmup-ratio": "test_planted.py::test_runs_the_cli_with_it_in_a_folder_name",
    "--train-merger": "test_planted.py::test_sets_it_in_a_subprocess",
    "--lr": "test_planted.py::test_uses_a_fixture_that_set_it",
    "--seed": "test_planted.py::test_sets_it_in_this_process",
    "--epochs": "test_planted.py::test_sets_it_in_its_config_file",
    "--steps": "test_planted.py::test_fails",
}
"""

PLANTED_TESTS = '''
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vlft.cli import cli


def refused(*args):
    """`vlft run ARGS --lr 0`: recorded, then refused before anything loads."""
    result = CliRunner().invoke(cli, ["run", *map(str, args), "--lr", "0"])
    assert result.exit_code != 0 and "--lr must be positive" in result.output, result.output
    return result


def test_names_it_in_a_string():
    assert "--lr-vision" in ["--lr-vision", "1e-4"]


def test_names_it_in_a_keyword():
    from vlft.config import build_config

    assert build_config({}, {"lr_merger": 1e-4}).lr_merger == 1e-4


def test_runs_the_cli_with_it_in_a_folder_name(tmp_path):
    refused("--output", tmp_path / "warmup-ratio")


def test_sets_it_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "vlft", "run", "--train-merger", "--lr", "0"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "--lr must be positive" in proc.stderr


@pytest.fixture(scope="module")
def shared_run():
    return refused()


def test_first_to_use_the_fixture(shared_run):
    pass


def test_uses_a_fixture_that_set_it(shared_run):
    pass


def test_sets_it_in_this_process():
    refused("--seed", 3)


def test_sets_it_in_its_config_file(tmp_path):
    (tmp_path / "run.yaml").write_text("epochs: 2")
    refused("--config", tmp_path / "run.yaml")


def test_fails():
    refused("--steps", 2)
    assert False
'''


def planted_session(pytester, monkeypatch, *args):
    """The planted index and tests in a pytest subprocess with this plugin (-p), its outcome and output."""
    pytester.makepyfile(test_run_options=PLANTED_INDEX, test_planted=PLANTED_TESTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return pytester.runpytest_subprocess("-p", "run_option_index", "-p", "no:randomly", "-p", "no:cacheprovider", *args)


def test_the_index_refuses_options_a_test_only_names_and_accepts_those_its_runs_set(pytester, monkeypatch):
    """Under two xdist workers (the records of both, and of the subprocesses they start, reach the check):
    every test passes, and the session fails for the three options no run of their tests set."""
    result = planted_session(pytester, monkeypatch, "-n", "2", "-k", "not test_fails")
    result.assert_outcomes(passed=8)
    assert result.ret == 1
    refused = {line.split(":", 1)[0]: line for line in result.outlines if line.startswith("--")}
    assert sorted(refused) == ["--lr-merger", "--lr-vision", "--warmup-ratio"], result.outlines
    assert refused["--lr-vision"].startswith("--lr-vision: test_planted.py::test_names_it_in_a_string passed")
    assert "test_planted.py::test_runs_the_cli_with_it_in_a_folder_name passed" in refused["--warmup-ratio"]


def test_only_the_named_tests_that_ran_and_passed_are_checked(pytester, monkeypatch):
    """One process, the tests whose runs set their options and one that fails: nothing refused. The failed
    test is not held to its option (its failure fails the session), nor are the tests that did not run."""
    result = planted_session(pytester, monkeypatch, "-k", "subprocess or fixture or this_process or config or fails")
    result.assert_outcomes(passed=5, failed=1)
    assert not any(line.startswith("--") for line in result.outlines), result.outlines


def test_missing_credit_names_the_option_and_its_test():
    index = {"--seed": "test_a.py::test_x", "--lr": "test_a.py::test_y", "--steps": "test_b.py::test_z"}
    credit = {"test_a.py::test_x": {"--seed", "--lr"}, "test_a.py::test_y": {"--seed"}}
    problems = run_option_index.missing_credit(index, {"test_a.py::test_x", "test_a.py::test_y"}, credit)
    assert len(problems) == 1 and problems[0].startswith("--lr: test_a.py::test_y passed")  # test_z did not run


def test_a_node_id_is_keyed_as_the_index_names_tests(tmp_path):
    home = tmp_path / "tests"
    assert (
        run_option_index.index_key("tests/parity/test_x.py::test_y[cpu-fp32]", tmp_path, home)
        == "parity/test_x.py::test_y"
    )
    assert run_option_index.index_key("bench/test_x.py::test_y", tmp_path, home) is None
