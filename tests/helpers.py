"""Helpers shared by test modules (a plain module: conftest files are not importable by name)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path


@functools.cache
def installed():
    """The installed plugins, loaded once per test process: what a test outside a run passes where vlft asks
    for a registry (a run passes its own; nothing in vlft falls back to a process-wide one)."""
    from vlft.registry import load_registry

    return load_registry()


def embedded_family():
    """The embedded default's model family (the installed plugins' default), for the embedded model's samples."""
    from vlft.models.embedded import default_family

    return default_family(installed())


def base_model(model_dir, attn="eager"):
    """The embedded base model in fp32 with one attention implementation for both towers."""
    from vlft.models.loading import load_model
    from vlft.policies import AttentionPolicy, PrecisionPolicy

    return load_model(model_dir, AttentionPolicy(attn, attn), PrecisionPolicy("fp32"), family=embedded_family())


def vlft_command() -> list[str]:
    """The installed ``vlft`` console script (``python -m vlft`` where it is not beside this Python)."""
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("vlft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vlft"]


def run_flags(values: dict) -> list[str]:
    """``vlft run`` flags for config ``values`` (``adapter`` as repeated ``--adapter-opt KEY=VALUE``; a switch
    such as ``resume=True`` as its bare flag, left out when False)."""
    args = []
    for key, value in values.items():
        if isinstance(value, bool):
            args += [f"--{key.replace('_', '-')}"] if value else []
        elif key == "adapter":
            args += [x for k, v in value.items() for x in ("--adapter-opt", f"{k}={v}")]
        else:
            args += [f"--{key.replace('_', '-')}", str(value)]
    return args


BRIEF = dict(backend="cpu", log_every=1, eval_every=0, eval_samples=1, max_new_tokens=1, save_every=0)


def brief_flags(**values) -> list[str]:
    """``vlft run`` flags of a brief run: quiet, on the CPU, losses logged each step, no evaluation during training
    and one sample scored after it, no checkpoints; ``values`` (``run_flags``' dict) over those."""
    return ["--quiet", *run_flags({**BRIEF, **values})]


def brief_config(**values):
    """The config a brief run (``brief_flags``) resolves to, for a test that builds the trainer itself."""
    from vlft.config import build_config

    return build_config({}, {**BRIEF, **{k: str(v) if isinstance(v, Path) else v for k, v in values.items()}})


def die_at_step(monkeypatch, n: int) -> None:
    """Make the ``n``-th training step of this process raise KeyboardInterrupt (as Ctrl-C during it would);
    ``monkeypatch.undo()`` puts the real step back."""
    import vlft.training.step

    real_step, calls = vlft.training.step.train_step, {"n": 0}

    def dying_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(vlft.training.step, "train_step", dying_step)


def cli_invoke(*args, registry=None) -> tuple[int, str]:
    """``vlft ARGS`` in this process through click (exit code, output); an exception other than click's exit
    is raised as it is. ``registry``: the one the command uses (``process_registry``)."""
    result = cli_result(*args, registry=registry)
    return result.exit_code, result.output


def cli_result(*args, registry=None):
    """``cli_invoke``'s click result, for a test that reads stdout and stderr apart."""
    from click.testing import CliRunner

    from vlft.cli import cli

    with process_registry(registry):
        result = CliRunner().invoke(cli, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@contextlib.contextmanager
def process_registry(registry=None):
    """``registry`` (a test's plugins beside vlft's: ``vlft.testing.registry_with``) as the process-wide one
    while the block runs, so a `vlft` command run in this process uses it; the previous one put back after.
    None: the process-wide registry as it is."""
    import vlft.registry

    saved = vlft.registry._default
    if registry is not None:
        vlft.registry._default = registry
    try:
        yield
    finally:
        vlft.registry._default = saved


def export_logits(run, merged, records, *, attn: str = "eager", rounded=None, **load) -> dict:
    """Logits at the real (non-pad) positions of ``records``, each as a float32 CPU tensor:

    - ``adapted``: the trained model as ``vlft eval`` loads it (base + adapter; ``load`` is passed to
      ``load_for_inference``: backend, precision, param_dtype...), under that policy's autocast;
    - ``base``: the same model with the adapter disabled, so a comparison is not one of base models;
    - ``exported``: the merged folder ``merged`` loaded by plain transformers in fp32 (attention ``attn``) on
      the same device, without autocast;
    - ``exported_rounded`` (with ``rounded``, a torch dtype): that merged model again under autocast to
      ``rounded``: the rounding that dtype alone costs on these inputs, for a tolerance measured side by side.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    from vlft.data.batching import collator_for, model_inputs, to_device
    from vlft.evaluation.inference import LoadOptions, load_for_inference
    from vlft.models.loss import autocast_context
    from vlft.registry import load_registry

    loaded = load_for_inference(load_registry(), str(run), None, LoadOptions(**load))
    batch = collator_for(loaded.processor, loaded.encoder.family)([loaded.encoder.encode(r) for r in records])
    inputs = model_inputs(to_device(batch, loaded.device))
    real = batch["attention_mask"].bool().to(loaded.device)  # padding positions' logits are nobody's answer
    plain = (
        AutoModelForImageTextToText.from_pretrained(str(merged), dtype=torch.float32, attn_implementation=attn)
        .to(loaded.device)
        .eval()
    )

    def logits(model, dtype):
        with torch.no_grad(), autocast_context(loaded.device, dtype):
            return model(**inputs).logits[real].float().cpu()

    out = {"adapted": logits(loaded.model, loaded.autocast_dtype)}
    with loaded.model.disable_adapter():
        out["base"] = logits(loaded.model, loaded.autocast_dtype)
    out["exported"] = logits(plain, None)
    if rounded is not None:
        out["exported_rounded"] = logits(plain, rounded)
    return out
