"""The ``vlft`` command line (click)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import click
from click.core import ParameterSource

from vlft.config import parse_adapter_options, user_fields
from vlft.errors import VlftError
from vlft.registry import get_registry
from vlft.version import __version__


def user_errors(fn):
    """Print a VlftError as a one-paragraph message and exit 1, instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except VlftError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def config_options(fn):
    """One click option per RunConfig field, all defaulting to None so the config file can fill them."""
    for f in reversed(user_fields()):
        flag = f.metadata.get("cli", "--" + f.name.replace("_", "-"))
        help_text = f.metadata["help"]
        default = f.default if f.default is not dataclasses.MISSING else None
        if default not in (None, False):
            help_text += f"  [default: {default}]"
        if f.metadata.get("flag"):
            fn = click.option(flag, f.name, is_flag=True, default=None, help=help_text)(fn)
        elif f.name == "adapter":
            fn = click.option(flag, f.name, multiple=True, metavar="KEY=VALUE", help=help_text)(fn)
        elif f.metadata.get("multiple"):
            fn = click.option(flag, f.name, multiple=True, metavar=f.metadata.get("metavar"), help=help_text)(fn)
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0].split("|")[0].strip(), str)
            choices = f.metadata.get("choices")
            fn = click.option(
                flag, f.name, type=click.Choice(choices) if choices else kind, default=None, help=help_text
            )(fn)
    return fn


OBJECTIVE_PARAM = "objective_option__"  # the click name of an objective option's flag: this prefix + its name


def objective_flags(registry, taken: set[str]) -> list[click.Option]:
    """One click option per option the installed objectives declare (``Registry.objective_options``), each
    defaulting to None so the config file can fill it and the objective's own default applies otherwise; a
    flag several objectives declare is one flag (``--beta``), its help one line per objective. A flag that
    clashes with one of ``taken`` (vlft run's own), or is declared with two types, is the plugin's error."""
    params = []
    for name, declared in registry.objective_options().items():
        spec, owners = declared[0][1], [o for o, _ in declared]
        if spec.flag in taken:
            raise VlftError(
                f"the {', '.join(owners)} objective declares the option {spec.flag}, which vlft run has "
                f"itself; its plugin must name it otherwise"
            )
        kinds = {s.type for _, s in declared}
        if len(kinds) > 1:
            raise VlftError(
                f"objectives {', '.join(owners)} declare {spec.flag} with different types "
                f"({', '.join(sorted(getattr(k, '__name__', str(k)) for k in kinds))}); one flag takes "
                f"one type"
            )
        help_text = " ".join(
            f"{o}: {s.help}" + (f" [default: {s.default}]" if s.default not in (None, []) else "") for o, s in declared
        )
        choices = {s.choices for _, s in declared}
        if spec.type is list:
            params.append(
                click.Option(
                    [spec.flag, OBJECTIVE_PARAM + name], multiple=True, metavar=spec.metavar or None, help=help_text
                )
            )
            continue
        kind = (
            click.Choice(spec.choices)
            if len(choices) == 1 and spec.choices
            else {int: click.INT, float: click.FLOAT, bool: click.BOOL}.get(spec.type, click.STRING)
        )
        params.append(
            click.Option(
                [spec.flag, OBJECTIVE_PARAM + name],
                type=kind,
                default=None,
                metavar=spec.metavar or None,
                help=help_text,
            )
        )
    return params


class RunCommand(click.Command):
    """A command taking the RunConfig flags and, read from the installed objectives when it parses or shows
    its help, each objective's declared options (``objective_flags``)."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        taken = {opt for p in params for opt in [*p.opts, *p.secondary_opts]}
        return [*params, *objective_flags(get_registry(), taken)]


def given_flags(ctx: click.Context, params: dict) -> dict:
    out = {}
    objective = {}
    for name, value in params.items():
        if (
            name.startswith(OBJECTIVE_PARAM)
            and value not in (None, ())
            and ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
        ):
            objective[name[len(OBJECTIVE_PARAM) :]] = list(value) if isinstance(value, tuple) else value
    if objective:
        out["objective_options"] = objective
    for f in user_fields():
        if ctx.get_parameter_source(f.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            value = params[f.name]
            if f.metadata.get("multiple"):
                value = list(value)
                if not value:  # click reports an unused multiple option as given
                    continue
            out[f.name] = parse_adapter_options(value) if f.name == "adapter" else value
    return out


OPTION_LOG_ENV = "VLFT_OPTION_LOG"


def record_options(ctx: click.Context, file_values: dict) -> None:
    """With ``VLFT_OPTION_LOG=FILE`` set, append to FILE one JSON line naming the options this run was given:
    ``{"command": "run", "options": ["--lr", ...], "config_file": ["--epochs", ...]}``, those its command line
    set (click's parameter source, so not a default) and those its ``--config`` file set (``file_values``).
    The test suite reads it as evidence of which runs set which option; unset, nothing is written."""
    path = os.environ.get(OPTION_LOG_ENV)
    if not path:
        return
    options = {p.name: max(p.opts, key=len) for p in ctx.command.get_params(ctx) if isinstance(p, click.Option)}
    given = sorted(
        flag
        for name, flag in options.items()
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE and ctx.params.get(name) != ()
    )  # older clicks call an unused multiple option given
    record = {
        "command": ctx.info_name,
        "options": given,
        "config_file": sorted(
            [options[name] for name in file_values if name in options]
            + ["--" + n.replace("_", "-") for n in file_values.get("objective_options", {})]
        ),
    }
    # one write in append mode: lines from concurrent processes (torchrun's workers) do not interleave
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


class PluginGroup(click.Group):
    """The ``vlft`` group: its commands come from the plugins' ``vlft_register_commands``, asked once,
    when a command is first looked up (the built-in ones too: see ``vlft/commands.py``)."""

    _loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            registry = get_registry()
        except VlftError as e:  # a clash between plugins: say so, the commands that loaded still work
            click.echo(f"Error: {e}", err=True)
            return
        registry.hook.vlft_register_commands(cli=self)

    def get_command(self, ctx, cmd_name):
        self._load()
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx):
        self._load()
        return super().list_commands(ctx)


@click.group(cls=PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlft")
def cli():
    """Fine-tune vision-language models with adapters, on any accelerator.

    Backends and methods are plugins: `vlft plugins` lists them.
    """


def as_arguments(flags: dict) -> list[str]:
    """Flag values back into command-line arguments (for torchrun's processes)."""
    args: list[str] = []
    for name, value in flags.get("objective_options", {}).items():
        flag = "--" + name.replace("_", "-")
        args += [x for v in value for x in (flag, str(v))] if isinstance(value, list) else [flag, str(value)]
    for f in user_fields():
        if f.name not in flags:
            continue
        flag = f.metadata.get("cli", "--" + f.name.replace("_", "-"))
        value = flags[f.name]
        if f.metadata.get("flag"):
            args += [flag] if value else []
        elif f.name == "adapter":
            for key, v in value.items():
                args += [flag, f"{key}={json.dumps(v)}"]
        elif f.metadata.get("multiple"):
            for v in value:
                args += [flag, str(v)]
        else:
            args += [flag, str(value)]
    return args


def main(argv=None):
    return cli.main(args=argv, prog_name="vlft")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
