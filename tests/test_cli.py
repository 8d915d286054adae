"""The commands as a user types them: the installed ``vlft`` script and ``torchrun``, each in a process of its own."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import vlft_command


def vlft(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*vlft_command(), *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def test_vlft_plugins_lists_plugins_backends_with_availability_and_methods(registry):
    proc = vlft("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    # vlft's own plugins and every installed entry point's (make test installs the example plugin)
    from vlft.plugins import builtin_plugins

    installed = {name for name, _ in builtin_plugins()} | {
        ep.name for ep in importlib.metadata.entry_points(group="vlft")
    }
    assert {"ascend", "commands", "cpu", "cuda", "lora", "oft", "sinks"} <= installed
    assert {p["name"]: p["status"] for p in data["plugins"]} == {n: "loaded" for n in installed}
    for b in data["backends"]:  # what the command says is what the probe in this process finds
        probe = registry.first("vlft_probe_backend", backend=b["name"])
        assert b["available"] == probe.available, b
        assert b["available"] or b["reason"] == probe.reason != ""
    assert {b["name"] for b in data["backends"]} == set(registry.backends) >= {"ascend", "cpu", "cuda"}
    # which backends offer --shard fsdp, as their distributed options say
    assert {b["name"]: b["fsdp"] for b in data["backends"] if b["name"] in ("ascend", "cpu", "cuda")} == {
        "ascend": True,
        "cpu": True,
        "cuda": True,
    }
    assert [m["name"] for m in data["methods"]] == sorted(registry.methods) and {"lora", "oft"} <= set(registry.methods)
    # each method as its plugin answers vlft_methods, with the description it gives
    offered = {info.name: info.description for infos in registry.hook.vlft_methods() for info in infos}
    assert {m["name"]: m["description"] for m in data["methods"]} == offered
    assert all(offered.values())
    # the plugin behind each offer: backends, methods, objectives and model families alike
    assert all(m["plugin"] == registry.owners[("method", m["name"])] for m in data["methods"])
    assert {o["name"]: o["plugin"] for o in data["objectives"]}.items() >= {"sft": "sft", "dpo": "dpo"}.items()
    families = {f["name"]: f["plugin"] for f in data["model_families"]}
    assert families["qwen2.5-vl"] == families["qwen3-vl"] == "models"

    proc = vlft("plugins", env={"VLFT_DISABLE_PLUGINS": "oft"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split() == ["oft", "disabled"] for line in lines), proc.stdout
    methods = lines[lines.index("methods:") + 1 : lines.index("objectives:")]
    assert [line.split()[0] for line in methods] == sorted(set(registry.methods) - {"oft"})
    # each offer names the plugin behind it
    assert all(line.endswith(f"(plugin {registry.owners[('method', line.split()[0])]})") for line in methods)
    assert any(line.split()[:2] == ["cpu", "available"] for line in lines)


def test_vlft_methods_shows_hyperparameters_with_help_lr_and_targets(registry):
    from vlft.config import RunConfig

    proc = vlft("methods")
    assert proc.returncode == 0, proc.stderr
    blocks = {}
    for line in proc.stdout.splitlines():
        if not line.startswith(" "):
            blocks[line.split(":")[0]] = []
        else:
            blocks[list(blocks)[-1]].append(line.strip())
    assert list(blocks) == sorted(registry.methods) and {"lora", "oft"} <= set(blocks)
    for name, lines in blocks.items():
        d = registry.first("vlft_adapter_defaults", method=name, config=RunConfig())
        assert lines[0].startswith(f"lr {d.lr:g}; default targets: {d.default_targets}"), lines[0]
        for key, value in d.hyperparameters.items():
            assert f"{key} = {value!r}  # {d.help[key]}" in lines, (name, key)
    # the defaults the README states
    lora, oft = ([line.split("  #")[0] for line in blocks[m]] for m in ("lora", "oft"))
    assert lora[0].startswith("lr 0.0002;") and "r = 32" in lora and "lora_alpha = 64" in lora
    assert oft[0].startswith("lr 0.0001;") and "use_cayley_neumann = True" in oft


def test_vlft_demo_data_writes_a_readable_data_set(tmp_path):
    from vlft.data.records import read_records
    from vlft_scorers.fields import parse_fields

    proc = vlft("demo-data", str(tmp_path / "demo"), "--train", "6", "--val", "2", "--seed", "4")
    assert proc.returncode == 0, proc.stderr
    train, val = read_records(tmp_path / "demo" / "train.jsonl"), read_records(tmp_path / "demo" / "val.jsonl")
    assert (len(train), len(val)) == (6, 2)
    for rec in train + val:  # every image is a file under the data set's folder; every answer names both fields
        assert all(Path(p).is_file() and Path(p).is_relative_to(tmp_path / "demo") for p in rec.images)
        assert set(parse_fields(rec.reference)) == {"colour", "defect"}, rec.reference


@pytest.mark.parametrize(
    "opts, has, lacks",
    [
        (dict(nproc_per_node=2), ["--standalone"], ["--master-port"]),
        (
            dict(nproc_per_node=2, master_port=29400),
            ["--master-port=29400", "--master-addr=127.0.0.1"],
            ["--standalone"],
        ),
        (
            dict(nproc_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1"),
            ["--master-addr=10.0.0.1", "--master-port=29500", "--nnodes=2", "--node-rank=1"],
            ["--standalone"],
        ),
    ],
)
def test_torchrun_gets_its_port_from_its_own_rendezvous_on_one_machine(opts, has, lacks):
    from vlft.training.launch import LaunchOptions, torchrun_command

    cmd = torchrun_command(LaunchOptions(**opts), ["run"])
    assert all(a in cmd for a in has) and not any(a.startswith(tuple(lacks)) for a in cmd), cmd
    assert cmd[-3:] == ["-m", "vlft", "run"]


@pytest.mark.parametrize("joined", [True, False])
def test_a_torchrun_worker_leaves_vlft_run_through_os_exit_once_its_output_is_out(monkeypatch, capfd, joined):
    """A process that joined a group of several processes leaves ``vlft run`` through ``os._exit(0)``, after its
    output, skipping the finalization that can abort a finished gloo job (``launch.end_worker``); any other
    process returns from the command as usual. (A dry run joins no group: the group is set by hand.)"""
    import vlft.training.launch as launch
    from vlft.cli import main

    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setattr(launch, "_IN_GROUP", [True] if joined else [])
    monkeypatch.setattr(launch.os, "_exit", fake_exit)
    with pytest.raises(Exited if joined else SystemExit) as raised:
        main(["run", "--dry-run", "--backend", "cpu"])
    assert (raised.value.args[0] if joined else raised.value.code) == 0
    assert "memory " in capfd.readouterr().out  # the plan was printed before the exit
