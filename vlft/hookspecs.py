"""The hooks a vlft plugin may implement.

Third-party plugins register through the ``vlft`` entry-point group; the built-ins register directly
(``vlft/plugins.py``).
A backend plugin answers only for the backend names it owns and returns
None for others; a method plugin likewise for its method names. Hooks marked
*first answer wins* are ``firstresult``: implement them with
``tryfirst=True`` to refine one concern of another plugin's backend (for
example a faster attention for ``ascend``) without replacing the rest.

All hooks are called with keyword arguments. They are called at set-up; the
training step calls none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # annotations only: importing this module loads neither torch nor click
    from pathlib import Path

    import click
    import torch
    import transformers

    from vlft.config import RunConfig
    from vlft.contracts.backend import (
        BackendInfo,
        DeviceCapacity,
        DeviceSetup,
        DoctorCheck,
        KernelPatch,
        MemoryStats,
        ProbeResult,
    )
    from vlft.contracts.family import FamilyReader, ModelFamily
    from vlft.contracts.method import AdapterDefaults, MethodInfo
    from vlft.contracts.objective import Objective, ObjectiveInfo, Reward
    from vlft.contracts.scorer import Scorer
    from vlft.contracts.sinks import MetricSink
    from vlft.policies import (
        AttentionPolicy,
        DataLoaderOptions,
        DistributedOptions,
        PrecisionPolicy,
    )

hookspec = pluggy.HookspecMarker("vlft")
hookimpl = pluggy.HookimplMarker("vlft")


# -- names -------------------------------------------------------------------


@hookspec
def vlft_backends() -> list[BackendInfo]:
    """Return a list of ``BackendInfo`` for the backends this plugin offers.

    Every plugin's answer is collected; two plugins offering one name is an error.
    """
    ...


@hookspec
def vlft_methods() -> list[MethodInfo]:
    """Return a list of ``MethodInfo`` for the adapter methods this plugin offers.

    Every plugin's answer is collected; two plugins offering one name is an error.
    """
    ...


# -- backends ----------------------------------------------------------------


@hookspec
def vlft_model_families() -> list[ModelFamily]:
    """Return a list of ``ModelFamily`` for the model families this plugin offers.

    Every plugin's answer is collected: ``vlft plugins`` lists them, ``--model embedded:<name>`` looks a
    family up by its name, and a checkpoint belongs to the first family whose ``model_types`` holds its
    ``config.model_type`` (asked once at plan time, kept in the ``RunPlan``), the error for one no family
    owns naming them all. Plugins are asked last-registered first: a plugin takes over a family another
    offers (the same name, or the same model type) by registering after it or with ``tryfirst=True``.
    """
    ...


@hookspec
def vlft_family_readers() -> list[FamilyReader]:
    """Return a list of ``FamilyReader`` for the checkpoints this plugin reads a family from itself.

    Asked at plan time only for a checkpoint whose ``model_type`` no offered ``ModelFamily`` owns (so a family
    plugin always overrides a reader): each reader's ``read(model_config, path)`` in turn, last-registered
    plugin first; the first family read is the checkpoint's, kept in the ``RunPlan``. ``vlft plugins`` lists
    the readers.
    """
    ...


@hookspec(firstresult=True)
def vlft_default_model_family() -> str | None:
    """Return the name of the model family whose tiny model is the embedded default (``vlft run`` with no
    ``--model``, ``--model embedded``), or None.

    The family must offer a tiny model (``tiny``). First answer wins: a plugin can make another
    family the default with ``tryfirst=True``.
    """
    ...


@hookspec
def vlft_bundled_model_configs() -> dict[str, Path]:
    """Return ``{name: folder}`` of weightless planning configs this plugin ships.

    Each folder holds a ``config.json`` (and the preprocessor configs) of a public checkpoint, so
    ``vlft run --model NAME --dry-run`` plans it offline (``--model NAME`` without ``--dry-run`` says where
    to put the weights). Every plugin's answer is collected; the first plugin to offer a name wins.
    """
    ...


@hookspec(firstresult=True)
def vlft_probe_backend(backend: str) -> ProbeResult | None:
    """Return a ``ProbeResult``: can ``backend`` run here, and if not, why not.

    First answer wins. Must never raise, and a plugin module must import
    nothing heavy (no vendor extension) at module import: probe inside here.
    """
    ...


@hookspec(firstresult=True)
def vlft_setup_device(backend: str, config: RunConfig) -> DeviceSetup | None:
    """Prepare the device for this process and return a ``DeviceSetup``.

    Sets the current device for the local rank (``config.local_rank``) and
    any environment the device needs. First answer wins.
    """
    ...


@hookspec(firstresult=True)
def vlft_attention_implementation(
    backend: str, config: RunConfig, model_config: transformers.PretrainedConfig
) -> AttentionPolicy | None:
    """Return an ``AttentionPolicy`` (per tower) for ``backend``.

    ``config.attn`` carries the user's request (None for the default).
    First answer wins.
    """
    ...


@hookspec(firstresult=True)
def vlft_precision_policy(backend: str, config: RunConfig) -> PrecisionPolicy | None:
    """Return a ``PrecisionPolicy``: parameter dtype, autocast dtype and loss scaling.

    ``config.precision`` is "auto" or the user's choice; a backend that
    cannot honour the choice raises ``ConfigError`` saying why. First answer wins.
    """
    ...


@hookspec
def vlft_dataloader_options(backend: str, config: RunConfig, options: DataLoaderOptions) -> None:
    """Adjust ``options`` (a ``DataLoaderOptions``) in place for ``backend``.

    Every plugin is called, so several may add to it (the owner first; use
    ``trylast`` to refine after it).
    """
    ...


@hookspec(firstresult=True)
def vlft_distributed_options(backend: str, config: RunConfig) -> DistributedOptions | None:
    """Return ``DistributedOptions``: process-group backend, timeout and environment, and whether
    ``--shard fsdp`` (FSDP2) works on that process group (``fsdp``, ``fsdp_reason``, ``sum_reductions``).

    Also asked before torchrun starts when sharding is requested, so a backend without it is refused
    before any process starts. First answer wins.
    """
    ...


@hookspec
def vlft_seed(backend: str, seed: int, deterministic: bool) -> None:
    """Seed the device's generators and, when ``deterministic``, switch on deterministic kernels.

    The core has already seeded Python, NumPy and torch's CPU generator.
    Every plugin is called; each acts only for backends it owns.
    """
    ...


@hookspec(firstresult=True)
def vlft_memory_reader(backend: str, device: torch.device) -> Callable[[], MemoryStats] | None:
    """Return a zero-argument callable giving ``MemoryStats`` for ``device``.

    Resolved once at set-up, so reports read memory without calling hooks.
    First answer wins.
    """
    ...


@hookspec(firstresult=True)
def vlft_device_capacity(backend: str, config: RunConfig) -> DeviceCapacity | None:
    """Return a ``DeviceCapacity``: the memory of this process's device (``config.local_rank``).

    Called once before any weight is loaded, for the memory plan; it may be
    called where the device is absent (a dry run): answer
    ``DeviceCapacity(None, ...)`` then, never raise. First answer wins.
    """
    ...


@hookspec
def vlft_patch_model(
    backend: str, model: torch.nn.Module, config: RunConfig, attention: AttentionPolicy, family: ModelFamily
) -> list[str] | None:
    """Rewrite parts of a loaded model that ``backend`` cannot run as they are.

    ``attention`` is the resolved ``AttentionPolicy`` the model was loaded with; ``family`` is the model's
    ``ModelFamily``: its module paths (``towers.vision``, ...) say where each tower is, so a patch never
    guesses them from module names.

    Return a list of one-line descriptions of what was patched (or None).
    Every plugin is called.
    """
    ...


@hookspec
def vlft_kernel_patches(
    backend: str, config: RunConfig, model_config: transformers.PretrainedConfig, family: ModelFamily | None
) -> list[KernelPatch] | None:
    """Return the ``KernelPatch`` es ``backend`` offers for this model: each faster kernel with what it
    replaces, why, its condition and whether it holds here (and why not).

    Asked once at plan time (dry runs too, where the device may be absent: never raise, decline with the
    reason); ``--kernels`` chooses among the answers, and the chosen patches' ``apply`` run once on the loaded
    base model. ``family`` gives the module paths (``kernels.vision_stem``, ``kernels.targets``). Every plugin is
    called; each answers for backends it owns (a third party may add patches to another's backend).
    """
    ...


# -- adapter methods -----------------------------------------------------------


@hookspec(firstresult=True)
def vlft_adapter_defaults(method: str, config: RunConfig) -> AdapterDefaults | None:
    """Return ``AdapterDefaults`` for ``method``: hyper-parameters, learning rate, target module names.

    ``config.adapter`` holds the user's overrides: check them against the
    method's options and raise ``ConfigError`` naming an unknown or ill-typed
    one. First answer wins.
    """
    ...


@hookspec(firstresult=True)
def vlft_apply_adapter(
    method: str,
    model: torch.nn.Module,
    targets: list[str],
    config: RunConfig,
    target_parameters: list[str],
    family: ModelFamily,
) -> torch.nn.Module | None:
    """Wrap ``model`` with ``method``'s adapter on the module names ``targets``; return the adapted model.

    ``target_parameters`` are full names of fused 3-D expert weights (PEFT's ``target_parameters``); it is
    empty unless the method's ``AdapterDefaults.target_experts`` asked for them, so a method that never sets
    it may leave the argument out of its implementation. ``family`` is the model's ``ModelFamily`` (its
    module paths: ``towers.vision_mergers`` for ``--train-merger``, ...); a method that needs none may leave it out.

    Raise ``ConfigError`` when the method cannot adapt a target (say, no
    block size divides its width). First answer wins.
    """
    ...


@hookspec(firstresult=True)
def vlft_save_adapter(method: str, model: torch.nn.Module, path: str) -> bool | None:
    """Save the adapter so that ``peft.PeftModel.from_pretrained(base, path)`` loads it. First answer wins."""
    ...


@hookspec(firstresult=True)
def vlft_load_adapter(method: str, model: torch.nn.Module, path: str, trainable: bool) -> torch.nn.Module | None:
    """Load an adapter saved by ``vlft_save_adapter`` onto base ``model``; return the adapted model.

    Used by ``--resume`` (``trainable`` True) and by predict, eval and export. First answer wins.
    """
    ...


@hookspec(firstresult=True)
def vlft_merge_adapter(method: str, model: torch.nn.Module) -> torch.nn.Module | None:
    """Fold the adapter into the base weights; return the plain merged model. First answer wins."""
    ...


# -- objectives ----------------------------------------------------------------------------------------------


@hookspec
def vlft_objectives() -> list[ObjectiveInfo]:
    """Return a list of ``ObjectiveInfo`` for the training objectives this plugin offers (``--objective``):
    each one's name, one line, and the class of its options (``option(...)`` fields), from which ``vlft run``
    builds a flag and a config-file key per option.

    Every plugin's answer is collected; two plugins offering one name is an error.
    """
    ...


@hookspec(firstresult=True)
def vlft_objective(objective: str, config: RunConfig, options: Any, rewards: dict[str, Reward]) -> Objective | None:
    """Return the ``Objective`` for ``objective`` (what it reads, how it prepares batches, its loss and figures,
    what the memory plan counts), or None for a name this plugin does not offer.

    Asked once at plan time, before any data is read. ``options``: an instance of the options class its
    ``ObjectiveInfo`` declares, built from the flags and the config file and checked (type, each option's
    ``check``, the class's ``__post_init__``); None where it declares none. ``config``: the rest of the run
    (``--init-adapter``, ``--max-new-tokens``, ...); raise ``ConfigError`` naming what does not fit.
    ``rewards``: every reward function the plugins offer (``vlft_rewards``, and each scorer of
    ``vlft_scorers``), by name, for an objective that scores generations (GRPO). An implementation leaves out
    the arguments it does not need. The training step calls the answer's methods and no hook. First answer
    wins.
    """
    ...


@hookspec
def vlft_rewards() -> list[Reward]:
    """Return a list of ``Reward`` for the reward functions this plugin offers (``--reward NAME[=ARGUMENT]``).

    Every plugin's answer is collected; two plugins offering one name is an error.
    """
    ...


@hookspec
def vlft_scorers() -> list[Scorer]:
    """Return a list of ``Scorer`` for the ways of scoring answers this plugin offers (``--scorer NAME`` on ``vlft
    run`` and ``vlft eval``: the before/after table, ``eval.json``, ``vlft report``).

    Every scorer is also a reward (``--reward NAME``): the core offers each as one beside the answers of
    ``vlft_rewards``. Every plugin's answer is collected; two plugins offering one name (a scorer, or a scorer
    and a reward) is an error.
    """
    ...


# -- logging -------------------------------------------------------------------


@hookspec(firstresult=True)
def vlft_metric_sink(name: str, config: RunConfig) -> Callable[[Path], MetricSink] | None:
    """For ``--report-to name``: return a factory that opens a ``MetricSink`` given the run folder.

    Answered by the plugin that offers the sink ``name`` (the built-in ``vlft.sinks`` answers
    ``tensorboard``); None for other names. Called once per name before any weight is loaded, so a
    missing package is reported at once: raise ``ConfigError`` saying what to install. The factory is
    called once, on rank 0, when the run folder exists; the training loop then calls only the sink's
    ``write(record)`` (the same dicts as ``metrics.jsonl``) and, at the end, ``close()``. First answer wins.
    """
    ...


# -- command line ---------------------------------------------------------------


@hookspec
def vlft_register_commands(cli: click.Group) -> None:
    """Add click commands to the ``vlft`` command group ``cli``. Every plugin is called."""
    ...


# -- diagnosis --------------------------------------------------------------------


@hookspec
def vlft_doctor_checks(backend: str) -> list[DoctorCheck] | None:
    """Return a list of ``DoctorCheck`` for ``backend``: what is installed, versions, devices, environment.

    Every plugin is called (a plugin may add checks to another's backend);
    answer None for backends you know nothing about. Must never raise, and
    like probing it imports vendor extensions only inside the call.
    """
    ...
