"""``--sequence-parallel N`` checked against the processes, the objective, the attention and the text model, once
at plan time (``training.sequence`` splits the sequences): what it can split, or a refusal with the reason."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from vlft.errors import ConfigError
from vlft.models.families import base_model, resolve_module

# what a transformers text model takes besides per-token inputs the split cuts (embeddings, positions, the mask)
PLAIN_INPUTS = {
    "self",
    "input_ids",
    "attention_mask",
    "position_ids",
    "cache",
    "past_key_values",
    "inputs_embeds",
    "use_cache",
    "cache_position",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "kwargs",
    "args",
}
SPLIT_ATTENTION = ("sdpa", "eager", "vlft_segments_sdpa", "vlft_segments_eager")


@dataclass(frozen=True)
class SequencePlan:
    """How many processes split each sample's sequence (1: none), and over how many heads each attends."""

    size: int = 1
    heads: int = 0
    kv_heads: int = 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def describe(self) -> dict:
        return {"size": self.size, "heads_per_process": self.heads // self.size if self.size else 0}


def check_processes(config, objective) -> None:
    """What the launcher can check before any process starts: N divides the processes; the objective splits."""
    n = config.sequence_parallel
    if n == 1:
        return
    flag = f"--sequence-parallel {n}"
    if config.world_size % n or config.world_size < n:
        raise ConfigError(
            f"{flag} splits each sample over {n} processes, which must divide the {config.world_size} process(es) "
            f"this run has: start it with --nproc-per-node {n} (or a multiple of {n})"
        )
    if not objective.supervised:
        raise ConfigError(
            f"{flag}: --objective {objective.name} is not split yet (its reference pass and rollouts run whole "
            "sequences); train it without --sequence-parallel"
        )


def split_problem(n: int, model_config, family, skeleton, text_attention: str = "sdpa") -> str | None:
    """Why this model cannot split its sequences over ``n`` processes (None: it can)."""
    if text_attention not in SPLIT_ATTENTION:
        return f"the text attention '{text_attention}' takes no whole-row mask; the split runs on sdpa or eager"
    text_config = getattr(model_config, "text_config", model_config)
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    if heads % n or kv_heads % n:
        return (
            f"the text model's {heads} attention heads and {kv_heads} key-value heads must both divide by {n} "
            f"(each process attends with a share of them); use a divisor of {kv_heads}"
        )
    others = sorted({t for t in getattr(text_config, "layer_types", None) or () if t != "full_attention"})
    if others:
        return f"the text model has {', '.join(others)} layers; the split masks full causal attention only"
    text = resolve_module(base_model(skeleton), family.towers.decoder_layers.rpartition(".")[0])
    marked_inputs = family.sharding.marked_inputs if family.sharding is not None else {}
    marked = set(marked_inputs) | {n for rows in marked_inputs.values() for n in rows}
    extra = sorted(set(inspect.signature(type(text).forward).parameters) - PLAIN_INPUTS - marked)
    if extra:
        return (
            f"{family.name}'s text model takes {', '.join(extra)} beside its tokens, which the split does not cut "
            "(a family that declares them in Sharding.marked_inputs is split)"
        )
    return None


def plan_sequence_split(config, model_config, family, attention, objective, skeleton) -> SequencePlan:
    """``--sequence-parallel`` as this run can do it; ConfigError naming what stands in the way."""
    n = config.sequence_parallel
    if n == 1:
        return SequencePlan()
    check_processes(config, objective)
    problem = split_problem(n, model_config, family, skeleton, attention.text)
    if problem:
        raise ConfigError(f"--sequence-parallel {n}: {problem}; train without --sequence-parallel")
    text_config = getattr(model_config, "text_config", model_config)
    heads = int(text_config.num_attention_heads)
    return SequencePlan(n, heads, int(getattr(text_config, "num_key_value_heads", None) or heads))
