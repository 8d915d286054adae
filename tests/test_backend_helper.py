"""``hookimpl_for(NAME)``: backend hooks guarded once by the backend's name, for module and class plugins.

Each test registers its own small plugins in a fresh registry (``vlft.testing.registry_with`` with
``entry_points=False``: the plugin, vlft's ``cpu`` backend and ``lora``), so nothing leaks between tests.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pluggy
import pytest

from vlft import (
    AttentionPolicy,
    BackendInfo,
    DataLoaderOptions,
    PrecisionPolicy,
    ProbeResult,
    RunConfig,
    hookimpl,
    hookimpl_for,
)
from vlft.testing import check_plugin, registry_with

toy_hookimpl = hookimpl_for("toy")


class ToyBackend:
    """A class-instance plugin written with the helper; it counts the calls that reach its bodies."""

    def __init__(self):
        self.calls: list[str] = []

    @hookimpl
    def vlft_backends(self):
        return [BackendInfo("toy", "a toy backend", "cpu", priority=-5)]

    @toy_hookimpl
    def vlft_probe_backend(self, backend):
        self.calls.append(f"probe {backend}")
        return ProbeResult(True, reason="toy probe", device_count=1)

    @toy_hookimpl
    def vlft_precision_policy(self, backend, config):
        self.calls.append(f"precision {backend}")
        return PrecisionPolicy("fp32", reason="toy: fp32")

    @toy_hookimpl
    def vlft_dataloader_options(self, backend, config, options):
        self.calls.append(f"dataloader {backend}")
        options.num_workers = 3

    @hookimpl_for("toy")  # the marker built in place works as well as a module-level one
    def vlft_seed(self, backend, seed, deterministic):
        self.calls.append(f"seed {backend} {seed}")


MODULE_SOURCE = '''
"""A module plugin written with the helper, as a third party would write it."""
from vlft import BackendInfo, ProbeResult, hookimpl, hookimpl_for

NAME = "toy-module"
toy_module_hookimpl = hookimpl_for(NAME, "toy-module-2")  # one plugin, two backend names

@hookimpl
def vlft_backends():
    return [BackendInfo(n, "a toy module backend", "cpu", priority=-5) for n in (NAME, "toy-module-2")]

@toy_module_hookimpl
def vlft_probe_backend(backend):
    return ProbeResult(True, reason=f"toy module probe for {backend}", device_count=1)

@toy_module_hookimpl
def vlft_distributed_options(backend, config):
    return None  # the owner may answer None too: that is passed through
'''


def module_plugin(source: str = MODULE_SOURCE, name: str = "toy_module_plugin") -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


# -- answers for its own backend, None for the others -------------------------------------------------------


def test_a_class_plugin_answers_for_its_backend_and_none_for_others():
    toy = ToyBackend()
    registry = registry_with(toy, entry_points=False)
    assert "toy" in registry.backends and "cpu" in registry.backends
    assert registry.first("vlft_probe_backend", backend="toy").reason == "toy probe"
    # the cpu backend's own answer comes through: the toy plugin answered None
    assert registry.first("vlft_probe_backend", backend="cpu").reason != "toy probe"
    assert toy.vlft_probe_backend(backend="cuda") is None and toy.vlft_probe_backend("cuda") is None
    assert toy.calls == ["probe toy"], "the body ran for a backend the plugin does not own"


def test_every_plugin_hooks_run_only_for_the_owner():
    toy = ToyBackend()
    registry = registry_with(toy, entry_points=False)
    options = DataLoaderOptions()
    registry.hook.vlft_dataloader_options(backend="cpu", config=RunConfig(), options=options)
    assert options.num_workers == 0 and not toy.calls  # the cpu backend's choice, untouched by toy
    registry.hook.vlft_dataloader_options(backend="toy", config=RunConfig(), options=options)
    registry.hook.vlft_seed(backend="toy", seed=7, deterministic=False)
    registry.hook.vlft_seed(backend="cpu", seed=7, deterministic=False)
    assert options.num_workers == 3 and toy.calls == ["dataloader toy", "seed toy 7"]


def test_a_module_plugin_answers_for_each_name_it_owns():
    module = module_plugin()
    registry = registry_with(module, entry_points=False)
    assert registry.first("vlft_probe_backend", backend="toy-module").reason == "toy module probe for toy-module"
    assert registry.first("vlft_probe_backend", backend="toy-module-2").reason.endswith("toy-module-2")
    assert module.vlft_probe_backend("cpu") is None and module.vlft_probe_backend(backend="toy") is None


def test_the_hook_keeps_its_name_signature_and_docstring():
    def vlft_precision_policy(backend, config):
        """The doc."""

    marked = hookimpl_for("toy")(vlft_precision_policy)
    assert marked.__name__ == "vlft_precision_policy" and marked.__doc__ == "The doc."
    assert list(inspect.signature(marked).parameters) == ["backend", "config"]
    impl = registry_with(ToyBackend(), entry_points=False).hook.vlft_precision_policy.get_hookimpls()
    assert [i.argnames for i in impl if i.plugin_name == "ToyBackend"] == [("backend", "config")]


@pytest.mark.parametrize("make", [ToyBackend, module_plugin], ids=["class", "module"])
def test_check_plugin_passes_plugins_built_with_the_helper(make):
    check_plugin(make())


@pytest.mark.parametrize("name", ["vlft.builtin.cpu", "vlft_cuda", "vlft_ascend"])
def test_check_plugin_passes_the_converted_builtin_backends(name):
    check_plugin(importlib.import_module(name))


# -- hookimpl options survive ---------------------------------------------------------------------------


class FasterCpuAttention:
    """Refines one concern of a backend it does not own (the cpu reference), before the owner answers."""

    @hookimpl_for("cpu", tryfirst=True)
    def vlft_attention_implementation(self, backend, config, model_config):
        if config.attn:  # the user's --attn still wins
            return None
        return AttentionPolicy("eager", "sdpa", "faster-cpu-attention: sdpa for text")

    @toy_hookimpl(trylast=True)  # options on a module-level marker: a new marker, same names
    def vlft_dataloader_options(self, backend, config, options):
        options.reasons.append("refined after the owner")


def test_tryfirst_and_trylast_survive_and_take_effect():
    registry = registry_with(FasterCpuAttention(), ToyBackend(), entry_points=False)
    [impl] = [
        i for i in registry.hook.vlft_attention_implementation.get_hookimpls() if i.plugin_name == "FasterCpuAttention"
    ]
    assert impl.tryfirst and not impl.trylast
    policy = registry.first("vlft_attention_implementation", backend="cpu", config=RunConfig(), model_config=None)
    assert policy.reason == "faster-cpu-attention: sdpa for text"  # asked before the cpu backend itself
    asked = registry.first(
        "vlft_attention_implementation", backend="cpu", config=RunConfig(attn="sdpa"), model_config=None
    )
    assert asked.reason != "faster-cpu-attention: sdpa for text"  # it answered None: the owner answered
    options = DataLoaderOptions()
    registry.hook.vlft_dataloader_options(backend="toy", config=RunConfig(), options=options)
    assert options.num_workers == 3 and options.reasons == ["refined after the owner"]
    check_plugin(FasterCpuAttention())


class PrecisionWrappers:
    """Both kinds of pluggy wrapper, for the cpu backend only."""

    @hookimpl_for("cpu", wrapper=True)
    def vlft_precision_policy(self, backend, config):
        policy = yield
        policy.reason += "; wrapped"
        return policy

    @hookimpl_for("cpu", hookwrapper=True)
    def vlft_distributed_options(self, backend, config):
        outcome = yield
        outcome.force_result(None)  # an old-style wrapper may override the answer


def test_wrappers_are_guarded_and_pass_other_backends_through():
    registry = registry_with(PrecisionWrappers(), ToyBackend(), entry_points=False)
    impls = {i.plugin_name: i for i in registry.hook.vlft_precision_policy.get_hookimpls()}
    assert impls["PrecisionWrappers"].wrapper
    assert registry.first("vlft_precision_policy", backend="cpu", config=RunConfig()).reason.endswith("; wrapped")
    assert registry.first("vlft_precision_policy", backend="toy", config=RunConfig()).reason == "toy: fp32"
    assert registry.hook.vlft_distributed_options(backend="cpu", config=RunConfig()) is None
    assert registry.hook.vlft_distributed_options(backend="toy", config=RunConfig()) is None  # toy answers none
    check_plugin(PrecisionWrappers())


def test_a_wrapper_that_alters_other_backends_fails_check_plugin():
    class Meddling:
        @hookimpl(wrapper=True)
        def vlft_precision_policy(self, backend, config):
            yield
            return PrecisionPolicy("fp16", reason="meddling")

    with pytest.raises(AssertionError, match="vlft_precision_policy changed the result"):
        check_plugin(Meddling())


# -- mistakes are still caught --------------------------------------------------------------------------------


def test_a_misspelt_hook_still_fails_check_plugin():
    class Misspelt:
        @toy_hookimpl
        def vlft_probe_backnd(self, backend):
            return ProbeResult(True)

    with pytest.raises(pluggy.PluginValidationError, match="vlft_probe_backnd"):
        check_plugin(Misspelt())
    with pytest.raises(pluggy.PluginValidationError, match="vlft_probe_backnd"):
        check_plugin(module_plugin(MODULE_SOURCE.replace("def vlft_probe_backend", "def vlft_probe_backnd")))


def test_a_misspelt_parameter_fails_at_import():
    with pytest.raises(TypeError, match="vlft_setup_device has no 'backend' parameter"):

        @toy_hookimpl
        def vlft_setup_device(backnd, config):
            return None


def test_a_parameter_pluggy_does_not_know_still_fails_check_plugin():
    class ExtraParameter:
        @toy_hookimpl
        def vlft_probe_backend(self, backend, device_index):
            return ProbeResult(True)

    with pytest.raises(pluggy.PluginValidationError, match="device_index"):
        check_plugin(ExtraParameter())


def test_hooks_without_a_backend_and_bad_options_are_refused():
    with pytest.raises(TypeError, match="vlft_backends has no 'backend' parameter: .* @hookimpl"):

        @toy_hookimpl
        def vlft_backends():
            return []

    with pytest.raises(TypeError, match="tryfrist"):
        hookimpl_for("toy", tryfrist=True)
    with pytest.raises(TypeError, match="backend names"):
        hookimpl_for()
    with pytest.raises(TypeError, match="not a generator function"):

        @hookimpl_for("toy", wrapper=True)
        def vlft_seed(backend, seed, deterministic):
            return None


# -- the old explicit style still works -------------------------------------------------------------------------


class OldStyle:
    """A plugin written before the helper: ``@hookimpl`` and an explicit guard in every hook."""

    @hookimpl
    def vlft_backends(self):
        return [BackendInfo("old", "an old-style backend", "cpu", priority=-5)]

    @hookimpl
    def vlft_probe_backend(self, backend):
        if backend != "old":
            return None
        return ProbeResult(True, reason="old-style probe")

    @hookimpl(tryfirst=True)
    def vlft_precision_policy(self, backend, config):
        if backend != "old":
            return None
        return PrecisionPolicy("fp32", reason="old-style precision")


def test_the_old_explicit_style_still_works_beside_the_helper():
    registry = registry_with(OldStyle(), ToyBackend(), entry_points=False)
    assert registry.first("vlft_probe_backend", backend="old").reason == "old-style probe"
    assert registry.first("vlft_probe_backend", backend="toy").reason == "toy probe"
    assert registry.first("vlft_precision_policy", backend="old", config=RunConfig()).reason == "old-style precision"
    assert registry.first("vlft_precision_policy", backend="toy", config=RunConfig()).reason == "toy: fp32"
    check_plugin(OldStyle())


def test_an_old_style_plugin_that_forgets_its_guard_still_fails_check_plugin():
    class Forgetful(OldStyle):
        @hookimpl
        def vlft_probe_backend(self, backend):
            return ProbeResult(True, reason="answers for everyone")

    with pytest.raises(AssertionError, match="vlft_probe_backend answered"):
        check_plugin(Forgetful())
