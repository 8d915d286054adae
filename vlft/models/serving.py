"""Will vLLM serve this adapter as it is? Its tensor names checked against the model, its features against
what vLLM's LoRA loader takes.

vLLM's loader (``vllm/lora/utils.py`` ``parse_fine_tuned_lora_name``) strips a leading ``base_model.model.``,
maps the rest through the model's own ``hf_to_vllm_mapper`` (for the Qwen VL models:
``model.language_model.`` -> ``language_model.model.``, ``model.visual.`` -> ``visual.``), and takes only
``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (and ``lora_embedding_A/B``). Its ``PEFTHelper``
refuses ``modules_to_save`` and DoRA (``use_dora``); rsLoRA is read (alpha / sqrt(r)). Adapters on the
vision tower or the merger are applied only with ``--enable-tower-connector-lora`` (vLLM PR #26674);
earlier releases ignored them silently. PEFT's own names (transformers' module paths under
``base_model.model.``) are what that loader expects, so vlft writes them unchanged and checks them here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from vlft.models.loading import model_config_and_family

PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


@dataclass
class ServingCheck:
    modules: list[str] = field(default_factory=list)  # adapted modules, as the model names them
    vision: list[str] = field(default_factory=list)  # those on the vision side (tower, merger)
    missing: list[str] = field(default_factory=list)  # names that are no linear layer of the model
    blockers: list[str] = field(default_factory=list)  # why vLLM's loader would refuse the adapter

    @property
    def servable(self) -> bool:
        return not self.blockers and not self.missing

    def lines(self) -> list[str]:
        """What a user serving with vLLM needs to know, one point a line."""
        if self.missing:
            return [
                f"vLLM: {len(self.missing)} adapter name(s) match no linear layer of the base model (e.g. "
                f"{self.missing[0]}); was the adapter trained on another model?"
            ]
        if self.blockers:
            return [
                f"vLLM will refuse this adapter: {'; '.join(self.blockers)}. Serve the merged model instead "
                "(vlft export without --adapter-only)"
            ]
        out = [
            f"vLLM: {len(self.modules)} adapted modules, names as vLLM's LoRA loader takes them "
            "(base_model.model.<module>.lora_A/B.weight)"
        ]
        if self.vision:
            out.append(
                f"vLLM: {len(self.vision)} of them are in the vision tower or the merger: serve with "
                "`vllm serve BASE --enable-lora --enable-tower-connector-lora` (vLLM with PR #26674), "
                "or merge (vlft export without --adapter-only); without that flag vLLM leaves them out "
                "and serves the text adapters only"
            )
        return out


def tensor_names(adapter_dir: Path) -> list[str]:
    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), framework="pt") as f:
        return list(f.keys())


def check_for_serving(adapter_dir: Path, model, family) -> ServingCheck:
    """``adapter_dir`` (a PEFT folder) against ``model`` (the base, on 'meta' is enough) and its family."""
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    check = ServingCheck()
    if str(config.get("peft_type", "")).upper() != "LORA":
        check.blockers.append(f"vLLM serves LoRA adapters, this one is {config.get('peft_type')}")
    if config.get("modules_to_save"):
        check.blockers.append(
            f"modules trained in full (modules_to_save {config['modules_to_save']}, "
            "from --train-merger) are not supported"
        )
    if config.get("use_dora"):
        check.blockers.append("DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        check.blockers.append(f"LoRA bias ({config['bias']}) is not supported")
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    roots = tuple(r + "." for r in family.vision_side() if r)
    unparsed = []
    for key in tensor_names(adapter_dir):
        name = key[len(PREFIX) :] if key.startswith(PREFIX) else None
        suffix = next((s for s in LORA_SUFFIXES if key.endswith(s)), None)
        if name is None or suffix is None:
            unparsed.append(key)
            continue
        module = name[: -len(suffix)]
        if module in check.modules:
            continue
        check.modules.append(module)
        if module not in linear:
            check.missing.append(module)
        elif roots and module.startswith(roots):
            check.vision.append(module)
    if unparsed:
        check.blockers.append(f"{len(unparsed)} tensor(s) are no LoRA A/B weight (e.g. {unparsed[0]})")
    return check


def check_against_base(adapter_dir: Path, model_path: str, registry) -> ServingCheck:
    """``check_for_serving`` against the base model at ``model_path``, built on 'meta' (no weight read)."""
    config, family = model_config_and_family(model_path, registry)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return check_for_serving(adapter_dir, model, family)
