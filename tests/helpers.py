"""Helpers shared by test modules (a plain module: conftest files are not importable by name)."""

from __future__ import annotations


def base_model(model_dir, attn="eager"):
    """The embedded base model in fp32 with one attention implementation for both towers."""
    from vlft.models.loading import load_model
    from vlft.policies import AttentionPolicy, PrecisionPolicy

    return load_model(model_dir, AttentionPolicy(attn, attn), PrecisionPolicy("fp32"))


def vlft_command() -> list[str]:
    """The installed ``vlft`` console script (``python -m vlft`` where it is not beside this Python)."""
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("vlft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vlft"]


def run_flags(values: dict) -> list[str]:
    """``vlft run`` flags for config ``values`` (``adapter`` as repeated ``--adapter-opt KEY=VALUE``)."""
    args = []
    for key, value in values.items():
        if key == "adapter":
            args += [x for k, v in value.items() for x in ("--adapter-opt", f"{k}={v}")]
        else:
            args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def die_at_step(monkeypatch, n: int) -> None:
    """Make the ``n``-th training step of this process raise KeyboardInterrupt (as Ctrl-C during it would);
    ``monkeypatch.undo()`` puts the real step back."""
    import vlft.training.step

    real_step, calls = vlft.training.step.train_step, {"n": 0}

    def dying_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(vlft.training.step, "train_step", dying_step)


def cli_invoke(*args) -> tuple[int, str]:
    """``vlft ARGS`` in this process through click (exit code, output); an exception other than click's exit
    is raised as it is."""
    from click.testing import CliRunner

    from vlft.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output
