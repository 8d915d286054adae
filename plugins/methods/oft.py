"""OFT: orthogonal fine-tuning, rotating a layer's input features (``peft.OFTConfig``).

Rotations keep the norms of the features they act on, which suits the
vision encoder. Blocks use the Cayley-Neumann parametrisation (PEFT's
default), which avoids a matrix inverse per step.

Imports inside functions: peft (and with it transformers and torch) loads only when an adapter is
applied, loaded or merged; `vlft plugins` imports every method plugin just to list it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vlft import AdapterDefaults, ConfigError, MethodInfo, hookimpl

from . import _peft

NAME = "oft"
# Larger blocks rotate more features together: on the embedded model 64 reached 59.5% exact match
# where 32 reached 27% (same lr and steps); 64 also divides Qwen2.5-VL-7B's widths (1280, 3584).
BLOCK_SIZE_CANDIDATES = (64, 32, 16, 8, 4, 2)


@dataclass
class OftOptions:
    oft_block_size: int = field(
        default=0,
        metadata={
            "help": "Size of each orthogonal block; 0 picks the largest of 64, 32, 16, 8, 4, 2 "
            "that divides every target's input width."
        },
    )
    use_cayley_neumann: bool = field(default=True, metadata={"help": "Cayley-Neumann parametrisation (faster)."})
    num_cayley_neumann_terms: int = field(default=5, metadata={"help": "Terms of the Neumann series."})
    coft: bool = field(default=False, metadata={"help": "Constrained OFT: keep rotations within eps of identity."})
    eps: float = field(default=6e-5, metadata={"help": "The COFT constraint radius."})
    block_share: bool = field(default=False, metadata={"help": "Share one block across a layer."})
    module_dropout: float = field(default=0.0, metadata={"help": "Probability of dropping a whole block."})


@hookimpl
def vlft_methods():
    return [MethodInfo(NAME, "OFT (PEFT): orthogonal block rotations, Cayley-Neumann; suits the vision encoder")]


@hookimpl
def vlft_adapter_defaults(method, config):
    if method != NAME:
        return None
    options = _peft.options_from(OftOptions, config.adapter, NAME)
    return AdapterDefaults(
        method=NAME,
        lr=1e-4,
        hyperparameters=dataclasses.asdict(options),
        help=_peft.help_of(OftOptions),
        text_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        vision_modules=("qkv", "proj"),
        default_targets="both",
        notes=["oft_block_size 0 means: chosen per model, the largest that divides every target's width"],
    )


def choose_block_size(model, targets, asked: int) -> int:
    """The block size: ``asked`` if it divides every target's input width, else the largest that does."""
    widths = {}
    modules = dict(model.named_modules())
    for name in targets:
        widths[name] = modules[name].in_features
    if asked:
        bad = [f"{n} ({w})" for n, w in widths.items() if w % asked]
        if bad:
            raise ConfigError(
                f"oft_block_size={asked} does not divide the input width of: {', '.join(bad[:5])}"
                + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                + "; choose a block size that divides them, or 0 to let vlft choose"
            )
        return asked
    for size in BLOCK_SIZE_CANDIDATES:
        if all(w % size == 0 for w in widths.values()):
            return size
    raise ConfigError(
        "no OFT block size in "
        + ", ".join(map(str, BLOCK_SIZE_CANDIDATES))
        + " divides every target's input width ("
        + ", ".join(sorted({str(w) for w in widths.values()}))
        + "); adapt fewer modules with --targets, or use another method"
    )


@hookimpl
def vlft_apply_adapter(method, model, targets, config, target_parameters, family):
    if method != NAME:
        return None
    if target_parameters:  # never asked for (OFT's defaults leave target_experts off); refuse rather than drop
        raise ConfigError(f"method {NAME} does not adapt fused expert weights ({target_parameters[0]}, ...)")
    from peft import OFTConfig, get_peft_model

    options = _peft.options_from(OftOptions, config.adapter, NAME)
    block = choose_block_size(model, targets, options.oft_block_size)
    kwargs = dataclasses.asdict(options)
    kwargs["oft_block_size"] = block
    with _peft.quiet_wrapping():
        return get_peft_model(
            model,
            OFTConfig(
                r=0,
                target_modules=list(targets),
                modules_to_save=_peft.modules_to_save(model, config, family),
                **kwargs,
            ),
        )


# saving, loading and merging are PEFT's own, the same for every PEFT method
vlft_save_adapter, vlft_load_adapter, vlft_merge_adapter = _peft.io_hooks(NAME)
