"""The built-in commands, added to ``vlft`` through ``vlft_register_commands`` like any plugin's.

This module is a plugin (entry point ``commands`` in the ``vlft`` group): the
core's command group knows no command of its own, so a third-party command
and ``vlft run`` are registered the same way.

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import json

import click

from vlft.cli import RunCommand, as_arguments, config_options, given_flags, record_options, user_errors
from vlft.config import RunConfig, build_config, load_config_file
from vlft.hookspecs import hookimpl
from vlft.registry import DISABLE_ENV, get_registry


@click.command(cls=RunCommand)
@config_options
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML file of flag values.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON.")
@click.option("--verbose", is_flag=True, help="With --dry-run: list every adapted module, not the groups.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--nproc-per-node",
    type=int,
    default=1,
    show_default=True,
    help="Processes (devices) per machine; above 1 the run goes through torchrun.",
)
@click.option("--nnodes", type=int, default=1, show_default=True, help="Machines (passed to torchrun).")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This machine's rank (torchrun).")
@click.option("--master-addr", default=None, help="Rendezvous host (torchrun); default 127.0.0.1.")
@click.option(
    "--master-port",
    type=int,
    default=None,
    help="Rendezvous port (torchrun); default: on one machine torchrun's own rendezvous on a free port, "
    "on several 29500.",
)
@click.pass_context
@user_errors  # params: click passes each option as an argument of its own
def run(
    ctx, config_file, as_json, verbose, quiet, nproc_per_node, nnodes, node_rank, master_addr, master_port, **params
):
    """Fine-tune a model with an adapter method on a backend, evaluate it before and after, save the adapter."""
    from vlft.training.launch import LaunchOptions, end_worker, relaunch

    file_values = load_config_file(config_file, tuple(get_registry().objective_options())) if config_file else {}
    record_options(ctx, file_values)
    flags = given_flags(ctx, params)
    config = build_config(file_values, flags)
    launch = LaunchOptions(nproc_per_node, nnodes, node_rank, master_addr, master_port)
    if launch.wanted and not config.dry_run and config.shard == "fsdp":
        check_sharding(get_registry(), config)  # before torchrun starts any process
    if launch.wanted and not config.dry_run and config.sequence_parallel > 1:
        check_sequence_split(get_registry(), config, nproc_per_node * nnodes)
    if launch.wanted and not config.dry_run:
        args = ["run", *as_arguments(flags)] + (["--config", config_file] if config_file else [])
        code = relaunch(launch, args + (["--quiet"] if quiet else []))
        if code != 0:
            raise click.ClickException(f"a training process failed (torchrun exit code {code}); its error is above")
        return
    if launch.wanted:
        config.world_size = nproc_per_node * nnodes
    # here, not above: a process that only starts torchrun skips importing the stages (3.5 s of CPU)
    from vlft.commands.run import execute
    from vlft.planning.plan import format_plan

    registry = get_registry()
    try:
        result = execute(registry, config, progress=not quiet)
    except SystemExit as stop:  # interrupted, its checkpoint written: a torchrun worker leaves as below
        end_worker(stop.code)
        raise
    if config.dry_run:
        desc = result.description
        assert desc is not None  # a dry run's result describes its plan
        click.echo(json.dumps(desc, indent=2, default=str) if as_json else format_plan(desc, verbose=verbose))
        if desc["memory"] and desc["memory"]["fits"] is False and not config.no_memory_check:
            raise click.ClickException("this run will not fit its device; the memory plan above names the fixes")
    end_worker(0)  # a torchrun worker leaves here, its run done and written (launch.end_worker says why)


def check_sharding(registry, config) -> None:
    """``--shard fsdp`` on a backend that does not offer it, or for an objective that cannot run sharded: the
    error, before any process starts."""
    from vlft.planning.plan import choose_backend, resolve_objective
    from vlft.planning.sharding import require_fsdp

    name = choose_backend(registry, config.backend).info.name
    require_fsdp(registry.first("vlft_distributed_options", backend=name, config=config), name)
    resolve_objective(registry, config)


def check_sequence_split(registry, config, processes: int) -> None:
    """``--sequence-parallel N`` that does not divide the processes, or for an objective it cannot split: the error,
    before any process starts (what the model allows is checked with its plan, in the processes)."""
    import dataclasses

    from vlft.planning.plan import resolve_objective
    from vlft.planning.sequence import check_processes

    check_processes(dataclasses.replace(config, world_size=processes), resolve_objective(registry, config))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def plugins(as_json):
    """List plugins, backends (with availability), methods, objectives and model families, each with the
    plugin that offers it."""
    from vlft.models.bundled import (  # the model stage, only for this listing
        bundled_by_family,
        bundled_names,
    )
    from vlft.models.families import family_readers, offered_families

    registry = get_registry()
    families, family_problems = offered_families(registry)  # a plugin whose families fail is listed broken
    by_family = bundled_by_family(registry, families)
    names = sorted({n for n, _ in registry.pm.list_name_plugin() if n})
    probes = {name: registry.first("vlft_probe_backend", backend=name) for name in registry.backends}
    dist = {
        name: registry.first("vlft_distributed_options", backend=name, config=RunConfig()) for name in registry.backends
    }
    data = {
        "plugins": [
            {
                "name": n,
                "status": "broken" if n in family_problems else "loaded",
                **({"error": family_problems[n]} if n in family_problems else {}),
                **({"notes": registry.notes[n]} if n in registry.notes else {}),
            }
            for n in names
        ]
        + [{"name": n, "status": "broken", "error": e} for n, e in sorted(registry.broken.items())]
        + [{"name": n, "status": "disabled"} for n in registry.disabled],
        "backends": [
            {
                "name": b.name,
                "description": b.description,
                "device_type": b.device_type,
                "priority": b.priority,
                "plugin": registry.owners[("backend", b.name)],
                "available": probes[b.name].available,
                "reason": probes[b.name].reason,
                "device_count": probes[b.name].device_count,
                "fsdp": bool(dist[b.name] and dist[b.name].fsdp),
                "fsdp_reason": dist[b.name].fsdp_reason if dist[b.name] else "no distributed options",
            }
            for b in sorted(registry.backends.values(), key=lambda b: -b.priority)
        ],
        "methods": [
            {"name": m.name, "description": m.description, "plugin": registry.owners[("method", m.name)]}
            for m in sorted(registry.methods.values(), key=lambda m: m.name)
        ],
        "objectives": [
            {"name": o.name, "description": o.description, "plugin": registry.owners[("objective", o.name)]}
            for o in sorted(registry.objectives.values(), key=lambda o: o.name)
        ],
        "model_families": [
            {
                "name": f.name,
                "model_types": list(f.model_types),
                "description": f.description,
                "plugin": f.plugin,
                "box_coordinates": f.chat.box_coordinates,
                "embedded": f"embedded:{f.name}" if f.tiny else None,
                "bundled_configs": by_family.get(f.name, []),
            }
            for f in families
        ],
        "family_readers": [
            {"name": r.name, "description": r.description, "plugin": plugin} for plugin, r in family_readers(registry)
        ],
        "bundled_configs": bundled_names(registry),
        "scorers": [
            {"name": c.name, "description": c.description, "plugin": registry.owners[("scorer", c.name)]}
            for c in sorted(registry.scorers.values(), key=lambda c: c.name)
        ],
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo("plugins:")
    for p in data["plugins"]:
        extra = f"  {p['error']}" if p.get("error") else ""
        click.echo(f"  {p['name']:<16} {p['status']}{extra}")
        for note in p.get("notes", []):
            click.echo(f"  {'':<16} note: {note}")
    click.echo("backends:")
    for b in data["backends"]:
        state = f"available ({b['device_count']} device(s))" if b["available"] else f"unavailable: {b['reason']}"
        shard = "--shard fsdp: yes" if b["fsdp"] else f"--shard fsdp: no ({b['fsdp_reason'] or 'not offered'})"
        click.echo(
            f"  {b['name']:<8} {state}\n           {b['description']} (plugin {b['plugin']})\n           {shard}"
        )
    click.echo("methods:")
    for m in data["methods"]:
        click.echo(f"  {m['name']:<8} {m['description']} (plugin {m['plugin']})")
    click.echo("objectives:")
    for o in data["objectives"]:
        click.echo(f"  {o['name']:<8} {o['description']} (plugin {o['plugin']})")
    click.echo("scorers (--scorer on run and eval; each is a --reward too):")
    for c in data["scorers"]:
        click.echo(f"  {c['name']:<8} {c['description']} (plugin {c['plugin']})")
    click.echo("model families (--model DIR of that model_type, or --model embedded:<name> for a tiny offline one):")
    names = max([13, *(len(f["name"]) for f in data["model_families"])])
    types = max([14, *(len(", ".join(f["model_types"])) for f in data["model_families"])])
    for f in data["model_families"]:
        click.echo(
            f"  {f['name']:<{names}} {', '.join(f['model_types']):<{types}} boxes {f['box_coordinates']:<14} "
            f"{f['description']} (plugin {f['plugin']})"
        )
    for r in data["family_readers"]:
        click.echo(f"  any other model_type: {r['name']} family, {r['description']} (plugin {r['plugin']})")
    click.echo("bundled configs (--model NAME --dry-run plans offline): " + ", ".join(data["bundled_configs"]))
    if registry.broken or family_problems:
        click.echo(f"(block a broken plugin with {DISABLE_ENV}=name)")


@click.command()
@user_errors
def methods():
    """List adapter methods with their default hyper-parameters and targets."""
    registry = get_registry()
    for info in sorted(registry.methods.values(), key=lambda m: m.name):
        d = registry.first("vlft_adapter_defaults", method=info.name, config=RunConfig())
        click.echo(f"{info.name}: {info.description}")
        click.echo(
            f"  lr {d.lr:g}; default targets: {d.default_targets} "
            f"(text: {', '.join(d.text_modules) or '-'}; vision: {', '.join(d.vision_modules) or '-'}, "
            f"last {RunConfig().vision_last_n} blocks)"
        )
        for key, value in d.hyperparameters.items():
            click.echo(f"  {key} = {value!r}" + (f"  # {d.help[key]}" if d.help.get(key) else ""))
        for note in d.notes:
            click.echo(f"  note: {note}")


@click.command()
@user_errors
def objectives():
    """List training objectives (--objective) with their data layout, options and logged figures."""
    from vlft.contracts.objective import option_specs, reference_description

    registry = get_registry()
    for info in sorted(registry.objectives.values(), key=lambda o: o.name):
        o = registry.objective_for(RunConfig(objective=info.name))
        click.echo(f"{info.name}: {info.description}")
        click.echo(f"  data: {o.layout.description}")
        click.echo(
            f"  loss averaged over {o.average_over.value}"
            + (f"; {o.rows_per_record} sequences per record" if o.rows_per_record > 1 else "")
        )
        if o.reference:
            click.echo(
                f"  reference: {reference_description(False)} (with --init-adapter: {reference_description(True)})"
            )
        for spec in option_specs(info.options):
            click.echo(f"  {spec.flag} {spec.default!r}  # {spec.help}")
        if o.figures:
            click.echo(f"  logs: {', '.join(o.figures)} (validation: val_ of each)")
        for reason, what in ((o.packing_refusal, "--packing"), (o.sharding_refusal, "--shard fsdp")):
            if reason:
                click.echo(f"  no {what}: {reason}")
    if registry.rewards:  # what objectives that score generations (grpo) take as --reward
        click.echo("reward functions (--reward NAME[=ARGUMENT], or your MODULE:FUNCTION):")
        for reward in sorted(registry.rewards.values(), key=lambda r: r.name):
            click.echo(
                f"  {reward.name}"
                + (f"={reward.argument}" if reward.argument else "")
                + f": {reward.description} ({registry.owners[('reward', reward.name)]})"
            )


@click.command()
@user_errors
def scorers():
    """List the scorers (--scorer on `vlft run` and `vlft eval`; each is a --reward too) and what auto picks."""
    registry = get_registry()
    for c in sorted(registry.scorers.values(), key=lambda c: c.name):
        click.echo(f"{c.name}: {c.description} ({registry.owners[('scorer', c.name)]})")
        click.echo(
            "  auto: "
            + ("picks it where the references take its form" if c.fits is not None else "only when named")
            + (f"; lower is better: {', '.join(c.lower_is_better)}" if c.lower_is_better else "")
        )


@click.command("demo-data")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--train", "n_train", default=1600, show_default=True, help="Training samples.")
@click.option("--val", "n_val", default=400, show_default=True, help="Validation samples.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--task",
    type=click.Choice(["inspection", "counting", "grounding"]),
    default="inspection",
    show_default=True,
    help="inspection: the embedded product set (fields); counting: discs to count "
    "(relaxed accuracy); grounding: a square's box (IoU), in --box-coordinates.",
)
@click.option(
    "--box-coordinates",
    type=click.Choice(["absolute", "relative-1000", "relative-1"]),
    default="absolute",
    show_default=True,
    help="grounding: the convention of the model family you train (`vlft plugins` lists each family's); "
    "absolute suits the embedded Qwen2.5-VL.",
)
@user_errors
def demo_data(out, n_train, n_val, seed, task, box_coordinates):
    """Write a synthetic data set (JSONL + images) to OUT: the embedded product-inspection set, or a counting or
    grounding set for the scorers (docs/scorers.md)."""
    from vlft.data.demo import write_demo_dataset
    from vlft.data.demo_tasks import write_task_dataset

    ds = (
        write_demo_dataset(out, n_train=n_train, n_val=n_val, seed=seed)
        if task == "inspection"
        else write_task_dataset(out, task, n_train=n_train, n_val=n_val, seed=seed, box_coordinates=box_coordinates)
    )
    click.echo(f"wrote {n_train} training and {n_val} validation samples: {ds.train}, {ds.val}")


@hookimpl
def vlft_register_commands(cli):
    from vlft.commands.data_check import data
    from vlft.commands.data_convert import convert
    from vlft.commands.doctor import doctor
    from vlft.commands.export import export
    from vlft.commands.parity import parity, parity_worker
    from vlft.commands.predict import eval_command, predict
    from vlft.commands.report import report

    data.add_command(convert)
    for command in (
        run,
        plugins,
        methods,
        objectives,
        scorers,
        demo_data,
        data,
        doctor,
        parity,
        parity_worker,
        predict,
        eval_command,
        export,
        report,
    ):
        cli.add_command(command)
