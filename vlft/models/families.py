"""Model families in the core: resolving a checkpoint's family once at plan time, and the family-neutral
helpers that read a ``ModelFamily`` (module paths, target selection, vision-side parameters).

The knowledge of any one family (module names, token rules, processors, tiny models, bundled configs) is
in the plugin that answers ``vlft_model_families``; nothing here names a family. Importing this module
loads no torch (the helpers import it when called).

Imports inside functions: torch, only when a helper runs on a model (the plugin surface stays light).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from vlft.contracts.family import BATCH_JOINS, CAPABILITIES, FAMILY_TOWERS, GROUPS, ModelFamily
from vlft.errors import ConfigError, PluginError, call_plugin

EMBEDDED_PREFIX = "embedded:"


def installed_families(registry) -> list[ModelFamily]:
    """Every family the installed plugins offer, in plugin order, first offer of a name wins; each checked
    against the contract (``check_family``) and stamped with the plugin that offered it. A plugin whose answer
    fails stops here, a PluginError naming it and what is wrong."""
    families, problems = offered_families(registry)
    if problems:
        raise PluginError(next(iter(problems.values())))
    return families


def offered_families(registry) -> tuple[list[ModelFamily], dict[str, str]]:
    """The families of the plugins whose answer passes, and {plugin: what is wrong} for the others (``vlft
    plugins`` lists both): a family failing the contract, or the plugin's own code raising while it builds its
    answer (a family written for an older plugin API: ``ContractChanged`` says what changed)."""
    seen: dict[str, ModelFamily] = {}
    problems: dict[str, str] = {}
    # pluggy calls the implementations last-registered first: the order the hook's answers came in before
    for impl in reversed(registry.hook.vlft_model_families.get_hookimpls()):
        try:
            offered = [loaded_family(fam, impl.plugin_name) for fam in impl.function() or []]
        except PluginError as e:
            problems[impl.plugin_name] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 - any failure of a plugin's answer is reported, naming the plugin
            problems[impl.plugin_name] = f"plugin {impl.plugin_name}, vlft_model_families: {type(e).__name__}: {e}"
            continue
        for fam in offered:
            seen.setdefault(fam.name, fam)
    return list(seen.values()), problems


def loaded_family(fam, plugin: str) -> ModelFamily:
    """``fam`` as offered by ``plugin``: checked field by field (a PluginError naming the plugin and the field),
    with ``plugin`` filled in (a new frozen value; the plugin's own stays as it is)."""
    problems = check_family(fam)
    if problems:
        name = getattr(fam, "name", None) or "?"
        raise PluginError(f"family '{name}' (plugin {plugin}): " + "; ".join(problems))
    return fam if fam.plugin == plugin else replace(fam, plugin=plugin)


_PATH_STEP = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"


def _dotted(path: str) -> bool:
    return bool(path) and all(
        step and not step[0].isdigit() and all(c in _PATH_STEP for c in step) for step in path.split(".")
    )


def check_family(family: Any) -> list[str]:
    """What is wrong with a family's answer, field by field ('image_inputs.write must be callable ...'), with
    no model: called when a plugin's families are first asked for; an empty list when all is well."""
    if not isinstance(family, ModelFamily):
        return [f"is a {type(family).__name__}, not a vlft.ModelFamily"]
    problems = []

    def need(ok: bool, field_name: str, what: str):
        if not ok:
            problems.append(f"{field_name} {what}")

    need(isinstance(family.name, str) and bool(family.name), "name", "must be a non-empty string")
    need(
        isinstance(family.model_types, tuple)
        and bool(family.model_types)
        and all(isinstance(t, str) for t in family.model_types),
        "model_types",
        "must be a non-empty tuple of str",
    )
    for name in ("load_kwargs", "vision_dummy", "trace_layer_kwargs"):
        v = getattr(family, name)
        need(v is None or callable(v), name, f"must be callable or None, not {type(v).__name__}")
    for part, cls in {**GROUPS, **CAPABILITIES}.items():
        v = getattr(family, part)
        if v is None and part in CAPABILITIES:
            continue
        if not isinstance(v, cls):
            problems.append(
                f"{part} must be a vlft.{cls.__name__}{' or None' if part in CAPABILITIES else ''}, "
                f"not {type(v).__name__}"
            )
            continue
        for f in fields(cls):
            x = getattr(v, f.name)
            if "Callable" in str(f.type):
                need(
                    callable(x) or (x is None and "None" in str(f.type)),
                    f"{part}.{f.name}",
                    f"must be callable{' or None' if 'None' in str(f.type) else ''}, not {type(x).__name__}",
                )
    towers = family.towers if isinstance(family.towers, GROUPS["towers"]) else None
    if towers is not None:
        for name in ("decoder_layers", "lm_head"):
            need(_dotted(getattr(towers, name)), f"towers.{name}", "must be a dotted module path")
        if towers.vision or towers.vision_blocks:
            need(_dotted(towers.vision), "towers.vision", "must be a dotted module path")
            need(
                towers.vision_blocks.startswith(towers.vision + ".") and _dotted(towers.vision_blocks),
                "towers.vision_blocks",
                "must be a dotted module path under towers.vision",
            )
        for m in towers.vision_mergers:  # a projector may live outside the tower (Gemma 3, LLaVA): still vision side
            need(_dotted(m), "towers.vision_mergers", f"entry {m!r} must be a dotted module path")
    if isinstance(family.targets, GROUPS["targets"]):
        need(family.targets.default in FAMILY_TOWERS, "targets.default", f"must be one of {FAMILY_TOWERS}")

    def given(cap):  # the capability, where it is one (a wrong type was reported above)
        v = getattr(family, cap)
        return v if isinstance(v, CAPABILITIES[cap]) else None

    images = given("image_inputs")
    if images is not None:
        joins = images.batch_inputs
        need(
            isinstance(joins, dict) and all(h in BATCH_JOINS for h in joins.values()),
            "image_inputs.batch_inputs",
            f"must map each input name to one of {BATCH_JOINS}",
        )
        need(
            isinstance(joins, dict) and images.pixels in joins,
            "image_inputs.pixels",
            "must be one of image_inputs.batch_inputs",
        )
        need(images.grid is None or images.patch_size > 0, "image_inputs.patch_size", "must be > 0 with a grid")
    video = given("video_inputs")
    if video is not None:
        need(images is not None, "video_inputs", "needs image_inputs (its prepare receives the clips)")
        need(
            images is None or not isinstance(images.batch_inputs, dict) or video.pixels in images.batch_inputs,
            "video_inputs.pixels",
            "must be one of image_inputs.batch_inputs",
        )
    sharding = given("sharding")
    if sharding is not None:
        need(
            isinstance(sharding.no_split_modules, tuple) and all(isinstance(c, str) for c in sharding.no_split_modules),
            "sharding.no_split_modules",
            "must be a tuple of class names",
        )
        marked = sharding.marked_inputs
        need(
            isinstance(marked, dict)
            and all(isinstance(v, tuple) and all(isinstance(n, str) for n in (k, *v)) for k, v in marked.items()),
            "sharding.marked_inputs",
            "must be a dict of a mask input's name -> a tuple of its row inputs' names",
        )
    return problems


def how_to_add() -> str:
    return (
        "add one with a plugin that answers the vlft_model_families hook (see docs/writing-plugins.md, "
        "'A model family')"
    )


def family_readers(registry) -> list[tuple[str, Any]]:
    """(plugin, ``FamilyReader``) of every reader the installed plugins offer, in the order they are asked."""
    from vlft.contracts.family import FamilyReader

    out = []
    for impl in reversed(registry.hook.vlft_family_readers.get_hookimpls()):
        for reader in impl.function() or []:
            if not isinstance(reader, FamilyReader):
                raise PluginError(
                    f"plugin {impl.plugin_name}, vlft_family_readers: answered a {type(reader).__name__}, "
                    "not a vlft.FamilyReader"
                )
            out.append((impl.plugin_name, reader))
    return out


def read_family(registry, model_config, path: str | None) -> ModelFamily | None:
    """The family the first reader that takes the checkpoint reads from it (checked like an offered one), or
    None where none takes it. A reader's ConfigError (what it could not find) passes as it is."""
    for plugin, reader in family_readers(registry):
        fam = call_plugin(f"reader '{reader.name}' (plugin {plugin})", "read", reader.read, model_config, path)
        if fam is not None:
            return loaded_family(fam, plugin)
    return None


def resolve_family(registry, model_config, where: str = "", path: str | None = None) -> ModelFamily:
    """The family that owns ``model_config.model_type`` (the first installed one that lists it), else the one a
    family reader reads from the checkpoint at ``path``: asked once, at plan time."""
    model_type = getattr(model_config, "model_type", None)
    families = installed_families(registry)
    fam = next((f for f in families if f.owns(model_type)), None) or read_family(registry, model_config, path)
    if fam is None:
        names = [f"{f.name} ({', '.join(f.model_types)})" for f in families]
        readers = [f"{r.name}: {r.description}" for _, r in family_readers(registry)]
        raise ConfigError(
            f"{where + ' is ' if where else ''}a '{model_type}' model, which is not a model family vlft knows: "
            f"installed families: {'; '.join(names) or 'none'}"
            + (f"; and no family reader takes it ({'; '.join(readers)})" if readers else "")
            + f". To train it, {how_to_add()}"
            + (
                f" (plugins that failed to load: {', '.join(sorted(registry.broken))}; see `vlft plugins`)"
                if registry.broken
                else ""
            )
        )
    return fam


def family_named(registry, name: str) -> ModelFamily:
    """The family called ``name`` (``--model embedded:<name>``)."""
    for fam in installed_families(registry):
        if fam.name == name:
            return fam
    raise ConfigError(
        f"--model {EMBEDDED_PREFIX}{name}: no installed model family is called '{name}'; installed: "
        f"{', '.join(f.name for f in installed_families(registry)) or 'none'}"
    )


def bundled_configs(registry) -> dict:
    """{name: folder} of the weightless planning configs the installed plugins ship."""
    out: dict = {}
    for answer in registry.hook.vlft_bundled_model_configs():
        for name, path in (answer or {}).items():
            out.setdefault(name, path)
    return out


def resolve_module(model, path: str):
    """The module at a dotted path; raises AttributeError naming the missing step."""
    obj = model
    for step in path.split("."):
        if not hasattr(obj, step):
            raise AttributeError(f"{type(model).__name__} has no '{path}' (missing '{step}')")
        obj = getattr(obj, step)
    return obj


def base_model(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass
class FamilyTargets:
    """What an adapter goes on, by family paths: module names and (MoE) parameter names."""

    modules: list[str]
    parameters: list[str]
    vision_blocks: list[int]
    vision_depth: int
    text_layers: int


ADAPTED_PARTS = ("attention",)  # what a run adapts: the attention modules (the MLP ones only where asked)


def target_names(family: ModelFamily, tower: str, parts: tuple[str, ...] = ADAPTED_PARTS) -> tuple[str, ...]:
    """The family's target modules in one ``tower`` ("vision" or "text"), relative to a block or layer, for
    ``parts`` ("attention": attention and linear attention; "mlp")."""
    t = family.targets
    if tower == "vision":
        return (t.vision_attention if "attention" in parts else ()) + (t.vision_mlp if "mlp" in parts else ())
    attention = t.text_attention + t.text_linear_attention if "attention" in parts else ()
    return attention + (t.text_mlp if "mlp" in parts else ())


def select_target_modules(
    model,
    family: ModelFamily,
    targets: str,
    vision_last_n: int,
    experts: bool = False,
    parts: tuple[str, ...] = ADAPTED_PARTS,
    leaves: dict[str, tuple[str, ...]] | None = None,
) -> FamilyTargets:
    """Full names of the nn.Linear modules (and, with ``experts``, fused expert parameters) to adapt.

    ``targets`` is vision / text / both / auto. Only modules that exist and are nn.Linear are returned, so a
    hybrid model's layers each contribute the names they have (Qwen3.5: linear_attn.* in Gated DeltaNet
    layers, self_attn.* in the full-attention ones). ``leaves`` ({"vision"/"text": leaf names}): a method's
    own choice for a tower, every nn.Linear in its blocks with one of those leaf names, instead of the
    family's.
    """
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = "" if base is model else _prefix_of(model, base)
    towers = family.targets.default if targets == "auto" else targets
    if towers not in FAMILY_TOWERS:
        raise ValueError(f"targets must be one of {FAMILY_TOWERS} or auto, not {targets!r}")
    blocks = resolve_module(base, family.towers.vision_blocks)
    layers = resolve_module(base, family.towers.decoder_layers)
    depth = len(blocks)
    chosen = list(range(depth))[-vision_last_n:] if vision_last_n else []

    def linear_names(container_path, index, rel_names, tower):
        if leaves and leaves.get(tower):
            block = resolve_module(base, f"{container_path}.{index}")
            named = [
                f"{prefix}{container_path}.{index}.{name}"
                for name, mod in block.named_modules()
                if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in leaves[tower]
            ]
            if named:  # names of another family's modules (LoRA's Qwen vision names on SigLIP) fall back
                return named
        out = []
        for rel in rel_names:
            full = f"{container_path}.{index}.{rel}"
            try:
                mod = resolve_module(base, full)
            except AttributeError:
                continue  # e.g. a linear-attention projection in a full-attention layer
            if isinstance(mod, torch.nn.Linear):
                out.append(prefix + full)
        return out

    modules: list[str] = []
    if towers in ("vision", "both"):
        for b in chosen:
            modules += linear_names(family.towers.vision_blocks, b, target_names(family, "vision", parts), "vision")
    params: list[str] = []
    if towers in ("text", "both"):
        for i in range(len(layers)):
            modules += linear_names(family.towers.decoder_layers, i, target_names(family, "text", parts), "text")
            if experts and family.experts is not None:
                for rel in family.experts.parameters:
                    full = f"{family.towers.decoder_layers}.{i}.{rel}"
                    try:
                        p = resolve_module(base, full)
                    except AttributeError:
                        continue
                    if isinstance(p, torch.nn.Parameter):
                        params.append(prefix + full)
    return FamilyTargets(modules, params, chosen if towers != "text" else [], depth, len(layers))


def frozen_router_parameters(model, family: ModelFamily) -> list[str]:
    """Names of router parameters (must stay requires_grad=False, whatever the method does)."""
    names = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = resolve_module(base, family.towers.decoder_layers)
    for i in range(len(layers)):
        for rel in family.experts.routers if family.experts is not None else ():
            try:
                mod = resolve_module(base, f"{family.towers.decoder_layers}.{i}.{rel}")
            except AttributeError:
                continue
            names += [f"{family.towers.decoder_layers}.{i}.{rel}.{n}" for n, _ in mod.named_parameters()]
    return names


def vision_parameter_names(model, family: ModelFamily) -> list[str]:
    """Every vision-side parameter: the tower (blocks, patch embedding, Qwen's mergers and deepstack mergers)
    and any projector outside it (Gemma 3's multi_modal_projector)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = []
    for root in (family.towers.vision, *family.towers.vision_mergers):
        if root.startswith(family.towers.vision + "."):
            continue  # already under the tower
        names += [f"{root}.{n}" for n, _ in resolve_module(base, root).named_parameters()]
    return names


def _prefix_of(wrapper, base) -> str:
    for name, mod in wrapper.named_modules():
        if mod is base:
            return name + "." if name else ""
    return ""


def count_parameters(model, family: ModelFamily) -> dict[str, int]:
    """Base-model parameters (adapters left out; tied tensors once): total, vision side, fused experts, and
    adapter parameters on the experts. Works on the meta device."""
    base = base_model(model)
    roots = tuple(r + "." for r in family.vision_side() if r)
    experts = tuple("." + rel for rel in family.experts.parameters) if family.experts is not None else ()
    total = vision = in_experts = expert_adapter = 0
    for name, p in base.named_parameters():
        n = p.numel()
        if p.requires_grad:  # an adapter's
            if experts and any(e in name for e in (".experts.",)):
                expert_adapter += n
            continue
        clean = name.replace(".base_layer", "")
        total += n
        if roots and clean.startswith(roots):
            vision += n
        if experts and clean.endswith(experts):
            in_experts += n
    return {
        "total": total,
        "vision": vision,
        "text": total - vision,
        "experts": in_experts,
        "expert_adapter": expert_adapter,
    }


def family_of_model(model, registry) -> ModelFamily:
    """The family of a loaded (or meta) model among ``registry``'s, for helpers called outside a plan (tests,
    bench scripts); a run passes the plan's family instead."""
    return resolve_family(registry, base_model(model).config)  # no folder: a reader reads the config alone


def family_load_kwargs(family, param_dtype: str) -> dict:
    """The family's extra from_pretrained/from_config arguments for this parameter dtype (``load_kwargs``)."""
    if family.load_kwargs is None:
        return {}
    return dict(family.call("load_kwargs", family.load_kwargs, param_dtype))
