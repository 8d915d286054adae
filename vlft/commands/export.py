"""``vlft export``: a merged model folder that plain transformers loads, or a clean adapter folder.

The merge goes through the method's ``vlft_merge_adapter`` hook, in fp32 on the host (merging in half
precision would round the update into the base weights twice); the result is then cast to ``--dtype``
and written with ``save_pretrained`` beside the processor (tokenizer, image processor, chat template),
so ``AutoModelForImageTextToText.from_pretrained`` and ``AutoProcessor.from_pretrained`` need no vlft.
The folder appears only when complete (written under a temporary name, then renamed).

Tolerance against the adapter model's logits (fp32, embedded model): fp32 export under 1e-4 max abs
(summation order only; tested); bf16 export 0.13 max abs, 0.015 mean, on logits up to 3.8 (rounding
of the weights; measured, 97% of arg-max tokens agree).

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import click

from vlft.cli import user_errors
from vlft.errors import ConfigError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def model_card(source, title: str) -> str:
    """A README-style card: base model, method, hyper-parameters, data and scores, from the run folder."""
    lines = [f"# {title}", "", f"- method: {source.method}", f"- base model: {source.base_model}"]
    run = source.run_dir
    if run is not None:
        plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else {}
        config = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
        hp = plan.get("method", {}).get("hyperparameters", {})
        lines += [f"- hyper-parameters: lr {plan.get('method', {}).get('lr')}, "
                  + ", ".join(f"{k}={v}" for k, v in hp.items()),
                  f"- adapted modules: {len(plan.get('targets', {}).get('modules', {}))} "
                  f"({plan.get('targets', {}).get('adapter_parameters', '?')} parameters)",
                  f"- data: {config.get('data') or 'the embedded product-inspection set'}",
                  f"- steps: {plan.get('training', {}).get('steps')}, batch size {config.get('batch_size')}, "
                  f"backend {plan.get('backend', {}).get('name')}"]
        if (run / "eval.json").is_file():
            ev = json.loads((run / "eval.json").read_text())
            for when in ("before", "after"):
                r = ev.get(when)
                if r:
                    fields = ", ".join(f"{k} acc {v['accuracy']:.1%} F1 {v['f1']:.1%}"
                                       for k, v in r.get("fields", {}).items())
                    lines.append(f"- {when} training: exact match {r['exact_match']:.1%} on {r['samples']} "
                                 f"validation samples" + (f"; {fields}" if fields else ""))
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
@click.option("--adapter", required=True, metavar="RUN_OR_ADAPTER_DIR",
              help="A run folder (from `vlft run`) or an adapter folder.")
@click.option("--model", default=None, help="The base model; default: the run's.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="The folder to write (new).")
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True,
              help="Weights' dtype; auto: the base model's own.")
@click.option("--adapter-only", is_flag=True, help="Copy the adapter (PEFT folder) with a model card; no merge.")
@user_errors
def export(adapter, model, output, dtype, adapter_only):
    """Fold the adapter into the base weights and write a model folder that plain transformers loads."""
    import torch

    from vlft.evaluation.inference import load_for_inference, locate_adapter
    from vlft.registry import get_registry

    registry = get_registry()
    out = _fresh_output(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if adapter_only:
            source = locate_adapter(registry, adapter)
            serving = _serving_lines(registry, source, model)
            shutil.copytree(source.adapter_dir, tmp, dirs_exist_ok=True)
            card = model_card(source, f"{source.method} adapter")
            (tmp / "README.md").write_text(card + "\n## Serving with vLLM\n\n" + "".join(f"- {s}\n" for s in serving))
            _publish(tmp, out)
            click.echo(f"adapter ({source.method}) copied to {out} with a model card")
            for line in serving:
                click.echo(line)
            return
        loaded = load_for_inference(registry, adapter, model, backend="cpu", precision="fp32", param_dtype="fp32",
                                    on_device=False)
        method = loaded.source.method
        merged = registry.pm.hook.vlft_merge_adapter(method=method, model=loaded.model)
        if merged is None:
            raise ConfigError(f"method {method} cannot fold its adapter into the base weights (its plugin does "
                              "not implement vlft_merge_adapter); use --adapter-only to export the adapter")
        from vlft.models.loading import load_model_config

        target = DTYPES.get(dtype) or str(getattr(load_model_config(loaded.model_path), "dtype", None)
                                           or "float32").replace("torch.", "")
        merged = merged.to(getattr(torch, target))
        merged.save_pretrained(tmp, safe_serialization=True)
        loaded.processor.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(loaded.source, f"{method} fine-tune, merged ({target})"))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    click.echo(f"merged {method} adapter into {loaded.model_path}: {out} ({target}, {size / 2**20:.1f} MiB)")
