"""Helpers for testing a vlft plugin (see docs/writing-plugins.md, "Testing your plugin").

    from vlft.testing import check_family, check_plugin, registry_with, run, tiny_run_config

    import my_plugin

    def test_hooks_match_vlft_and_answer_only_for_my_names():
        check_plugin(my_plugin)

    def test_a_short_run(tmp_path):
        registry = registry_with(my_plugin, entry_points=False)  # this plugin, vlft's cpu backend and lora
        result = run(tiny_run_config(tmp_path, backend="mybackend", method="lora"), registry)
        assert (result.output / "adapter" / "adapter_model.safetensors").is_file()

    def test_my_family_on_its_tiny_model(tmp_path):
        check_family("myvlm", tmp_path, registry=registry_with(my_plugin, entry_points=False))

``check_family`` runs a model family's contract on its real tiny model and processor (see its docstring).

Everything else here builds on the embedded default (a small Qwen2.5-VL and the
synthetic product-inspection data), so a plugin's tests need no download and
a 2-step run takes seconds on a CPU.
"""

from __future__ import annotations

import inspect
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from vlft import hookspecs
from vlft.config import RunConfig, build_config
from vlft.policies import DataLoaderOptions
from vlft.registry import Registry, load_registry

__all__ = [
    "FAMILY_CHECKS",
    "FamilyCheck",
    "FamilyCheckError",
    "FamilyReport",
    "check_family",
    "check_plugin",
    "registry_with",
    "run",
    "tiny_dataset",
    "tiny_run_config",
]

UNKNOWN = "vlft-testing-unknown-name"  # a backend, method and objective name no plugin owns
# what a run needs besides the plugin under test: a backend to run a method on, a method to run a backend with,
# the model families and the default objective (sft)
BUILTINS_FOR_RUNS = ("cpu", "lora", "models", "sft")


def registry_with(*plugins: Any, entry_points: bool = True) -> Registry:
    """A fresh registry holding ``plugins`` (modules, or objects with ``@hookimpl`` methods).

    ``entry_points=True``: the installed plugins too, as ``vlft`` itself would
    load them (a plugin passed here that is also installed is registered once).
    ``entry_points=False``: only ``plugins``, plus vlft's CPU reference backend,
    LoRA, the built-in model families and ``sft``, so a method plugin has a backend to
    run on, a backend plugin a method, and both a model. Every call builds a new plugin manager: tests do not leak into
    each other or into the process-wide registry.
    """
    import importlib

    from vlft.plugins import builtin_plugins, serve_checkout

    builtins: list = []
    if not entry_points:
        # the built-ins by their modules, as the registry finds them (from the checkout where not installed)
        serve_checkout()
        builtins = [importlib.import_module(module) for name, module in builtin_plugins() if name in BUILTINS_FOR_RUNS]
    registry = load_registry(
        load_entry_points=entry_points, plugins=tuple(m for m in builtins if all(m is not p for p in plugins))
    )
    for plugin in plugins:
        if not registry.pm.is_registered(plugin):
            registry.pm.register(plugin, name=getattr(plugin, "__name__", None) or type(plugin).__name__)
    return registry.refresh()  # collects names again: two plugins offering one name fail here


def tiny_dataset(folder: str | Path, n_train: int = 16, n_val: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """Write a small product-inspection data set under ``folder``/data; return (train.jsonl, val.jsonl)."""
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(Path(folder) / "data", n_train=n_train, n_val=n_val, seed=seed)
    return ds.train, ds.val


def tiny_run_config(folder: str | Path, **overrides: Any) -> RunConfig:
    """A checked ``RunConfig`` for a 2-step run on the embedded model and ``tiny_dataset(folder)``.

    The run writes to ``folder``/run; evaluation is 2 samples of 4 tokens and no
    checkpoint is kept, so the run takes seconds. ``overrides`` are config
    fields (``backend="mybackend"``, ``method="mymethod"``, ``adapter={"r": 4}``).
    """
    train, val = tiny_dataset(folder)
    values: dict[str, Any] = dict(
        backend="cpu",
        method="lora",
        data=str(train),
        val_data=str(val),
        output=str(Path(folder) / "run"),
        steps=2,
        batch_size=2,
        eval_every=0,
        eval_samples=2,
        max_new_tokens=4,
        save_every=0,
        log_every=1,
    )
    values.update(overrides)
    return build_config({}, values)  # the same checks as flags on the command line


def run(config: RunConfig, registry: Registry | None = None, progress: bool = False):
    """Run ``config`` as ``vlft run`` would (dry run included) with ``registry``; return its result.

    The result has ``output`` (the run folder), ``plan`` (every resolved policy),
    ``before``/``after`` (evaluations) and ``metrics``.
    """
    from vlft.commands.run import execute

    return execute(registry if registry is not None else load_registry(), config, progress=progress)


def _placeholder_arguments() -> dict[str, Any]:
    """A value for every hook parameter, naming nothing any plugin owns."""
    return {
        "backend": UNKNOWN,
        "method": UNKNOWN,
        "objective": UNKNOWN,
        "config": RunConfig(),
        "model_config": None,
        "model": None,
        "targets": [],
        "path": "",
        "trainable": False,
        "seed": 0,
        "deterministic": False,
        "device": None,
        "attention": None,
        "options": DataLoaderOptions(),
        "family": None,
        "target_parameters": [],
        "rewards": {},
    }


def check_plugin(plugin: Any) -> None:
    """Check ``plugin`` against vlft's hook specs; raise ``AssertionError`` naming each problem.

    - every ``vlft_*`` hook it implements exists, with parameters the spec has
      (pluggy's own check: a misspelt hook or parameter name fails here);
    - asked about a backend, method or objective it does not own, every hook answers
      None and leaves the ``DataLoaderOptions`` it is given untouched (a
      wrapper, ``hookwrapper=True`` or ``wrapper=True``, yields once and passes
      the result on unchanged). Hooks marked ``@hookimpl_for(NAME)`` pass
      this by construction; explicit ``if backend != NAME`` guards are checked
      the same way.
    """
    pm = load_registry(load_entry_points=False).pm
    pm.register(plugin, name="plugin-under-test")
    pm.check_pending()  # raises PluginValidationError for a hookimpl without a matching spec
    problems = []
    for name, spec in inspect.getmembers(hookspecs, inspect.isfunction):
        params = inspect.signature(spec).parameters
        if not name.startswith("vlft_") or not ({"backend", "method", "objective"} & set(params)):
            continue
        for impl in getattr(pm.hook, name).get_hookimpls():
            args = _placeholder_arguments()
            answer = impl.function(**{p: args[p] for p in impl.argnames})
            if impl.hookwrapper or impl.wrapper:
                problems += _wrapper_problems(name, answer, old_style=impl.hookwrapper)
            elif answer is not None:
                problems.append(f"{name} answered {answer!r} for a name it does not own; return None instead")
            if name == "vlft_dataloader_options" and args["options"] != DataLoaderOptions():
                problems.append(f"{name} changed the options of a backend it does not own: {args['options']}")
    assert not problems, "plugin answers for names it does not own:\n  " + "\n  ".join(problems)


def _wrapper_problems(name: str, generator: Any, old_style: bool) -> list[str]:
    """A wrapper asked about a name it does not own must yield once and pass the inner result on unchanged."""
    inner = object()  # what the other plugins answered, as far as the wrapper can tell
    try:
        next(generator)
    except StopIteration:
        return [f"{name} is a wrapper that returned without yielding; yield once, even for names it does not own"]
    outcome = pluggy.Result(inner, None)
    try:
        generator.send(outcome if old_style else inner)
    except StopIteration as stop:
        changed = outcome.get_result() is not inner if old_style else stop.value is not inner
        return [f"{name} changed the result for a name it does not own; pass it on unchanged"] if changed else []
    generator.close()
    return [f"{name} is a wrapper that yielded more than once"]


# -- a model family's contract, on its real tiny model -----------------------------------------------------
#
# What a family says about its model (target names, image tokens, positions, packing) is checked against what
# the model and its processor really do: the model's own forward, the processor's own call, plain PEFT. Each
# check is a function of the loaded ``_Subject``; a check that does not apply to a family (a capability it
# lacks) is skipped with the reason, and a failing check does not stop the others.


class FamilyCheckError(AssertionError):
    """Raised by ``check_family``: every failed check, each named, under the family and its plugin."""


@dataclass
class FamilyCheck:
    """One check's outcome: ``status`` is 'passed', 'failed' or 'skipped'; ``detail`` says what differed, or why
    it was skipped."""

    name: str
    status: str
    detail: str = ""


@dataclass
class FamilyReport:
    """What ``check_family`` found: the family's label (name and plugin), the model folder, every check."""

    family: str
    model: str
    checks: list[FamilyCheck] = field(default_factory=list)

    def of(self, status: str) -> list[FamilyCheck]:
        return [c for c in self.checks if c.status == status]

    def __str__(self) -> str:
        lines = [f"{self.family} on {self.model}:"]
        lines += [f"  {c.name}: {c.status}{': ' + c.detail if c.detail else ''}" for c in self.checks]
        return "\n".join(lines)


# the records every check reads: text-only and image records side by side, one image or two of sizes whose
# sides are not multiples of any patch, one and two turns (written by ``_write_mixed_data``)
MIXED_RECORDS = (
    ((), 1),
    (((100, 75),), 1),
    (((60, 130), (47, 33)), 1),
    ((), 2),
    (((128, 96),), 2),
)


@dataclass
class _Subject:
    """The family under check with its tiny model's folder, processor, encoder and the encoded mixed records;
    models are loaded by each check that needs one (a check may change the one it has)."""

    registry: Any
    family: Any
    path: str
    folder: Path
    processor: Any
    encoder: Any
    records: list
    samples: list

    def model(self, text_attention: str = "eager"):
        """The tiny model as a run loads it in fp32, its vision tower on eager attention."""
        from vlft.models.loading import load_model  # the core's loader: what a run would train
        from vlft.policies import AttentionPolicy, PrecisionPolicy

        return load_model(
            self.path, AttentionPolicy("eager", text_attention), PrecisionPolicy("fp32"), family=self.family
        ).eval()

    def batch(self, samples=None) -> dict:
        """The samples padded into one batch by the family's collator (right padding, as training does)."""
        from vlft.data.batching import collator_for  # the collator a run batches with

        return collator_for(self.processor, self.family)(list(samples if samples is not None else self.samples))


def _check_targets(s: _Subject) -> str:
    """Every target name the family lists is an nn.Linear in some vision block / decoder layer (a misspelt name
    would silently adapt nothing), every decoder layer and adapted vision block gets at least one, and the
    tower paths, experts and routers resolve."""
    import torch

    from vlft.models.families import (  # what a run's plan selects with
        resolve_module,
        select_target_modules,
        target_names,
    )

    fam, model = s.family, s.model()
    problems = []
    for path in (fam.towers.vision, *fam.towers.vision_mergers, fam.towers.decoder_layers, fam.towers.lm_head):
        if path:
            try:
                resolve_module(model, path)
            except AttributeError as e:
                problems.append(str(e))
    if problems:
        return "; ".join(problems)
    parts = ("attention", "mlp")
    found = select_target_modules(model, fam, "both", 10**6, experts=fam.experts is not None, parts=parts)
    towers = {
        "vision": (fam.towers.vision_blocks, target_names(fam, "vision", parts)),
        "text": (fam.towers.decoder_layers, target_names(fam, "text", parts)),
    }
    for tower, (container, names) in towers.items():
        if not container:
            continue
        count = len(resolve_module(model, container))  # pyright: ignore[reportArgumentType]  # a ModuleList, typed Module
        hits = [n for n in found.modules if n.startswith(container + ".")]
        problems += [
            f"{tower} target '{name}' is an nn.Linear in none of the {count} {container} entries"
            for name in names
            if not any(h.endswith("." + name) for h in hits)
        ]
        bare = [i for i in range(count) if not any(h.startswith(f"{container}.{i}.") for h in hits)]
        if bare:
            problems.append(f"{container} entries {bare} have no target at all")
    experts = fam.experts.parameters if fam.experts is not None else ()
    problems += [
        f"experts.parameters '{name}' is a Parameter in no decoder layer"
        for name in experts
        if not any(p.endswith("." + name) for p in found.parameters)
    ]
    for name in fam.experts.routers if fam.experts is not None else ():
        if not any(isinstance(m, torch.nn.Module) for m in _each_layer(model, fam, name)):
            problems.append(f"experts.routers '{name}' is a module in no decoder layer")
    return "; ".join(problems)


def _each_layer(model, fam, relative: str):
    from vlft.models.families import resolve_module  # the dotted-path reader of the family's paths

    for i in range(len(resolve_module(model, fam.towers.decoder_layers))):
        try:
            yield resolve_module(model, f"{fam.towers.decoder_layers}.{i}.{relative}")
        except AttributeError:
            continue


def _check_image_tokens(s: _Subject) -> str:
    """The ids the family's ``image_inputs`` write for each record equal those the processor writes itself for the
    same rendered conversation and images (so each image's token count does too); and measuring a record (from
    its image sizes alone, as the length check does) counts what encoding it gives."""
    problems = []
    for record, sample in zip(s.records, s.samples):
        measured, encoded = s.encoder.measure(record)[0], len(sample["input_ids"])
        if measured != encoded:
            problems.append(
                f"{record.where}: measured at {measured} tokens (image_inputs.prepare on the sizes "
                f"alone), encoded at {encoded}"
            )
        mine, theirs, plain = sample["input_ids"].tolist(), *_processor_ids(s, record)
        if mine != theirs:
            problems.append(f"{record.where}: {_first_difference(s.processor.tokenizer, mine, theirs, plain)}")
    return "; ".join(problems)


def _processor_ids(s: _Subject, record) -> tuple[list[int], list[int]]:
    """(the processor's ids for the record's rendered conversation and images, the tokenizer's for the text
    alone)."""
    from vlft.data.records import load_image  # the images as the encoder decodes them

    text = s.encoder.render(record.turns, add_generation_prompt=False)
    if (
        s.family.chat.reply_end_appended
        and record.turns[-1].role == "assistant"
        and not text.endswith(s.encoder.eos_text)
    ):
        text += s.encoder.eos_text  # the last reply's end, which the template leaves out and training adds
    images = {"images": [[load_image(x) for x in record.images]]} if record.images else {}
    own = s.processor(text=[text], return_tensors="pt", **images)["input_ids"][0].tolist()
    return own, s.processor.tokenizer(text)["input_ids"]


def _first_difference(tokenizer, mine: list[int], theirs: list[int], plain: list[int]) -> str:
    """Where the family's ids part from the processor's, with each image's count of the token the processor
    writes in for images (the one it adds most of that the text alone lacks, else the one it adds most of)."""
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    names = tokenizer.convert_ids_to_tokens
    said = (
        f"the family's image_inputs wrote {len(mine)} tokens, the processor {len(theirs)}; from token {at} "
        f"the family wrote {names(mine[at : at + 4])}, the processor {names(theirs[at : at + 4])}"
    )
    added = Counter(theirs) - Counter(plain)
    if not added:
        return said
    token = max(added, key=lambda t: (t not in plain, added[t]))
    return f"{said}; {names(token)} per image: the family {_runs(mine, token)}, the processor {_runs(theirs, token)}"


def _runs(ids: list[int], token: int) -> list[int]:
    """The lengths of the runs of ``token`` in ``ids``: one run per image."""
    runs, length = [], 0
    for t in [*ids, None]:
        if t == token:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


def _check_positions(s: _Subject) -> str:
    """``positions.rope_index`` of each sample alone equals the positions the model computes itself for that
    sample in a padded batch (read where its text model receives them)."""
    import torch

    from vlft.data.batching import model_inputs  # the keyword arguments a training forward passes
    from vlft.models.families import resolve_module  # the dotted-path reader of the family's paths

    fam, model = s.family, s.model()
    batch = s.batch()
    text_model = resolve_module(model, fam.towers.decoder_layers.rpartition(".")[0])
    seen = []
    hook = text_model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(**model_inputs(batch))
    finally:
        hook.remove()
    if not seen or seen[0] is None:
        text = fam.towers.decoder_layers.rpartition(".")[0]
        return f"the text model ({text}) was not given position_ids to compare with"
    rows, problems = fam.positions.rows, []
    for i, (record, sample) in enumerate(zip(s.records, s.samples)):
        n = len(sample["input_ids"])
        mine = fam.call("positions.rope_index", fam.positions.rope_index, model.config, sample)
        theirs = seen[0][-rows:, i, :n]
        if tuple(mine.shape) != (rows, 1, n):
            problems.append(f"{record.where}: rope_index gave shape {tuple(mine.shape)}, not ({rows}, 1, {n})")
        elif not torch.equal(mine[:, 0].to(theirs.dtype), theirs):
            at = int((mine[:, 0] != theirs).any(0).nonzero()[0])
            problems.append(
                f"{record.where}: at token {at} rope_index gave {mine[:, 0, at].tolist()}, the model "
                f"{theirs[:, at].tolist()}"
            )
    return "; ".join(problems)


def _check_packing(s: _Subject) -> str:
    """The loss of the mixed samples packed into one row (on the segments attention) equals their loss padded,
    both in float64, to the rounding the two summation orders can differ by."""
    from vlft.data.batching import label_count  # the step's label count, packed or padded
    from vlft.data.packing import PackingCollator, PackingPlan  # the packing a run does
    from vlft.models.segments import segments_name  # the per-sample twin of the text attention

    fam = s.family
    plain, twin = s.model().double(), s.model(segments_name("eager")).double()
    padded = s.batch()
    joins = fam.image_inputs.batch_inputs if fam.image_inputs is not None else {}
    packed = PackingCollator(PackingPlan(True, "segments"), fam.positions, plain.config, joins)(s.samples)
    if label_count(padded) != label_count(packed):
        return f"packing counts {label_count(packed)} label tokens, padding {label_count(padded)}"
    a, b = _loss(plain, padded), _loss(twin, packed)
    rtol = _float64_rtol(plain, fam, max(len(x["input_ids"]) for x in s.samples) * len(s.samples))
    if not abs(a - b) <= rtol * abs(a):
        return f"packed loss {b!r}, padded {a!r}: relative difference {abs(a - b) / abs(a):.3g} > {rtol:.3g}"
    return ""


def _loss(model, batch: dict) -> float:
    """``training.step``'s loss (summed over labels, over the label count), every float input in float64."""
    import torch

    from vlft.data.batching import label_count, model_inputs  # what the training step reads
    from vlft.models.loss import token_loss_sum  # the supervised loss a step takes

    inputs = {
        k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in model_inputs(batch).items()
    }
    with torch.no_grad():
        return token_loss_sum(model(**inputs).logits, batch["labels"]).item() / label_count(batch)


def _float64_rtol(model, fam, tokens: int) -> float:
    """How far two summation orders of one float64 forward may leave the loss apart, relative to it.

    Reordering a sum of n terms moves it by at most about n * eps relative to the terms' magnitudes (each of the
    n - 1 additions rounds by at most eps / 2, in either order). The longest sums here are a Linear's input
    width, a softmax over the vocabulary or over a row's tokens; there is one such sum per layer in series (the
    vision blocks, the decoder layers, the head), and a layer of these small random models passes its input's
    error on about unamplified: (layers + 1) * n * eps, doubled for margin. Measured on the built-in tiny
    models: 0 or 1 ulp (1e-16) against bounds near 2e-12; samples attending across a packed boundary move the
    loss by 1e-2."""
    import torch

    from vlft.models.families import resolve_module  # the dotted-path reader of the family's paths

    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    n = max([tokens, model.get_output_embeddings().out_features, *widths])
    layers = len(resolve_module(model, fam.towers.decoder_layers))
    if fam.towers.vision_blocks:
        layers += len(resolve_module(model, fam.towers.vision_blocks))
    return (layers + 1) * 2 * n * torch.finfo(torch.float64).eps


def _check_adapter(s: _Subject) -> str:
    """A LoRA adapter on every target the family names (experts included), non-zero from the start, saved with
    PEFT and loaded with plain ``peft.PeftModel.from_pretrained`` on a fresh base model, gives the very logits
    of the adapted model (the same weights through the same operations: no rounding may differ)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    from vlft.data.batching import model_inputs  # the keyword arguments a training forward passes
    from vlft.models.families import select_target_modules  # what a run's plan selects with

    fam, model = s.family, s.model()
    targets = select_target_modules(model, fam, "both", 2, experts=fam.experts is not None)
    if not targets.modules and not targets.parameters:
        return "the family's default targets select nothing"
    inputs = model_inputs(s.batch())
    with torch.no_grad():
        base = model(**inputs).logits
    torch.manual_seed(0)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=sorted(targets.modules),
        target_parameters=targets.parameters or None,
        init_lora_weights=False,
    )
    adapted = get_peft_model(model, config).eval()
    folder = s.folder / "adapter"
    adapted.save_pretrained(str(folder))
    reloaded = PeftModel.from_pretrained(s.model(), folder).eval()
    with torch.no_grad():
        mine, theirs = adapted(**inputs).logits, reloaded(**inputs).logits
    saved = set(json.loads((folder / "adapter_config.json").read_text())["target_modules"])
    if saved != set(targets.modules):
        return f"the saved adapter names {len(saved)} target modules, the family selected {len(targets.modules)}"
    if torch.equal(mine, base):
        return "the adapter changed no logit: its targets are not on the forward's path"
    if not torch.equal(mine, theirs):
        return (
            f"reloaded with plain PEFT, the logits differ from the adapted model's by up to "
            f"{(mine - theirs).abs().max().item():.3g}"
        )
    return ""


def _check_mixed_step(s: _Subject) -> str:
    """Two steps of ``vlft run`` (LoRA, the CPU reference backend) on the mixed records: batches with and without
    images, through the family's encoder, collator and vision warm-up; each step's loss is finite and the
    adapter is written."""
    from vlft.config import build_config  # the same checks as flags on the command line

    data = s.folder / "data" / "train.jsonl"
    config = build_config(
        {},
        dict(
            model=s.path,
            backend="cpu",
            method="lora",
            data=str(data),
            val_data=str(data),
            output=str(s.folder / "run"),
            steps=2,
            batch_size=2,
            eval_every=0,
            eval_samples=1,
            max_new_tokens=2,
            save_every=0,
            log_every=1,
            seed=0,
        ),
    )
    result = run(config, s.registry)
    losses = [m["loss"] for m in result.metrics or [] if "loss" in m]
    if len(losses) != 2 or not all(math.isfinite(x) for x in losses):
        return f"the run logged losses {losses}, not 2 finite ones"
    if result.output is None or not (result.output / "adapter" / "adapter_model.safetensors").is_file():
        return "the run wrote no adapter"
    return ""


def _lacks(capability: str, why: str) -> Callable[[Any], str]:
    """A check's reason not to run: the family lacks ``capability`` (None) and ``why`` follows."""
    return lambda fam: f"the family has no {capability} ({why})" if getattr(fam, capability) is None else ""


def _no_packing(fam) -> str:
    if fam.packing is None:
        return "the family has no packing capability (--packing on is refused)"
    return f"the family refuses packing: {fam.packing.refusal}" if fam.packing.refusal else ""


# name -> (why the check does not apply to a family, or ''; the check: '' when it passes, else what differed)
FAMILY_CHECKS: dict[str, tuple[Callable[[Any], str], Callable[[_Subject], str]]] = {
    "targets": (lambda fam: "", _check_targets),
    "image_tokens": (_lacks("image_inputs", "it trains on text only"), _check_image_tokens),
    "positions": (_lacks("positions", "plain 1-D positions, which the model computes alone"), _check_positions),
    "packing": (_no_packing, _check_packing),
    "adapter": (lambda fam: "", _check_adapter),
    "mixed_step": (lambda fam: "", _check_mixed_step),
}


def check_family(
    model: str, folder: str | Path, *, registry: Registry | None = None, skip: dict[str, str] | None = None
) -> FamilyReport:
    """Check a model family's contract on its real tiny model and processor; raise ``FamilyCheckError`` (an
    ``AssertionError``) listing every failed check, under the family's name and plugin.

    ``model``: a family's name (its tiny model, as ``--model embedded:<name>`` builds it), ``embedded:<name>``,
    or a local model folder (a small one: every check loads it several times). ``folder``: scratch space (the
    mixed data, a saved adapter, a 2-step run). ``registry``: where the family is found (default: the installed
    plugins; a plugin's own tests pass ``registry_with(my_plugin, entry_points=False)``). ``skip``: {check name:
    reason} for checks that do not apply to the model at hand (each needs a reason; the report keeps it).

    The checks (``FAMILY_CHECKS``), each skipped with the reason where the family lacks the capability:
    ``targets`` (every target name found on the model), ``image_tokens`` (the ids the family's ``image_inputs``
    write equal the processor's own, each image's token count with them), ``positions`` (``rope_index`` equals
    the positions the model computes), ``packing`` (packed and padded losses equal in float64), ``adapter`` (saved, and loaded with
    plain ``peft.PeftModel.from_pretrained``: the same logits), ``mixed_step`` (a 2-step ``vlft run`` on
    text-only and image records). Returns the ``FamilyReport`` when none fails.
    """
    skip = _checked_skips(skip)
    subject = _subject(model, Path(folder), registry if registry is not None else load_registry())
    report = FamilyReport(subject.family.label(), subject.path)
    for name, (lacks, check) in FAMILY_CHECKS.items():
        report.checks.append(_outcome(name, skip.get(name) or lacks(subject.family), check, subject))
    failed = report.of("failed")
    if failed:
        raise FamilyCheckError(f"{report.family}: {len(failed)} of {len(report.checks)} checks failed\n{report}")
    return report


def _checked_skips(skip: dict[str, str] | None) -> dict[str, str]:
    skip = dict(skip or {})
    unknown = sorted(set(skip) - set(FAMILY_CHECKS))
    if unknown:
        raise ValueError(f"check_family: no check called {', '.join(unknown)}; the checks: {', '.join(FAMILY_CHECKS)}")
    silent = sorted(name for name, why in skip.items() if not (isinstance(why, str) and why.strip()))
    if silent:
        raise ValueError(f"check_family: skipping {', '.join(silent)} needs a reason (skip={{name: 'why'}})")
    return skip


def _outcome(name: str, reason: str, check: Callable[[_Subject], str], subject: _Subject) -> FamilyCheck:
    """Run one check; an exception inside it is its failure (the others still run)."""
    if reason:
        return FamilyCheck(name, "skipped", reason)
    try:
        problem = check(subject)
    except Exception as e:  # noqa: BLE001 - any error is this check's failure, reported with the others
        problem = f"raised {type(e).__name__}: {str(e).strip()[:500]}"
    return FamilyCheck(name, "failed" if problem else "passed", problem)


def _subject(model: str, folder: Path, registry: Registry) -> _Subject:
    """The family behind ``model`` with its folder, processor, encoder and the mixed records encoded."""
    from vlft.data.encoding import SampleEncoder  # the encoder a run's data goes through
    from vlft.data.records import read_records  # the records as a run reads them
    from vlft.models.families import EMBEDDED_PREFIX  # '--model embedded:<name>'
    from vlft.models.loading import load_processor, model_config_and_family, resolve_model_path

    named = model if model.startswith(EMBEDDED_PREFIX) or Path(model).expanduser().exists() else EMBEDDED_PREFIX + model
    path = resolve_model_path(named, registry)
    _, family = model_config_and_family(path, registry)
    folder = folder / family.name
    processor = load_processor(path, family, registry)
    encoder = SampleEncoder(processor, family=family)
    records = read_records(_write_mixed_data(folder / "data", with_images=family.image_inputs is not None))
    return _Subject(registry, family, path, folder, processor, encoder, records, [encoder.encode(r) for r in records])


def _write_mixed_data(folder: Path, with_images: bool = True) -> Path:
    """``MIXED_RECORDS`` as a messages-layout JSONL (images drawn as the demo's products); text only where the
    family takes no images."""
    import random

    from vlft.data.demo import COLOURS, DEFECTS, QUESTIONS, answer_for, draw_product  # the demo task's words

    rng = random.Random(0)
    (folder / "imgs").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (sizes, turns) in enumerate(MIXED_RECORDS):
        sizes = sizes if with_images else ()
        images = []
        for k, (w, h) in enumerate(sizes):
            colour, defect = rng.choice(list(COLOURS)), rng.choice(list(DEFECTS))
            draw_product(colour, defect, rng).resize((w, h)).save(folder / "imgs" / f"r{i}_{k}.png")
            images.append(f"imgs/r{i}_{k}.png")
        messages = []
        for t in range(turns):
            placeholders = "<image>\n" * len(images) if t == 0 else ""
            answer = answer_for(rng.choice(list(COLOURS)), rng.choice(list(DEFECTS)))
            messages += [
                {"role": "user", "content": placeholders + QUESTIONS[t % len(QUESTIONS)]},
                {"role": "assistant", "content": answer},
            ]
        lines.append(json.dumps({"messages": messages, "images": images}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
