"""End to end: `vlft run` on the embedded model, resume, hooks, bad input, CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import cli_invoke, run_flags
from vlft.cli import cli
from vlft.config import build_config
from vlft.contracts.backend import BackendInfo
from vlft.contracts.method import AdapterDefaults, MethodInfo
from vlft.errors import ConfigError
from vlft.hookspecs import hookimpl
from vlft.registry import load_registry


def short_values(small_data, output, **over) -> dict:
    """The flag values of the short runs here (``vlft run`` flags through ``helpers.run_flags``)."""
    train, val = small_data
    values = dict(
        backend="cpu",
        method="lora",
        data=str(train),
        val_data=str(val),
        output=str(output),
        steps=6,
        batch_size=4,
        log_every=1,
        eval_every=3,
        eval_batches=1,
        eval_samples=4,
        max_new_tokens=12,
        save_every=3,
        seed=1,
        lr=3e-3,
    )
    values.update(over)
    return values


def short_config(small_data, output, **over):
    return build_config({}, short_values(small_data, output, **over))


def read_metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def logged_losses(output: Path) -> list[dict]:
    """The logged steps' lines (checkpoint and evaluation timings have lines of their own)."""
    return [m for m in read_metrics(output) if "loss" in m]


@pytest.mark.parametrize("method", ["lora", "oft"])
def test_short_run_writes_adapter_metrics_and_eval(small_data, tmp_path, method):
    out = tmp_path / "run"
    # a checkpoint every step, two kept: the last step's too (the final checkpoint, before the evaluation)
    code, output = cli_invoke(
        "run", "--quiet", *run_flags(short_values(small_data, out, method=method, save_every=1, keep_checkpoints=2))
    )
    assert code == 0, output
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "peak_memory_bytes"):
        assert all(m[key] is not None for m in metrics if "loss" in m), key
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert sum(losses[-2:]) < sum(losses[:2])
    assert any("val_loss" in m for m in metrics)
    ev = json.loads((out / "eval.json").read_text())
    assert ev["before"]["samples"] == 4 and ev["after"]["samples"] == 4
    assert set(ev["after"]["fields"]) == {"colour", "defect"}
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    kept = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in kept] == ["step-000005", "step-000006"]
    assert all((p / "state.pt").is_file() and (p / "adapter" / "adapter_model.safetensors").is_file() for p in kept)
    assert json.loads((out / "summary.json").read_text())["method"] == method


def test_resume_continues_with_the_same_losses(registry, small_data, tmp_path, monkeypatch, straight_run):
    import vlft.training.step
    from vlft.commands.run import execute

    straight = straight_run

    # the same run, interrupted during step 6 (after the step-4 checkpoint), then resumed
    interrupted = tmp_path / "interrupted"
    real_step = vlft.training.step.train_step
    calls = {"n": 0}

    def dying_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(vlft.training.step, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        execute(registry, short_config(small_data, interrupted, steps=8, save_every=4, eval_every=0), progress=False)
    monkeypatch.setattr(vlft.training.step, "train_step", real_step)
    assert [m["step"] for m in logged_losses(interrupted)] == [1, 2, 3, 4, 5]
    code, output = cli_invoke(
        "run",
        "--quiet",
        *run_flags(short_values(small_data, interrupted, steps=8, save_every=4, eval_every=0, resume=True)),
    )
    assert code == 0, output

    a, b = logged_losses(straight), logged_losses(interrupted)
    assert [m["step"] for m in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), (x, y)
        assert x["lr"] == pytest.approx(y["lr"])


def hook_calls_inside_steps(registry, config, monkeypatch, inside_step=None) -> list[str]:
    """Names of the vlft hooks called while a training step runs, through any registry: the one the run
    was given, the process-wide one, or one made on the spot (``vlft.measure.HookCallCounter``, which
    bench/'s dispatch group counts with too)."""
    import vlft.training.step
    from vlft.commands.run import execute
    from vlft.measure import HookCallCounter

    hooks, real_step = HookCallCounter(), vlft.training.step.train_step

    def watched_step(*args, **kwargs):
        with hooks:
            if inside_step is not None:
                inside_step()
            return real_step(*args, **kwargs)

    monkeypatch.setattr(vlft.training.step, "train_step", watched_step)
    execute(registry, config, progress=False)
    return hooks.calls


def test_no_hook_is_called_inside_a_training_step(registry, small_data, tmp_path, monkeypatch):
    config = short_config(small_data, tmp_path / "r", steps=3, save_every=0, eval_every=0)
    assert hook_calls_inside_steps(registry, config, monkeypatch) == []


def test_a_hook_called_inside_a_step_through_another_registry_is_seen(registry, small_data, tmp_path, monkeypatch):
    """The watch above can fail: a step asking the process-wide registry, as a careless edit would, is caught."""
    import torch

    from vlft.registry import get_registry

    def ask():
        get_registry().first("vlft_memory_reader", backend="cpu", device=torch.device("cpu"))

    config = short_config(small_data, tmp_path / "r", steps=2, save_every=0, eval_every=0)
    assert hook_calls_inside_steps(registry, config, monkeypatch, inside_step=ask) == ["vlft_memory_reader"] * 2


def test_the_hook_counter_counts_vlft_hooks_only_and_puts_pluggy_back(registry):
    import pluggy
    import torch

    from vlft.measure import HookCallCounter

    other = pluggy.PluginManager("elsewhere")

    class Spec:
        @pluggy.HookspecMarker("elsewhere")
        def ping(self): ...

    other.add_hookspecs(Spec)
    real = pluggy.HookCaller.__call__
    with HookCallCounter() as hooks:
        registry.first("vlft_memory_reader", backend="cpu", device=torch.device("cpu"))
        other.hook.ping()
    other.hook.ping()
    registry.first("vlft_memory_reader", backend="cpu", device=torch.device("cpu"))
    assert hooks.calls == ["vlft_memory_reader"] and pluggy.HookCaller.__call__ is real


class ToyPlugin:
    """A third-party plugin defined here: a new backend and a new method (IA3 through PEFT)."""

    @hookimpl
    def vlft_backends(self):
        return [BackendInfo("toycpu", "CPU under another name", "cpu", priority=-1)]

    @hookimpl
    def vlft_methods(self):
        return [MethodInfo("ia3", "IA3 (PEFT): learned rescaling vectors")]

    @hookimpl
    def vlft_probe_backend(self, backend):
        from vlft.contracts.backend import ProbeResult

        return ProbeResult(True, device_count=1) if backend == "toycpu" else None

    @hookimpl
    def vlft_setup_device(self, backend, config):
        import torch

        from vlft.contracts.backend import DeviceSetup

        return DeviceSetup(torch.device("cpu")) if backend == "toycpu" else None

    @hookimpl
    def vlft_attention_implementation(self, backend, config, model_config):
        from vlft.policies import AttentionPolicy

        return AttentionPolicy("sdpa", "sdpa", "toy") if backend == "toycpu" else None

    @hookimpl
    def vlft_precision_policy(self, backend, config):
        from vlft.policies import PrecisionPolicy

        return PrecisionPolicy("fp32") if backend == "toycpu" else None

    @hookimpl
    def vlft_distributed_options(self, backend, config):
        from vlft.policies import DistributedOptions

        return DistributedOptions("gloo") if backend == "toycpu" else None

    @hookimpl
    def vlft_memory_reader(self, backend, device):
        from vlft.contracts.backend import MemoryStats

        return (lambda: MemoryStats(peak_bytes=1)) if backend == "toycpu" else None

    @hookimpl
    def vlft_adapter_defaults(self, method, config):
        if method != "ia3":
            return None
        return AdapterDefaults(
            "ia3", lr=1e-2, hyperparameters={}, text_modules=("k_proj", "v_proj", "down_proj"), vision_modules=("qkv",)
        )

    @hookimpl
    def vlft_apply_adapter(self, method, model, targets, config):
        if method != "ia3":
            return None
        from peft import IA3Config, get_peft_model

        ff = [t for t in targets if t.endswith("down_proj")]
        return get_peft_model(model, IA3Config(target_modules=list(targets), feedforward_modules=ff))

    @hookimpl
    def vlft_save_adapter(self, method, model, path):
        if method == "ia3":
            model.save_pretrained(str(path))
            return True


def test_a_plugin_defined_in_a_test_adds_a_backend_and_a_method(small_data, tmp_path):
    from vlft.commands.run import execute

    reg = load_registry(plugins=(ToyPlugin(),))
    out = tmp_path / "toy"
    result = execute(reg, short_config(small_data, out, backend="toycpu", method="ia3", steps=3), progress=False)
    assert result.plan.backend.info.name == "toycpu" and result.plan.attention.text == "sdpa"
    assert any(m.endswith("down_proj") for m in result.plan.targets)
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "IA3"
    assert read_metrics(out)[-1]["peak_memory_bytes"] == 1


def _write_bad_data(tmp_path: Path) -> Path:
    (tmp_path / "imgs").mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(
            {
                "image": "imgs/nope.png",
                "conversations": [{"from": "user", "value": "<image> what?"}, {"from": "assistant", "value": "x"}],
            }
        )
        + "\n"
    )
    return bad


def test_bad_data_exits_non_zero_naming_the_record_and_writes_nothing(tmp_path):
    bad = _write_bad_data(tmp_path)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["run", "--backend", "cpu", "--data", str(bad), "--output", str(out)])
    assert res.exit_code != 0
    assert "bad.jsonl:1: image 'imgs/nope.png' not found" in res.output
    assert not out.exists()


def test_unknown_backend_and_method_list_the_valid_names(registry):
    # the installed set: vlft's own plugins and any third party's (make test installs the example plugin)
    assert {"ascend", "cpu", "cuda"} <= set(registry.backends) and {"lora", "oft"} <= set(registry.methods)
    res = CliRunner().invoke(cli, ["run", "--backend", "tpu"])
    assert res.exit_code != 0 and f"valid backends: auto, {', '.join(sorted(registry.backends))}" in res.output
    res = CliRunner().invoke(cli, ["run", "--method", "dora"])
    assert res.exit_code != 0 and f"valid methods: {', '.join(sorted(registry.methods))}" in res.output


@pytest.mark.parametrize("backend", ["ascend", "cuda"])
def test_unavailable_backend_stops_at_once_with_the_reason(backend, tmp_path):
    reg = load_registry()
    if reg.first("vlft_probe_backend", backend=backend).available:
        pytest.skip(f"{backend} is available on this machine")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["run", "--backend", backend, "--output", str(out)])
    assert res.exit_code != 0
    assert f"backend '{backend}' is not available here" in res.output
    assert f"vlft doctor --backend {backend}" in res.output
    assert "Traceback" not in res.output and not out.exists()


def test_config_file_keys_are_flag_names_and_flags_override(tmp_path, small_data):
    from vlft.config import load_config_file

    f = tmp_path / "c.yaml"
    f.write_text("method: oft\nvision-last-n: 2\nbatch_size: 3\nadapter: {coft: true}\n")
    cfg = build_config(load_config_file(f), {"batch_size": 5})
    assert (cfg.method, cfg.vision_last_n, cfg.batch_size, cfg.adapter) == ("oft", 2, 5, {"coft": True})
    f.write_text("lerning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'lerning_rate'. Valid keys: .*lr"):
        load_config_file(f)


def test_dry_run_prints_the_plan_without_training(tmp_path):
    res = CliRunner().invoke(
        cli, ["run", "--backend", "cpu", "--method", "oft", "--dry-run", "--json", "--output", str(tmp_path / "o")]
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output[res.output.index("{") :])
    assert plan["backend"]["name"] == "cpu" and plan["method"]["name"] == "oft"
    assert plan["precision"]["name"] == "fp32" and {k: plan["attention"][k] for k in ("vision", "text")} == {
        "vision": "eager",
        "text": "eager",
    }
    assert len(plan["targets"]["modules"]) == 20 and plan["targets"]["adapter_parameters"] > 0
    assert not (tmp_path / "o").exists()


def test_the_cpu_peak_memory_is_the_runs_own_not_its_parents():
    """A run started by a large parent (a notebook, a pytest session holding models) reports its own peak: Linux
    carries ``ru_maxrss`` across fork and exec, so the parent's size at the fork came back as the run's peak (the
    bench's sequence group once read three equal peaks from three different runs)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the inherited peak is a Linux behaviour")
    parent = (
        "import subprocess, sys\n"
        "held = bytearray(600 * 2**20)\n"  # resident: bytearray zero-fills every page
        "child = 'from vlft.builtin.cpu import peak_resident_bytes; print(peak_resident_bytes())'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True, check=True).stdout)\n"
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout) < 300 * 2**20, f"the child reported {int(out.stdout) / 2**20:.0f} MiB"
