"""The plugin manager and the built-in plugins against the hook specs."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest

from vlft.contracts.backend import BackendInfo
from vlft.contracts.method import MethodInfo
from vlft.errors import ConfigError, VlftError
from vlft.hookspecs import hookimpl
from vlft.plugins import builtin_packages, builtin_plugins
from vlft.registry import ENTRY_POINT_GROUP, load_registry, new_plugin_manager

ROOT = Path(__file__).resolve().parents[1]

BUILTINS = {
    "cpu": "vlft.builtin.cpu",
    "cuda": "vlft_cuda",
    "ascend": "vlft_ascend",
    "lora": "vlft_methods.lora",
    "oft": "vlft_methods.oft",
}


def test_builtins_register_directly_and_entry_points_are_left_to_third_parties():
    import tomllib

    found = dict(builtin_plugins())
    assert {k: found.get(k) for k in BUILTINS} == BUILTINS
    assert {"commands", "sinks", "models", "sft", "dpo"} <= set(found)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # an install names no built-in as an entry point (they would be found twice), and puts each plugin
    # package where vlft/plugins.py finds it in a checkout, and lists it among its packages
    assert "vlft" not in project["project"].get("entry-points", {})
    setuptools = project["tool"]["setuptools"]
    assert setuptools["package-dir"] == {k: str(v.relative_to(ROOT)) for k, v in builtin_packages(ROOT).items()}
    assert set(builtin_packages(ROOT)) <= set(setuptools["packages"])
    reg = load_registry(load_entry_points=False, builtins=True)
    assert set(found) <= {n for n, _ in reg.pm.list_name_plugin()}
    assert not reg.broken


def test_an_install_whose_old_entry_points_name_the_builtins_registers_each_once(monkeypatch):
    """An install made when the built-ins were entry points too (the same names, or other names for the same
    modules): each built-in module is registered once, so no hook answers twice and no name clashes."""
    real = importlib.metadata.entry_points

    def with_old(**kw):
        eps = list(real(**kw))
        if kw.get("group") == ENTRY_POINT_GROUP:
            eps += [
                importlib.metadata.EntryPoint(name, module, ENTRY_POINT_GROUP) for name, module in builtin_plugins()
            ]
            eps += [importlib.metadata.EntryPoint("lora-old", "vlft_methods.lora", ENTRY_POINT_GROUP)]
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", with_old)
    reg = load_registry()
    modules = [p for _, p in reg.pm.list_name_plugin()]
    assert len(modules) == len({id(m) for m in modules})
    assert not reg.pm.has_plugin("lora-old") and reg.owners[("method", "lora")] == "lora"
    assert not reg.broken


def test_a_checkout_that_is_not_installed_has_its_builtin_plugins(tmp_path):
    """`python -m vlft plugins` from a Python where vlft is not installed, the checkout on PYTHONPATH: a
    folder holding this venv's packages (torch, transformers, pluggy, click ...) minus vlft's own install
    (its metadata, its editable finder), as on a device machine."""
    import sysconfig

    site = tmp_path / "site"
    site.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.startswith(("vlft", "__editable__", "_distutils_hack")) or entry.suffix == ".pth":
            continue
        (site / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "VLFT_PLUGINS": ""}
    code = (
        "import importlib.metadata as m, json, vlft\n"
        "from vlft.registry import load_registry\n"
        "r = load_registry()\n"
        "print(json.dumps({'dists': [[d.metadata['Name'], str(d.locate_file(''))] for d in m.distributions()],\n"
        "                  'vlft': vlft.__file__, 'backends': sorted(r.backends), 'methods': sorted(r.methods),\n"
        "                  'objectives': sorted(r.objectives), 'broken': r.broken}))\n"
    )
    # -S: no site-packages of this Python (the venv's, with vlft installed), only PYTHONPATH
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    found = json.loads(proc.stdout.strip().splitlines()[-1])
    # really not installed: no vlft metadata but the egg-info `pip install -e` leaves in the checkout itself
    # (the tree on the path, as a device machine's copy of it may carry)
    assert not [d for d, where in found["dists"] if d.startswith("vlft") and Path(where).resolve() != ROOT]
    assert Path(found["vlft"]).resolve().is_relative_to(ROOT)
    assert {"cpu", "cuda", "ascend"} <= set(found["backends"]) and {"lora", "oft"} <= set(found["methods"])
    assert {"sft", "dpo"} <= set(found["objectives"]) and not found["broken"]
    cli = subprocess.run(
        [sys.executable, "-S", "-m", "vlft", "plugins"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "(plugin models)" in cli.stdout and "(plugin cpu)" in cli.stdout and "(plugin sft)" in cli.stdout
    assert "qwen2.5-vl" in cli.stdout and "(plugin lora)" in cli.stdout


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_plugin_matches_the_specs(name):
    pm = new_plugin_manager()
    pm.register(importlib.import_module(BUILTINS[name]), name=name)
    pm.check_pending()  # every hookimpl has a spec with matching arguments
    impls = [
        i
        for caller in pm.hook.__dict__.values()
        if isinstance(caller, pluggy.HookCaller)
        for i in caller.get_hookimpls()
    ]
    assert impls, f"{name} implements no hooks"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_plugin_answers_only_for_what_it_owns(name):
    from vlft.config import RunConfig

    pm = new_plugin_manager()
    pm.register(importlib.import_module(BUILTINS[name]), name=name)
    cfg = RunConfig()
    assert pm.hook.vlft_probe_backend(backend="nobody") is None
    assert pm.hook.vlft_precision_policy(backend="nobody", config=cfg) is None
    assert pm.hook.vlft_setup_device(backend="nobody", config=cfg) is None
    assert pm.hook.vlft_adapter_defaults(method="nobody", config=cfg) is None
    assert (
        pm.hook.vlft_apply_adapter(
            method="nobody", model=None, targets=[], config=cfg, target_parameters=[], family=None
        )
        is None
    )


def test_registry_lists_builtin_backends_and_methods(registry):
    assert {"cpu", "cuda", "ascend"} <= set(registry.backends)
    assert {"lora", "oft"} <= set(registry.methods)
    assert registry.owners[("method", "oft")] == "oft"
    assert registry.first("vlft_probe_backend", backend="cpu").available


def test_unknown_names_list_the_valid_ones(registry):
    # the installed set: vlft's own plugins and any third party's (make test installs the example plugin)
    assert {"ascend", "cpu", "cuda"} <= set(registry.backends) and {"lora", "oft"} <= set(registry.methods)
    backends, methods = ", ".join(sorted(registry.backends)), ", ".join(sorted(registry.methods))
    with pytest.raises(ConfigError, match=re.escape(f"unknown backend 'tpu'; valid backends: auto, {backends}")):
        registry.backend("tpu")
    with pytest.raises(ConfigError, match=re.escape(f"unknown method 'dora'; valid methods: {methods}")):
        registry.method("dora")


def test_a_plugin_that_fails_to_import_is_listed_broken_and_the_rest_work(monkeypatch):
    real = importlib.metadata.entry_points

    def with_broken(**kw):
        eps = list(real(**kw))
        if kw.get("group") == ENTRY_POINT_GROUP:
            eps.append(importlib.metadata.EntryPoint("broken", "vlft_no_such_module_xyz", ENTRY_POINT_GROUP))
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", with_broken)
    reg = load_registry()
    assert "broken" in reg.broken and "ModuleNotFoundError" in reg.broken["broken"]
    assert "lora" in reg.methods and reg.first("vlft_probe_backend", backend="cpu").available
    with pytest.raises(ConfigError, match="plugins that failed to load: broken"):
        reg.method("nope")


class _ClashingLora:
    @hookimpl
    def vlft_methods(self):
        return [MethodInfo("lora", "a second LoRA")]


def test_two_plugins_claiming_one_name_is_an_error_naming_both():
    with pytest.raises(VlftError, match=r"two plugins offer the method 'lora': 'lora' and '_ClashingLora'"):
        load_registry(plugins=(_ClashingLora(),))


def test_disable_env_blocks_a_plugin(monkeypatch):
    monkeypatch.setenv("VLFT_DISABLE_PLUGINS", "oft, cuda")
    reg = load_registry()
    assert "oft" not in reg.methods and "cuda" not in reg.backends
    assert reg.disabled == ["oft", "cuda"]


def test_a_fresh_manager_with_only_test_plugins():
    class OnlyBackend:
        @hookimpl
        def vlft_backends(self):
            return [BackendInfo("toy", "a toy", "cpu", priority=5)]

    reg = load_registry(load_entry_points=False, plugins=(OnlyBackend(),))
    assert list(reg.backends) == ["toy"] and reg.methods == {}


def test_a_torch_older_than_the_floor_is_refused_with_a_clear_message():
    """``get_total_norm`` and the public ``fully_shard`` need torch 2.6: a run's plan refuses an older torch
    before anything is loaded, importing the training stage does not fail, and ``vlft doctor`` fails its torch
    check (the version string stands in for an old install: a subprocess that sets ``torch.__version__``
    before importing vlft)."""
    import subprocess
    import sys

    from vlft.floors import TORCH_FLOOR, torch_too_old

    assert TORCH_FLOOR == "2.6"
    assert torch_too_old("2.14.1+cu130") is None and torch_too_old("2.6.0") is None
    assert "torch 2.5.1+cpu is older than vlft needs (2.6)" in torch_too_old("2.5.1+cpu")
    code = (
        "import torch; torch.__version__ = '2.4.1'\n"
        "import vlft.training, vlft.training.step, vlft.training.fsdp\nprint('imported')\n"
        "from vlft.config import RunConfig\nfrom vlft.planning.preflight import plan_run\n"
        "from vlft.registry import load_registry\n"
        "try:\n    plan_run(load_registry(), RunConfig(dry_run=True))\n"
        "except Exception as e:\n    print('refused:', type(e).__name__, e)\n"
        "from vlft.commands.doctor import torch_check\nc = torch_check('2.4.1')\nprint('doctor:', c.ok, c.fix)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "imported" in proc.stdout, proc.stderr[-2000:]
    assert "refused: ConfigError torch 2.4.1 is older than vlft needs (2.6)" in proc.stdout, proc.stderr[-2000:]
    assert "doctor: False pip install 'torch>=2.6'" in proc.stdout


def test_a_warning_silenced_in_a_forward_leaves_the_process_filters_as_they_were():
    """``shard_model`` silences FSDP2's view warning of the root for the root's forward only
    (``quiet_during_forward``): a module whose post-forward hook warns is quiet inside its forward, the same
    warning raised after it is seen, and the process's filters are unchanged, a forward that fails too."""
    import warnings

    import torch

    from vlft.training.fsdp import quiet_during_forward

    class Root(torch.nn.Module):
        fail = False

        def forward(self, x):
            if self.fail:
                raise RuntimeError("a forward that fails")
            return x * 2

    root = Root()
    root.register_forward_hook(
        lambda m, a, out: warnings.warn("FSDP2-wrapped module (Root) returned a view tensor", stacklevel=1)
    )
    before = list(warnings.filters)
    quiet_during_forward(root, r"FSDP2-wrapped module .* returned a view tensor")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        root(torch.ones(2))
        assert seen == []
        warnings.warn("FSDP2-wrapped module (Root) returned a view tensor", stacklevel=1)
        assert len(seen) == 1
    assert warnings.filters == before
    root.fail = True
    with pytest.raises(RuntimeError, match="a forward that fails"):
        root(torch.ones(2))
    assert warnings.filters == before
