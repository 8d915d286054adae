"""vlft: fine-tune vision-language models with adapters, on any accelerator.

This module is the public plugin surface: a plugin imports what it needs from
``vlft`` alone. Everything else (``vlft.commands.run``, ``vlft.training.step``, ...) is
internal and may change between releases.

    from vlft import hookimpl, hookimpl_for, BackendInfo, ProbeResult, PrecisionPolicy

``hookimpl_for(NAME)`` marks a backend hook that answers only for ``NAME``
(None for every other backend), so a backend need not repeat the guard.

Importing it loads no torch and no vendor extension, so a plugin module that
imports it stays cheap to load (probing happens inside the hooks).

The contracts carry a version, ``PLUGIN_API``: a plugin may say which one it was written for
(``VLFT_PLUGIN_API = 3`` in its module), and docs/plugin-api-changes.md lists what changed between them.
"""

import importlib
from typing import TYPE_CHECKING

from vlft.backend import BackendHookimpl, hookimpl_for
from vlft.config import RunConfig, parse_attn
from vlft.contracts import PLUGIN_API, ContractChanged
from vlft.contracts.backend import (
    BackendInfo,
    DeviceCapacity,
    DeviceSetup,
    DoctorCheck,
    KernelPatch,
    MemoryStats,
    ProbeResult,
)
from vlft.contracts.family import (
    Chat,
    Experts,
    FamilyReader,
    ImageInputs,
    Kernels,
    Media,
    ModelFamily,
    Packing,
    Positions,
    Sharding,
    Targets,
    Tiny,
    Towers,
    VideoInputs,
    VisionWarmup,
    Written,
)
from vlft.contracts.method import AdapterDefaults, MethodInfo
from vlft.contracts.objective import (
    OWN,
    PER_STEP,
    SHARED,
    Average,
    Generation,
    Layout,
    Objective,
    ObjectiveInfo,
    PairedPreference,
    Passes,
    Prepared,
    Reward,
    Side,
    non_negative,
    option,
    positive,
)
from vlft.contracts.scorer import Scorer
from vlft.contracts.sinks import MetricSink
from vlft.data.processor_inputs import clip_arguments, processor_image_inputs, widened
from vlft.errors import BackendUnavailable, ConfigError, DataError, VlftError
from vlft.hookspecs import hookimpl
from vlft.policies import (
    AttentionPolicy,
    DataLoaderOptions,
    DistributedOptions,
    PrecisionPolicy,
)
from vlft.tokens import tokenize_pieces
from vlft.userspec import user_attribute
from vlft.version import __version__ as __version__  # re-exported: vlft.__version__

__all__ = [
    "PLUGIN_API",
    "AdapterDefaults",
    "AttentionPolicy",
    "BackendHookimpl",
    "BackendInfo",
    "BackendUnavailable",
    "Chat",
    "ConfigError",
    "ContractChanged",
    "DataError",
    "DataLoaderOptions",
    "DeviceCapacity",
    "DeviceSetup",
    "DistributedOptions",
    "DoctorCheck",
    "Experts",
    "FamilyReader",
    "ImageInputs",
    "KernelPatch",
    "Kernels",
    "Media",
    "MemoryStats",
    "MethodInfo",
    "MetricSink",
    "ModelFamily",
    "Objective",
    "ObjectiveInfo",
    "Packing",
    "Positions",
    "PrecisionPolicy",
    "ProbeResult",
    "Reward",
    "RunConfig",
    "Scorer",
    "Sharding",
    "Targets",
    "Tiny",
    "Towers",
    "VideoInputs",
    "VisionWarmup",
    "Written",
    "VlftError",
    "hookimpl",
    "hookimpl_for",
    "parse_attn",
    "processor_image_inputs",
    "clip_arguments",
    "widened",
    "tokenize_pieces",
    "user_attribute",
    # the objective contract (vlft/contracts/objective.py)
    "Average",
    "Generation",
    "Layout",
    "OWN",
    "PER_STEP",
    "PairedPreference",
    "Passes",
    "Prepared",
    "SHARED",
    "Side",
    "non_negative",
    "option",
    "positive",
    # the SFT layouts, for an objective that reads them further (loaded on first use: see __getattr__)
    "FormatProblem",
    "IGNORE_INDEX",
    "ROLE_ALIASES",
    "parse_record",
]

if TYPE_CHECKING:
    from vlft.data.formats import FormatProblem, parse_record
    from vlft.data.records import IGNORE_INDEX, ROLE_ALIASES

# Names from the data floor, loaded on first use: they bring PIL and the layout readers, and importing
# ``vlft`` stays cheap for a plugin module that needs none of them (PEP 562).
_LAZY = {
    "FormatProblem": "vlft.data.formats",
    "parse_record": "vlft.data.formats",
    "IGNORE_INDEX": "vlft.data.records",
    "ROLE_ALIASES": "vlft.data.records",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlft' has no attribute {name!r}")
