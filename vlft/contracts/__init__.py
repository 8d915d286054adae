"""The contracts between vlft and its plugins, one module per plugin kind: what a backend (``backend``), an
adapter method (``method``), a model family (``family``), a scorer (``scorer``), a metric sink (``sinks``) and
a training objective (``objective``) answer. Plugins import these from ``vlft``; the modules are where the core reads them from.

The contracts carry a version, ``PLUGIN_API``. A change that breaks a plugin written for an older one is a
``Change`` in ``CHANGES`` (and a row of docs/plugin-api-changes.md, which a docs test keeps equal to it): a
plugin that passes a field that was removed or renamed gets a ``ContractChanged`` naming the field, what
replaced it and the changelog's section, instead of a bare ``TypeError``; a plugin that declares the version
it was written for (``VLFT_PLUGIN_API = 2`` in its module) is told in ``vlft plugins`` what changed since.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from vlft.errors import VlftError

PLUGIN_API = 3
CHANGES_DOC = "docs/plugin-api-changes.md"


@dataclass(frozen=True)
class Change:
    """One change that breaks a plugin written for the version before ``api``: ``old`` (a field of
    ``contract``, a hook, a module) and what replaced it (``now``, in words: a field to set instead, or why
    nothing does)."""

    api: int
    contract: str  # "ModelFamily", "hook", "import"
    old: str
    now: str

    def where(self) -> str:
        """The changelog's section for it."""
        return f"{CHANGES_DOC}#plugin-api-{self.api}"

    def line(self, where: bool = True) -> str:
        subject = {"hook": f"the hook {self.old}", "import": self.old}.get(
            self.contract, f"{self.contract}({self.old}=...)"
        )
        return f"{subject} changed in plugin API {self.api}: {self.now}" + (f" (see {self.where()})" if where else "")


def _moved(api: int, contract: str, olds: str, now: str) -> list[Change]:
    return [Change(api, contract, old, now) for old in olds.split()]


CHANGES: tuple[Change, ...] = (
    # -- plugin API 2: a family by capability ---------------------------------------------------------------
    *_moved(
        2,
        "ModelFamily",
        "image_token video_token vision_start_token vision_end_token",
        "use image_inputs=vlft.ImageInputs(...), whose `write` writes each image's tokens, or "
        "vlft.processor_image_inputs(...), which lets the processor write them",
    ),
    *_moved(
        2,
        "ModelFamily",
        "patch_size merge_size temporal_patch_size image_min_pixels image_max_pixels "
        "video_min_pixels video_max_pixels image_tokens video_tokens image_grid",
        "use image_inputs=vlft.ImageInputs(grid=..., patch_size=..., patches_per_token=..., size_cap=...) "
        "and video_inputs=vlft.VideoInputs(grid=...): the numbers are the family's own",
    ),
    *_moved(2, "ModelFamily", "batch_inputs", "use image_inputs=vlft.ImageInputs(batch_inputs=...)"),
    *_moved(2, "ModelFamily", "trace_vision", "use image_inputs=vlft.ImageInputs(trace=...)"),
    *_moved(
        2,
        "ModelFamily",
        "processor_expands_placeholders",
        "use image_inputs=vlft.processor_image_inputs(...) for a processor that writes the image tokens",
    ),
    *_moved(2, "ModelFamily", "rope_index", "use positions=vlft.Positions(rope_index=...)"),
    *_moved(2, "ModelFamily", "packing_refusal", "use packing=vlft.Packing(refusal=...)"),
    *_moved(2, "ModelFamily", "no_split_modules", "use sharding=vlft.Sharding(no_split_modules=...)"),
    *_moved(2, "ModelFamily", "bundled_configs", "answer the vlft_bundled_model_configs hook ({name: folder}) instead"),
    *_moved(
        2,
        "ModelFamily",
        "default_vision_last_n embed_tokens text_linear_attention_optional",
        "removed, as no run read it: leave it out",
    ),
    # -- plugin API 3: contracts by plugin kind, ModelFamily in groups -----------------------------------------
    *_moved(
        3,
        "ModelFamily",
        "vision_blocks vision_mergers decoder_layers lm_head",
        "use towers=vlft.Towers(...), the field of that name",
    ),
    *_moved(3, "ModelFamily", "vision_tower", "use towers=vlft.Towers(vision=...)"),
    *_moved(
        3,
        "ModelFamily",
        "vision_attention vision_mlp text_attention text_linear_attention text_mlp",
        "use targets=vlft.Targets(...), the field of that name",
    ),
    *_moved(3, "ModelFamily", "default_targets", "use targets=vlft.Targets(default=...)"),
    *_moved(
        3,
        "ModelFamily",
        "default_parts",
        "removed, as no family set it: leave it out (adapters take the attention modules, "
        "the targets' attention names; vlft.testing.check_family asks for the MLP ones too)",
    ),
    *_moved(
        3,
        "ModelFamily",
        "processor_class load_processor bundled_processor reply_end_token reply_end_appended box_coordinates",
        "use chat=vlft.Chat(...), the field of that name",
    ),
    *_moved(3, "ModelFamily", "chat_template_kwargs", "use chat=vlft.Chat(template_kwargs=...)"),
    *_moved(3, "ModelFamily", "vision_stem", "use kernels=vlft.Kernels(vision_stem=...)"),
    *_moved(3, "ModelFamily", "kernel_targets", "use kernels=vlft.Kernels(targets=...)"),
    *_moved(3, "ModelFamily", "build_tiny", "use tiny=vlft.Tiny(build=...)"),
    *_moved(3, "ModelFamily", "tiny_recipe", "use tiny=vlft.Tiny(recipe=...)"),
    *_moved(
        3,
        "ModelFamily",
        "expert_parameters router_modules",
        "use experts=vlft.Experts(parameters=..., routers=...); code that read them reads family.experts",
    ),
    Change(
        3,
        "hook",
        "vlft_model_family",
        "removed, nothing asks it: answer vlft_model_families, each family's model_types saying what it owns",
    ),
    Change(
        3,
        "import",
        "vlft.policies.<contract>",
        "import it from vlft (`from vlft import <contract>`); vlft.policies keeps the policies only",
    ),
    # -- plugin API 3: an objective is a small class, its options declared --------------------------------------
    *_moved(
        3,
        "Objective",
        "parse encoder collate",
        "set layout=vlft.Layout.PREFERENCE_PAIRS or UNPAIRED_PREFERENCES, or give a format of the objective's "
        "own (an object with parse, encoder and collate methods)",
    ),
    *_moved(
        3,
        "Objective",
        "loss",
        "subclass vlft.Objective and define loss(model, batch, passes), or vlft.PairedPreference and define "
        "pair_loss(chosen, rejected); passes (vlft.Passes) gives the log-probabilities",
    ),
    *_moved(
        3,
        "Objective",
        "rollout",
        "subclass vlft.Objective and define prepare(model, host_batches, passes) -> vlft.Prepared",
    ),
    *_moved(3, "Objective", "check demo_data", "subclass vlft.Objective and define it as a method"),
    *_moved(
        3,
        "Objective",
        "help",
        "declare the options: ObjectiveInfo(name, description, options) with a dataclass of vlft.option(default, "
        "help, check=...) fields; vlft_objective receives them built and checked",
    ),
    *_moved(
        3,
        "RunConfig",
        "beta dpo_loss label_smoothing rpo_alpha reward num_generations temperature top_p "
        "clip_epsilon num_iterations scale_rewards grpo_norm",
        "the objective's own option now (the same flag): read it from the options vlft_objective receives",
    ),
)


def changes_since(api: int) -> list[Change]:
    """What changed after plugin API ``api`` (a plugin written for it may break on these)."""
    return [c for c in CHANGES if c.api > api]


def changed(contract: str, old: str) -> Change | None:
    return next((c for c in reversed(CHANGES) if c.contract == contract and c.old == old), None)


class ContractChanged(VlftError, TypeError):
    """A plugin used a contract as an older plugin API had it (a field removed or renamed, a hook gone): the
    message names each name, what replaced it and the changelog's section. A ``TypeError`` too, as the call
    with an unknown keyword was."""


def contract(cls):
    """Make a contract dataclass refuse unknown keyword arguments with ``ContractChanged``: a name the
    changelog has is explained (what replaced it, since which version, where to read); another is named with
    the fields there are. Put it above ``@dataclass``."""
    init = cls.__init__
    known = {f.name for f in fields(cls) if f.init}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise ContractChanged(unknown_fields(cls.__name__, unknown, sorted(known)))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def unknown_fields(contract_name: str, names: list[str], known: list[str]) -> str:
    """One clause per name, then where to read: the changelog's sections of the changes named."""
    lines, sections = [], []
    for name in names:
        change = changed(contract_name, name)
        if change is None:
            lines.append(
                f"{contract_name}({name}=...): no such field in plugin API {PLUGIN_API} (this vlft's); "
                f"its fields: {', '.join(known)}"
            )
            sections.append(CHANGES_DOC)
        else:
            lines.append(change.line(where=False))
            sections.append(change.where())
    return "; ".join(lines) + f" (see {', '.join(dict.fromkeys(sections))})"
