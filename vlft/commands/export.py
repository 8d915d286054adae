"""``vlft export``: a merged model folder that plain transformers loads, or a clean adapter folder.

The merge goes through the method's ``vlft_merge_adapter`` hook, in fp32 on the host (merging in half
precision would round the update into the base weights twice); the result is then cast to ``--dtype``
and written with ``save_pretrained`` beside the processor (tokenizer, image processor, chat template),
so ``AutoModelForImageTextToText.from_pretrained`` and ``AutoProcessor.from_pretrained`` need no vlft.
The folder appears only when complete (written under a temporary name, then renamed).

A run that trained on 4-bit NF4 base weights (``--param-dtype nf4``, QLoRA) learned its update against
those weights as bitsandbytes dequantized them, not against the original checkpoint. By default its
export loads the base in NF4 as the run did (double quantization included), dequantizes it, merges in
fp32 and saves bf16: the merged model computes what the trained model computed. ``--merge-into
original`` merges into the checkpoint's own weights instead. Both print the caveat.

Tolerance against the adapter model's logits (fp32, embedded model): fp32 export under 1e-4 max abs
(summation order only; tested); bf16 export 0.13 max abs, 0.015 mean, on logits up to 3.8 (rounding
of the weights; measured, 97% of arg-max tokens agree).

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import click

from vlft.cli import user_errors
from vlft.errors import ConfigError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MERGE_INTO = ("auto", "original", "dequantized")


def _merge_base(source, merge_into: str) -> str:
    """ "dequantized" (the NF4 base the run trained on, dequantized) or "original" (the checkpoint's weights)."""
    four_bit = source.run_config.get("param_dtype") == "nf4"
    if merge_into == "auto":
        return "dequantized" if four_bit else "original"
    if merge_into == "dequantized" and not four_bit:
        where = (
            f"{source.run_dir}/config.json says param_dtype {source.run_config.get('param_dtype')!r}"
            if source.run_dir
            else f"{source.adapter_dir} is a bare adapter folder, with no run config to say how its base was quantized"
        )
        raise ConfigError(
            f"--merge-into dequantized is for runs that trained on NF4 base weights; {where}. Give the "
            "run folder of an nf4 run, or use --merge-into original"
        )
    return merge_into


def _require_four_bit_loading(registry) -> None:
    """Dequantizing as training did needs bitsandbytes' CPU 4-bit kernels here, checked before any loading."""
    from vlft.config import build_config
    from vlft.planning.plan import resolve_precision

    try:
        resolve_precision(registry, "cpu", build_config({}, {"backend": "cpu", "param_dtype": "nf4"}))
    except ConfigError as e:
        raise ConfigError(
            f"this run trained on NF4 base weights; merging into them as trained loads them in 4-bit "
            f"on the CPU and dequantizes them, which cannot run here ({e}). Install bitsandbytes "
            "(pip install 'vlft[qlora]'), or pass --merge-into original to merge into the "
            "checkpoint's own weights"
        ) from None


def four_bit_caveat(merge_base: str) -> str:
    """What a user must know about a merged QLoRA adapter (printed, and written into the model card)."""
    if merge_base == "dequantized":
        return (
            "caveat: this run trained on 4-bit NF4 base weights, so the adapter went into those weights "
            "dequantized, not into the original checkpoint: the merged model computes what the trained model "
            "computed, and its base part differs from the original checkpoint by the 4-bit rounding. "
            "Quantizing it to NF4 again rounds the merged update as well; to serve in 4-bit, serve the base "
            "in NF4 with the adapter (--adapter-only). --merge-into original merges into the checkpoint's "
            "own weights instead"
        )
    return (
        "caveat: this run trained on 4-bit NF4 base weights, and the adapter went into the original "
        "checkpoint's weights (--merge-into original): its update corrects a 4-bit rounding those weights do "
        "not have, so the merged model does not compute exactly what the trained model did. The default "
        "(--merge-into auto) merges into the dequantized NF4 weights it trained on"
    )


def model_card(source, title: str) -> str:
    """A README-style card: base model, method, hyper-parameters, data and scores, from the run folder."""
    lines = [f"# {title}", "", f"- method: {source.method}", f"- base model: {source.base_model}"]
    run = source.run_dir
    if run is not None:
        plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else {}
        config = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
        hp = plan.get("method", {}).get("hyperparameters", {})
        lines += [
            f"- hyper-parameters: lr {plan.get('method', {}).get('lr')}, "
            + ", ".join(f"{k}={v}" for k, v in hp.items()),
            f"- adapted modules: {len(plan.get('targets', {}).get('modules', {}))} "
            f"({plan.get('targets', {}).get('adapter_parameters', '?')} parameters)",
            f"- data: {config.get('data') or 'the embedded product-inspection set'}",
            f"- steps: {plan.get('training', {}).get('steps')}, batch size {config.get('batch_size')}, "
            f"backend {plan.get('backend', {}).get('name')}",
        ]
        if (run / "eval.json").is_file():
            ev = json.loads((run / "eval.json").read_text())
            for when in ("before", "after"):
                r = ev.get(when)
                if r:
                    fields = ", ".join(
                        f"{k} acc {v['accuracy']:.1%} F1 {v['f1']:.1%}" for k, v in r.get("fields", {}).items()
                    )
                    lines.append(
                        f"- {when} training: exact match {r['exact_match']:.1%} on {r['samples']} "
                        f"validation samples" + (f"; {fields}" if fields else "")
                    )
    lines += ["", "Written by `vlft export`."]
    return "\n".join(lines) + "\n"


def _fresh_output(output: str) -> Path:
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output {output} already exists and is not empty; choose a new folder")
    return out


def _publish(tmp: Path, out: Path) -> None:
    if out.exists():
        out.rmdir()  # empty, checked before
    os.replace(tmp, out)


@contextlib.contextmanager
def _staged(out: Path):
    """A temporary folder beside ``out``, renamed to it when the block completes, removed when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _export_adapter(registry, source, model, out: Path) -> None:
    """``--adapter-only``: the PEFT folder as it is, with a model card that says how vLLM serves it."""
    serving = _serving_lines(registry, source, model)
    with _staged(out) as tmp:
        shutil.copytree(source.adapter_dir, tmp, dirs_exist_ok=True)
        card = model_card(source, f"{source.method} adapter")
        (tmp / "README.md").write_text(card + "\n## Serving with vLLM\n\n" + "".join(f"- {s}\n" for s in serving))
    click.echo(f"adapter ({source.method}) copied to {out} with a model card")
    for line in serving:
        click.echo(line)


def _serving_lines(registry, source, model) -> list[str]:
    """vLLM's view of the adapter (names checked against the base model's modules), as lines to print."""
    from vlft.models.loading import resolve_model_path
    from vlft.models.serving import check_against_base

    base = model or source.base_model
    try:
        path = resolve_model_path(base, registry)
        return check_against_base(source.adapter_dir, path, registry).lines()
    except ConfigError as e:
        return [f"vLLM: names not checked: the base model {base!r} is not readable here ({e}); pass --model"]


@click.command()
@click.option(
    "--adapter",
    required=True,
    metavar="RUN_OR_ADAPTER_DIR",
    help="A run folder (from `vlft run`) or an adapter folder.",
)
@click.option("--model", default=None, help="The base model; default: the run's.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="The folder to write (new).")
@click.option(
    "--dtype",
    type=click.Choice(["auto", *DTYPES]),
    default="auto",
    show_default=True,
    help="Weights' dtype; auto: the base model's own.",
)
@click.option("--adapter-only", is_flag=True, help="Copy the adapter (PEFT folder) with a model card; no merge.")
@click.option(
    "--merge-into",
    type=click.Choice(MERGE_INTO),
    default="auto",
    show_default=True,
    help="The base weights the adapter is folded into. auto: for a run trained with --param-dtype nf4, "
    "its NF4 base dequantized (what it trained on; saved bf16 under --dtype auto; needs "
    "bitsandbytes), otherwise the checkpoint's own; original: the checkpoint's own.",
)
@user_errors
def export(adapter, model, output, dtype, adapter_only, merge_into):
    """Fold the adapter into the base weights and write a model folder that plain transformers loads."""
    import torch

    from vlft.evaluation.inference import LoadOptions, load_for_inference, locate_adapter
    from vlft.models.loading import load_model_config
    from vlft.registry import get_registry

    registry = get_registry()
    out = _fresh_output(output)
    source = locate_adapter(registry, adapter)
    if adapter_only:
        _export_adapter(registry, source, model, out)
        return
    merge_base = _merge_base(source, merge_into)
    if merge_base == "dequantized":
        _require_four_bit_loading(registry)
    caveat = four_bit_caveat(merge_base) if source.run_config.get("param_dtype") == "nf4" else None
    with _staged(out) as tmp:
        if merge_base == "dequantized":
            loaded = load_for_inference(
                registry, source, model, LoadOptions(backend="cpu", param_dtype="nf4", on_device=False, dequantize=True)
            )
        else:
            loaded = load_for_inference(
                registry,
                source,
                model,
                LoadOptions(backend="cpu", precision="fp32", param_dtype="fp32", on_device=False),
            )
        method = source.method
        merged = registry.pm.hook.vlft_merge_adapter(method=method, model=loaded.model)
        if merged is None:
            raise ConfigError(
                f"method {method} cannot fold its adapter into the base weights (its plugin does "
                "not implement vlft_merge_adapter); use --adapter-only to export the adapter"
            )
        if dtype == "auto" and merge_base == "dequantized":
            target = "bfloat16"  # the dequantized base weights are bf16 values: fp32 would double the file
        else:
            target = DTYPES.get(dtype) or str(
                getattr(load_model_config(loaded.model_path, registry), "dtype", None) or "float32"
            ).replace("torch.", "")
        merged = merged.to(getattr(torch, target))
        merged.save_pretrained(tmp, safe_serialization=True)
        loaded.processor.save_pretrained(tmp)
        card = model_card(source, f"{method} fine-tune, merged ({target})")
        (tmp / "README.md").write_text(card + (f"\n## Merged from a 4-bit run\n\n{caveat}.\n" if caveat else ""))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    into = " (its NF4 weights, dequantized)" if merge_base == "dequantized" else ""
    click.echo(f"merged {method} adapter into {loaded.model_path}{into}: {out} ({target}, {size / 2**20:.1f} MiB)")
    if caveat:
        click.echo(caveat, err=True)
