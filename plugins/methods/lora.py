"""LoRA: low-rank updates added to the frozen weights (``peft.LoraConfig``).

Imports inside functions: peft (and with it transformers and torch) loads only when an adapter is
applied, loaded or merged; `vlft plugins` imports every method plugin just to list it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vlft import AdapterDefaults, ConfigError, MethodInfo, hookimpl

from . import _peft

NAME = "lora"


@dataclass
class LoraOptions:
    r: int = field(default=32, metadata={"help": "Rank of the update matrices."})
    lora_alpha: int = field(default=64, metadata={"help": "Scale: the update is multiplied by alpha / r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the adapter's input."})
    use_rslora: bool = field(
        default=False,
        metadata={
            "help": "Scale by alpha / sqrt(r) (rank-stabilised LoRA), which keeps the update's size steady as r grows."
        },
    )
    use_dora: bool = field(
        default=False,
        metadata={
            "help": "DoRA: train each weight's magnitude apart from its "
            "direction (LoRA on the direction); slower per step."
        },
    )
    target_experts: bool = field(
        default=False,
        metadata={
            "help": "Also adapt a mixture-of-experts model's fused expert weights (PEFT target_parameters, rank r per "
            "expert); the router stays frozen. Needs lora_dropout 0 (PEFT refuses dropout there), which it "
            "then defaults to."
        },
    )


def _options(config) -> LoraOptions:
    options = _peft.options_from(LoraOptions, config.adapter, NAME)
    if options.target_experts:
        if "lora_dropout" not in config.adapter:
            options.lora_dropout = 0.0
        elif options.lora_dropout:
            raise ConfigError(
                f"method {NAME}: target_experts=true needs lora_dropout=0 (PEFT's target_parameters "
                f"cannot apply dropout to fused expert weights), got {options.lora_dropout}"
            )
    return options


@hookimpl
def vlft_methods():
    return [MethodInfo(NAME, "LoRA (PEFT): low-rank updates on text attention and the last vision blocks")]


@hookimpl
def vlft_adapter_defaults(method, config):
    if method != NAME:
        return None
    options = _options(config)
    notes = (
        ["target_experts: lora_dropout 0 on every target (PEFT's fused-expert LoRA takes no dropout)"]
        if options.target_experts and "lora_dropout" not in config.adapter
        else []
    )
    return AdapterDefaults(
        method=NAME,
        lr=2e-4,
        hyperparameters=dataclasses.asdict(options),
        help=_peft.help_of(LoraOptions),
        text_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        vision_modules=("qkv", "proj"),
        default_targets="both",
        target_experts=options.target_experts,
        notes=notes,
    )


@hookimpl
def vlft_apply_adapter(method, model, targets, config, target_parameters, family):
    if method != NAME:
        return None
    from peft import LoraConfig, get_peft_model

    kwargs = dataclasses.asdict(_options(config))
    kwargs.pop("target_experts")  # vlft's switch; the expert names arrive as target_parameters
    with _peft.quiet_wrapping():
        return get_peft_model(
            model,
            LoraConfig(
                target_modules=list(targets),
                target_parameters=list(target_parameters) or None,
                modules_to_save=_peft.modules_to_save(model, config, family),
                **kwargs,
            ),
        )


# saving, loading and merging are PEFT's own, the same for every PEFT method
vlft_save_adapter, vlft_load_adapter, vlft_merge_adapter = _peft.io_hooks(NAME)
