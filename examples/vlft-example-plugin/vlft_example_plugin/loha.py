"""A method plugin: LoHa through PEFT (``vlft run --method loha``).

LoHa (low-rank Hadamard product, from LyCORIS) learns each weight update as
the element-wise product of two low-rank products, (A1 B1) * (A2 B2): with
rank r it can reach rank r**2 for the parameters of a rank-2r LoRA.

A method plugin answers six hooks for its own name: its name
(``vlft_methods``), its defaults, applying it, and saving, loading and
merging the adapter. Saving goes through PEFT, so the adapter loads with plain
``peft.PeftModel.from_pretrained``.

Imports inside functions: peft (and with it transformers and torch) loads only when an adapter is
applied or loaded; ``vlft plugins`` loads this module just to list it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vlft import AdapterDefaults, ConfigError, MethodInfo, hookimpl

NAME = "loha"
# LoHa starts with one factor of each product at zero, so it moves slowly at LoRA's 2e-4: on the
# embedded default (200 steps of 4) the loss went 6.8 -> 6.5 at 2e-4, 2.6 at 1e-3, 0.65 at 3e-3
LR = 3e-3


@dataclass
class LoHaOptions:
    """The hyper-parameters users may set with ``--adapter-opt KEY=VALUE``; ``help`` shows in ``vlft methods``."""

    r: int = field(default=8, metadata={"help": "Rank of each of the two low-rank products."})
    alpha: int = field(default=16, metadata={"help": "Scale: the update is multiplied by alpha / r."})
    rank_dropout: float = field(
        default=0.0, metadata={"help": "In training, dropout on the rows (outputs) of each update."}
    )
    module_dropout: float = field(default=0.0, metadata={"help": "Probability of skipping a whole adapted layer."})


def options(adapter: dict) -> LoHaOptions:
    """The user's ``--adapter-opt`` values as ``LoHaOptions``; a wrong key or type is a ``ConfigError`` naming it."""
    fields = {f.name: f for f in dataclasses.fields(LoHaOptions)}
    values = {}
    for key, value in adapter.items():
        if key not in fields:
            raise ConfigError(f"method {NAME}: unknown option {key}; valid: {', '.join(fields)}")
        kind = type(fields[key].default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or kind(value) != value:
            raise ConfigError(f"method {NAME}: option {key} expects {kind.__name__}, got {value!r}")
        values[key] = kind(value)
    return LoHaOptions(**values)


@hookimpl
def vlft_methods():
    return [MethodInfo(NAME, "LoHa (PEFT): Hadamard product of two low-rank updates; rank r**2 for 2r's parameters")]


@hookimpl
def vlft_adapter_defaults(method, config):
    if method != NAME:
        return None
    chosen = options(config.adapter)  # checking here makes a bad --adapter-opt fail before anything loads
    return AdapterDefaults(
        method=NAME,
        lr=LR,
        hyperparameters=dataclasses.asdict(chosen),
        help={f.name: f.metadata["help"] for f in dataclasses.fields(LoHaOptions)},
        # leaf names of the linear layers to adapt; vlft turns them into full names in the chosen blocks
        text_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        vision_modules=("qkv", "proj"),
        default_targets="both",
    )


@hookimpl
def vlft_apply_adapter(method, model, targets, config):
    if method != NAME:
        return None
    from peft import LoHaConfig, get_peft_model  # imported here: listing plugins must stay cheap

    # targets are full module names, so PEFT adapts exactly those and nothing else
    return get_peft_model(
        model, LoHaConfig(target_modules=list(targets), **dataclasses.asdict(options(config.adapter)))
    )


@hookimpl
def vlft_save_adapter(method, model, path):
    if method != NAME:
        return None
    model.save_pretrained(str(path), safe_serialization=True)  # adapter_config.json + adapter_model.safetensors
    return True


@hookimpl
def vlft_load_adapter(method, model, path, trainable):
    if method != NAME:
        return None
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)


@hookimpl
def vlft_merge_adapter(method, model):
    if method != NAME:
        return None
    return model.merge_and_unload()
