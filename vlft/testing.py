"""Helpers for testing a vlft plugin (see docs/writing-plugins.md, "Testing your plugin").

    from vlft.testing import check_plugin, registry_with, run, tiny_run_config

    import my_plugin

    def test_hooks_match_vlft_and_answer_only_for_my_names():
        check_plugin(my_plugin)

    def test_a_short_run(tmp_path):
        registry = registry_with(my_plugin, entry_points=False)  # this plugin, vlft's cpu backend and lora
        result = run(tiny_run_config(tmp_path, backend="mybackend", method="lora"), registry)
        assert (result.output / "adapter" / "adapter_model.safetensors").is_file()

Everything here builds on the embedded default (a small Qwen2.5-VL and the
synthetic product-inspection data), so a plugin's tests need no download and
a 2-step run takes seconds on a CPU.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pluggy

from vlft import hookspecs
from vlft.config import RunConfig, build_config
from vlft.policies import DataLoaderOptions
from vlft.registry import Registry, load_registry

__all__ = ["check_plugin", "registry_with", "run", "tiny_dataset", "tiny_run_config"]

UNKNOWN = "vlft-testing-unknown-name"  # a backend, method and objective name no plugin owns
# what a run needs besides the plugin under test: a backend to run a method on, a method to run a backend with,
# the model families and the default objective (sft)
BUILTINS_FOR_RUNS = ("cpu", "lora", "models", "sft")


def registry_with(*plugins: Any, entry_points: bool = True) -> Registry:
    """A fresh registry holding ``plugins`` (modules, or objects with ``@hookimpl`` methods).

    ``entry_points=True``: the installed plugins too, as ``vlft`` itself would
    load them (a plugin passed here that is also installed is registered once).
    ``entry_points=False``: only ``plugins``, plus vlft's CPU reference backend,
    LoRA, the built-in model families and ``sft``, so a method plugin has a backend to
    run on, a backend plugin a method, and both a model. Every call builds a new plugin manager: tests do not leak into
    each other or into the process-wide registry.
    """
    import importlib

    from vlft.plugins import builtin_plugins, serve_checkout

    builtins: list = []
    if not entry_points:
        # the built-ins by their modules, as the registry finds them (from the checkout where not installed)
        serve_checkout()
        builtins = [importlib.import_module(module) for name, module in builtin_plugins() if name in BUILTINS_FOR_RUNS]
    registry = load_registry(load_entry_points=entry_points,
                             plugins=tuple(m for m in builtins if all(m is not p for p in plugins)))
    for plugin in plugins:
        if not registry.pm.is_registered(plugin):
            registry.pm.register(plugin, name=getattr(plugin, "__name__", None) or type(plugin).__name__)
    return registry.refresh()  # collects names again: two plugins offering one name fail here


def tiny_dataset(folder: str | Path, n_train: int = 16, n_val: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """Write a small product-inspection data set under ``folder``/data; return (train.jsonl, val.jsonl)."""
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(Path(folder) / "data", n_train=n_train, n_val=n_val, seed=seed)
    return ds.train, ds.val


def tiny_run_config(folder: str | Path, **overrides: Any) -> RunConfig:
    """A checked ``RunConfig`` for a 2-step run on the embedded model and ``tiny_dataset(folder)``.

    The run writes to ``folder``/run; evaluation is 2 samples of 4 tokens and no
    checkpoint is kept, so the run takes seconds. ``overrides`` are config
    fields (``backend="mybackend"``, ``method="mymethod"``, ``adapter={"r": 4}``).
    """
    train, val = tiny_dataset(folder)
    values: dict[str, Any] = dict(
        backend="cpu", method="lora", data=str(train), val_data=str(val), output=str(Path(folder) / "run"),
        steps=2, batch_size=2, eval_every=0, eval_samples=2, max_new_tokens=4, save_every=0, log_every=1,
    )
    values.update(overrides)
    return build_config({}, values)  # the same checks as flags on the command line


def run(config: RunConfig, registry: Registry | None = None, progress: bool = False):
    """Run ``config`` as ``vlft run`` would (dry run included) with ``registry``; return its result.

    The result has ``output`` (the run folder), ``plan`` (every resolved policy),
    ``before``/``after`` (evaluations) and ``metrics``.
    """
    from vlft.commands.run import execute

    return execute(registry if registry is not None else load_registry(), config, progress=progress)


def _placeholder_arguments() -> dict[str, Any]:
    """A value for every hook parameter, naming nothing any plugin owns."""
    return {
        "backend": UNKNOWN, "method": UNKNOWN, "objective": UNKNOWN, "config": RunConfig(), "model_config": None,
        "model": None, "targets": [], "path": "", "trainable": False, "seed": 0, "deterministic": False, "device": None,
        "attention": None, "options": DataLoaderOptions(), "family": None, "target_parameters": [], "rewards": {},
    }


def check_plugin(plugin: Any) -> None:
    """Check ``plugin`` against vlft's hook specs; raise ``AssertionError`` naming each problem.

    - every ``vlft_*`` hook it implements exists, with parameters the spec has
      (pluggy's own check: a misspelt hook or parameter name fails here);
    - asked about a backend, method or objective it does not own, every hook answers
      None and leaves the ``DataLoaderOptions`` it is given untouched (a
      wrapper, ``hookwrapper=True`` or ``wrapper=True``, yields once and passes
      the result on unchanged). Hooks marked ``@hookimpl_for(NAME)`` pass
      this by construction; explicit ``if backend != NAME`` guards are checked
      the same way.
    """
    pm = load_registry(load_entry_points=False).pm
    pm.register(plugin, name="plugin-under-test")
    pm.check_pending()  # raises PluginValidationError for a hookimpl without a matching spec
    problems = []
    for name, spec in inspect.getmembers(hookspecs, inspect.isfunction):
        params = inspect.signature(spec).parameters
        if not name.startswith("vlft_") or not ({"backend", "method", "objective"} & set(params)):
            continue
        for impl in getattr(pm.hook, name).get_hookimpls():
            args = _placeholder_arguments()
            answer = impl.function(**{p: args[p] for p in impl.argnames})
            if impl.hookwrapper or impl.wrapper:
                problems += _wrapper_problems(name, answer, old_style=impl.hookwrapper)
            elif answer is not None:
                problems.append(f"{name} answered {answer!r} for a name it does not own; return None instead")
            if name == "vlft_dataloader_options" and args["options"] != DataLoaderOptions():
                problems.append(f"{name} changed the options of a backend it does not own: {args['options']}")
    assert not problems, "plugin answers for names it does not own:\n  " + "\n  ".join(problems)


def _wrapper_problems(name: str, generator: Any, old_style: bool) -> list[str]:
    """A wrapper asked about a name it does not own must yield once and pass the inner result on unchanged."""
    inner = object()  # what the other plugins answered, as far as the wrapper can tell
    try:
        next(generator)
    except StopIteration:
        return [f"{name} is a wrapper that returned without yielding; yield once, even for names it does not own"]
    outcome = pluggy.Result(inner, None)
    try:
        generator.send(outcome if old_style else inner)
    except StopIteration as stop:
        changed = outcome.get_result() is not inner if old_style else stop.value is not inner
        return [f"{name} changed the result for a name it does not own; pass it on unchanged"] if changed else []
    generator.close()
    return [f"{name} is a wrapper that yielded more than once"]
