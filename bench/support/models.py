"""The model sizes the groups run on, and the models built from them through vlft: base, adapted, frozen."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from bench.support.env import TARGETS, VISION_LAST_N, BenchEnv


def wide_recipe() -> dict:
    """The embedded recipe made wider, so that compute (not Python) dominates a step."""
    from vlft_models.qwen2_vl import RECIPE_2_5

    recipe = copy.deepcopy(RECIPE_2_5)
    recipe["text"].update(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2
    )
    # Qwen2.5-VL's 3-D rotary sections must add up to head_dim / 2 = 32
    recipe["text"]["rope_parameters"] = dict(recipe["text"]["rope_parameters"], mrope_section=[8, 12, 12])
    recipe["vision"].update(hidden_size=256, intermediate_size=688, num_heads=4, out_hidden_size=512)
    recipe["bench"] = "wide"  # its own cache folder
    return recipe


def qwen_vocab_recipe() -> dict:
    """The embedded recipe with Qwen2.5-VL's vocabulary width (151,936 rows of embedding and head; the tokenizer's
    440 ids among them): the head group's size, where the logits weigh what they weigh in a real step."""
    from vlft_models.qwen2_vl import RECIPE_2_5

    recipe = copy.deepcopy(RECIPE_2_5)
    recipe["padded_vocab_size"] = 151_936
    recipe["bench"] = "qwen-vocab"
    return recipe


def large_recipe() -> dict:
    """A third size for the memory plan's calibration: text hidden 1024, vision hidden 512 (about 80 M parameters)."""
    recipe = wide_recipe()
    recipe["text"].update(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4)
    recipe["vision"].update(hidden_size=512, intermediate_size=1376, num_heads=8, out_hidden_size=1024)
    recipe["bench"] = "large"
    return recipe


@dataclass
class ModelSize:
    """One model size: where it lies, its processor, sample encoder and config."""

    name: str
    path: str
    processor: Any
    encoder: Any
    model_config: Any

    family: Any = None  # the ModelFamily, resolved as a run resolves it

    def collator(self, **kw):
        from vlft.data.batching import collator_for

        return collator_for(self.processor, self.family, **kw)


def model_size(name: str, path: str, registry, family=None) -> ModelSize:
    """The model at ``path`` with its processor and encoder; its family as ``registry``'s plugins answer it
    (resolved as a run resolves it, so the encoder is the one a run uses) unless given."""
    from vlft.data.encoding import SampleEncoder
    from vlft.models.loading import load_processor, model_config_and_family

    model_config, resolved = model_config_and_family(path, registry)
    family = family or resolved
    processor = load_processor(path, family, registry)
    return ModelSize(name, path, processor, SampleEncoder(processor, family=family), model_config, family)


def plan_for(env: BenchEnv, size: ModelSize, method: str):
    from vlft.planning.plan import resolve_policies

    # after the device is set up, as a run does, so policies reading device properties see it
    return resolve_policies(
        env.registry, env.config(method=method), size.path, size.model_config, env.choice, family=size.family
    )


def load_base(env: BenchEnv, size: ModelSize):
    """The base model with the backend's attention, dtype and patches (still on the host)."""
    from vlft.models.loading import load_model

    plan = plan_for(env, size, "lora")
    model = load_model(size.path, plan.attention, plan.precision, family=size.family)
    env.registry.hook.vlft_patch_model(
        backend=env.backend, model=model, config=plan.config, attention=plan.attention, family=plan.family
    )
    return model


def targets_for(env: BenchEnv, size: ModelSize, model, method: str = "lora") -> list[str]:
    from vlft.models.families import family_of_model
    from vlft.models.targets import select_targets

    plan = plan_for(env, size, method)
    family = family_of_model(model, env.registry)
    return select_targets(model, plan.adapter, TARGETS, VISION_LAST_N, family).modules


def adapted_model(env: BenchEnv, size: ModelSize, method: str, seed: int = 0):
    """Base model + ``method``'s adapter on vlft's default targets, through the method plugin, on the device."""
    from vlft.training.step import seed_everything

    model = load_base(env, size)
    plan = plan_for(env, size, method)
    targets = targets_for(env, size, model, method)
    seed_everything(seed)
    adapted = env.registry.first(
        "vlft_apply_adapter",
        method=method,
        model=model,
        targets=targets,
        config=plan.config,
        target_parameters=[],
        family=plan.family,
    )
    return adapted.to(env.device), plan


def perturb_adapter(model, seed: int = 0, scale: float = 0.05) -> None:
    """Move the adapter away from its identity start, so merging has something to fold in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))


class FrozenBase(torch.nn.Module):
    """The "no adapter" variant: every weight frozen, one trainable scalar gain.

    A step with nothing trainable would skip backward altogether and measure
    only a forward pass. Instead a single scalar gain multiplies the hidden
    states entering the first vision block an adapter would touch, so
    backward propagates activation gradients through exactly the layers
    an adapter's backward traverses (that block onward, and the whole text
    model), but computes no weight gradient; the optimizer steps one scalar.
    This is the floor every adapter method stands on.
    """

    def __init__(self, model, first_block: int):
        super().__init__()
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        self.gain = torch.nn.Parameter(torch.ones(()))
        block = model.model.visual.blocks[first_block]
        block.register_forward_pre_hook(self._scale, with_kwargs=True)

    def _scale(self, module, args, kwargs):
        if args:
            return (args[0] * self.gain.to(args[0].dtype), *args[1:]), kwargs
        kwargs = dict(kwargs, hidden_states=kwargs["hidden_states"] * self.gain.to(kwargs["hidden_states"].dtype))
        return args, kwargs

    def forward(self, **inputs):
        return self.model(**inputs)


def frozen_model(env: BenchEnv, size: ModelSize):
    model = load_base(env, size)
    targets = targets_for(env, size, model)
    first = min(int(t.split("visual.blocks.")[1].split(".")[0]) for t in targets if "visual.blocks." in t)
    return FrozenBase(model, first).to(env.device)
