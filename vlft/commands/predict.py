"""``vlft predict`` and ``vlft eval``: a trained adapter (or a base or merged model) on new inputs.

Both load through ``vlft.infer`` (the backend, precision and attention policies of ``vlft run``) and
generate with ``vlft.evaluate``, so ``vlft eval`` gives the numbers ``vlft run`` wrote for the same
records, decoding and batch.

Imports inside functions: the CLI imports this module at start to register its command, so torch
and the stages load only when the command runs (`vlft --help` stays fast).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from vlft.cli import user_errors
from vlft.errors import ConfigError


def model_options(fn):
    """The flags that choose what to load and how: the same names as ``vlft run``'s."""
    options = [
        click.option(
            "--adapter",
            "adapter",
            default=None,
            metavar="RUN_OR_ADAPTER_DIR",
            help="A run folder (from `vlft run`) or an adapter folder.",
        ),
        click.option(
            "--model",
            default=None,
            help="Base model (with --adapter: overrides the run's) or a merged model; "
            "default: the run's base, else the embedded model.",
        ),
        click.option("--backend", default="auto", show_default=True, help="Backend plugin, as for `vlft run`."),
        click.option(
            "--precision",
            type=click.Choice(["auto", "fp32", "bf16", "fp16"]),
            default="auto",
            show_default=True,
            help="Compute precision, as for `vlft run`.",
        ),
        click.option(
            "--param-dtype",
            type=click.Choice(["auto", "fp32", "bf16", "fp16", "nf4"]),
            default="auto",
            show_default=True,
            help="Base weights' dtype, as for `vlft run`; nf4: the base in 4-bit, as a "
            "run trained with --param-dtype nf4 computed (double quantization as the run had it).",
        ),
        click.option("--attn", default=None, help="Attention implementation, as for `vlft run`."),
        click.option(
            "--max-pixels", type=int, default=None, help="Cap on each image's pixel count; default: the run's."
        ),
        click.option("--batch-size", type=int, default=16, show_default=True, help="Records per generate call."),
        click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Longest answer."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load(adapter, model, backend, precision, param_dtype, attn, max_pixels):
    from vlft.evaluation.inference import LoadOptions, load_for_inference
    from vlft.registry import get_registry

    return load_for_inference(
        get_registry(), adapter, model, LoadOptions(backend, precision, param_dtype, attn, max_pixels)
    )


def _what(loaded) -> str:
    if loaded.source is not None:
        return f"{loaded.source.method} adapter {loaded.source.adapter_dir} on {loaded.model_path}"
    return f"model {loaded.model_path}"


def _check_positive(**values) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def prompt_record(images: tuple[str, ...], prompt: str):
    """One ``Record`` from ``--image`` and ``--prompt`` (an empty reply marks where to answer)."""
    from vlft.data.records import IMAGE_PLACEHOLDER, Record, Turn, load_image

    sources = []
    for image in images:
        path = Path(image).expanduser()
        if not path.is_file():
            raise ConfigError(f"--image {image}: file not found")
        try:
            load_image(str(path.resolve()))
        except (OSError, ValueError) as e:
            raise ConfigError(f"--image {image}: not a readable image ({e.__class__.__name__}: {e})") from None
        sources.append(str(path.resolve()))
    if IMAGE_PLACEHOLDER in prompt:
        if prompt.count(IMAGE_PLACEHOLDER) != len(sources):
            raise ConfigError(
                f"--prompt has {prompt.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} placeholder(s) "
                f"but {len(sources)} --image; give one --image per placeholder"
            )
        text = prompt
    else:  # images first, as the training data's user turns have them
        text = IMAGE_PLACEHOLDER * len(sources) + prompt
    return Record([Turn("user", text), Turn("assistant", "")], sources, "command line")


def _prompt_text(record) -> str:
    last = max(i for i, t in enumerate(record.turns) if t.role == "assistant")
    return "\n".join(f"{t.role}: {t.text}" for t in record.turns[:last])


@click.command()
@model_options
@click.option(
    "--data",
    default=None,
    type=click.Path(dir_okay=False),
    help="A data file in any format vlft reads; predictions go to --output.",
)
@click.option("--output", default=None, type=click.Path(dir_okay=False), help="Predictions JSONL (with --data).")
@click.option("--image", "images", multiple=True, help="An image for --prompt (repeatable).")
@click.option("--prompt", default=None, help="A question: the answer is printed.")
@click.option("--temperature", type=float, default=None, help="Sample at this temperature (default: greedy).")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling threshold (default: greedy).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampling.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors  # params: click passes each option as an argument of its own
def predict(
    adapter,
    model,
    backend,
    precision,
    param_dtype,
    attn,
    max_pixels,
    batch_size,
    max_new_tokens,
    data,
    output,
    images,
    prompt,
    temperature,
    top_p,
    seed,
    quiet,
):
    """Answer the records of a data file (to JSONL) or one --prompt with --image(s), with an adapter or a model."""
    from vlft.data.records import read_records
    from vlft.evaluation.generation import Decoding, generate_answers
    from vlft.evaluation.inference import write_atomically

    _check_positive(batch_size=batch_size, max_new_tokens=max_new_tokens)
    if (data is None) == (prompt is None):
        raise ConfigError("give either --data FILE (with --output) or --prompt TEXT (with --image, repeatable)")
    if data is not None and output is None:
        raise ConfigError("--data needs --output, the predictions JSONL to write")
    if data is None and not images:
        raise ConfigError("--prompt needs at least one --image")
    sampling = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
    # inputs are checked before any weight is loaded
    records = read_records(data) if data is not None else [prompt_record(images, prompt)]
    loaded = _load(adapter, model, backend, precision, param_dtype, attn, max_pixels)
    if sampling:
        import torch

        torch.manual_seed(seed)
    if prompt is not None:
        answer = generate_answers(
            loaded.model,
            loaded.encoder,
            records,
            loaded.device,
            Decoding(max_new_tokens, 1, loaded.autocast_dtype, sampling),
        )[0]
        click.echo(answer)
        return
    from tqdm.auto import tqdm

    click.echo(
        f"predicting {len(records)} records of {data} with {_what(loaded)} on {loaded.plan.backend.info.name}", err=True
    )
    with tqdm(
        total=len(records),
        desc="predict",
        unit="record",
        disable=quiet,
        mininterval=0.2 if sys.stderr.isatty() else 15.0,
    ) as bar:
        answers = generate_answers(
            loaded.model,
            loaded.encoder,
            records,
            loaded.device,
            Decoding(max_new_tokens, batch_size, loaded.autocast_dtype, sampling),
            on_batch=bar.update,
        )
    lines = []
    for record, answer in zip(records, answers):
        reference = record.reference or None  # a record whose last reply is empty asks for an answer
        lines.append(
            json.dumps(
                {
                    "where": record.where,
                    "id": record.id,
                    "prompt": _prompt_text(record),
                    "prediction": answer,
                    "reference": reference,
                }
            )
        )
    write_atomically(Path(output), "".join(line + "\n" for line in lines))
    click.echo(f"wrote {len(lines)} predictions to {output}")


def eval_output(output: str | None, source, data: str) -> Path:
    """Where ``vlft eval`` writes: ``--output``, else ``eval-<data file stem>.json`` in the adapter's run folder
    (in the working folder for a bare adapter folder or a model without one). The run's own ``eval.json``
    (what ``vlft run`` wrote) is refused as a target."""
    run_dir = source.run_dir if source is not None else None
    out = Path(output) if output else (run_dir or Path(".")) / f"eval-{Path(data).stem}.json"
    if run_dir is not None and out.resolve() == (run_dir / "eval.json").resolve():
        raise ConfigError(f"--output {out} is the eval.json `vlft run` wrote; choose another file")
    return out


@click.command("eval")
@model_options
@click.option("--data", required=True, type=click.Path(dir_okay=False), help="A data file with reference answers.")
@click.option("--samples", type=int, default=None, help="Score only the first N records (default: all).")
@click.option(
    "--output",
    default=None,
    type=click.Path(dir_okay=False),
    help="Scores JSON; default: eval-<data file name>.json in the run folder of --adapter (beside the "
    "run's own eval.json, which is never overwritten), else here.",
)
@click.option("--compare-base", is_flag=True, help="Also score the base model (adapter off) on the same records.")
@click.option(
    "--scorer",
    default="auto",
    show_default=True,
    metavar="NAME[,NAME]",
    help="Scorers by name, comma-separated (see `vlft scorers`; built in: exact, fields, anls, relaxed, "
    "choice, iou, bleu, rouge, cider, cer, json), auto (exact match, plus fields, relaxed, iou or json where "
    "every reference takes that form) or your MODULE:FUNCTION, as `vlft run --scorer`.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors  # params: click passes each option as an argument of its own
def eval_command(
    adapter,
    model,
    backend,
    precision,
    param_dtype,
    attn,
    max_pixels,
    batch_size,
    max_new_tokens,
    data,
    samples,
    output,
    compare_base,
    scorer,
    quiet,
):
    """Score an adapter, a base or a merged model on a data file with the chosen scorers (--scorer): exact match,
    per-field accuracy and F1, ANLS, relaxed accuracy, IoU, BLEU, ... (`vlft scorers`)."""
    from vlft.data.records import read_records
    from vlft.evaluation.generation import Decoding, evaluate_generation
    from vlft.evaluation.inference import write_atomically
    from vlft.evaluation.scoring import format_table
    from vlft.planning.scorers import choose_scorers, describe_line, scoring_context
    from vlft.registry import get_registry

    _check_positive(batch_size=batch_size, max_new_tokens=max_new_tokens, samples=samples)
    if compare_base and adapter is None:
        raise ConfigError("--compare-base needs --adapter (without one the model scored is the base)")
    records = read_records(data)
    if samples:
        records = records[:samples]
    references = [r.reference for r in records]
    offered = get_registry().scorers
    # the names and the references are checked before any weight loads; the family's box convention after
    choose_scorers(offered, scorer, references, **scoring_context(records, None))
    loaded = _load(adapter, model, backend, precision, param_dtype, attn, max_pixels)
    out = eval_output(output, loaded.source, data)
    chosen = choose_scorers(offered, scorer, references, **scoring_context(records, loaded.plan.family))
    click.echo(f"scorers: {describe_line(chosen.describe())}", err=True)

    from tqdm.auto import tqdm

    def scores(m, desc: str):
        with tqdm(
            total=len(records),
            desc=desc,
            unit="record",
            disable=quiet,
            mininterval=0.2 if sys.stderr.isatty() else 15.0,
        ) as bar:
            return evaluate_generation(
                m,
                loaded.encoder,
                records,
                loaded.device,
                Decoding(max_new_tokens, autocast_dtype=loaded.autocast_dtype),
                on_batch=bar.update,
                scorers=chosen.chosen,
            )

    before = None
    if compare_base:
        with loaded.model.disable_adapter():
            before = scores(loaded.model, "eval base")
    after = scores(loaded.model, "eval")
    result = {
        "data": str(data),
        "samples": len(records),
        "model": loaded.model_path,
        "adapter": str(loaded.source.adapter_dir) if loaded.source else None,
        "method": loaded.source.method if loaded.source else None,
        "backend": loaded.plan.backend.info.name,
        "precision": loaded.plan.precision.describe(),
        "max_new_tokens": max_new_tokens,
        "scorers": chosen.describe(),
        "base": before,
        "scores": after,
    }
    write_atomically(out, json.dumps(result, indent=2, default=str))
    click.echo(format_table(before, after))
    click.echo("(before: the base model, adapter off; after: " + _what(loaded) + ")")
    click.echo(f"scores written to {out}")
