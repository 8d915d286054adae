"""Qwen2.5-VL-7B's shape on one accelerator: LoRA and OFT step time and peak memory beside the memory plan.

    python bench/device_scale.py --backend cuda --out results/

No download: the model is built from the bundled 7B config with random bf16 weights directly on
the device. The settings are those of the published RTX 4090 / Ascend 910B comparison this project
starts from: the last 6 vision blocks plus text attention adapted, 448x448 images, about 256 text
tokens, batch 4. Everything goes through vlft's own pieces (plugin registry, backend policies,
method plugins, target selection, ``train_step``, the memory plan), so the figures are a run's.
Writes ``device-scale.json`` and ``device-scale.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODEL = "qwen2.5-vl-7b"
BATCH, TEXT_TOKENS, IMAGE_SIDE, VISION_LAST_N = 4, 256, 448, 6


def synthetic_batch(model_config, batch=BATCH, text=TEXT_TOKENS, side=IMAGE_SIDE):
    """``batch`` samples: vision start, the image's tokens, vision end, ``text`` random text tokens (all trained)."""
    import torch

    vc = model_config.vision_config
    grid_side = side // vc.patch_size
    patches = grid_side * grid_side
    image_tokens = patches // vc.spatial_merge_size**2
    g = torch.Generator().manual_seed(0)
    vocab = model_config.text_config.vocab_size
    special = {
        model_config.image_token_id,
        model_config.video_token_id,
        model_config.vision_start_token_id,
        model_config.vision_end_token_id,
    }
    allowed = torch.tensor([i for i in range(min(vocab, 151_643)) if i not in special])  # 151643+: Qwen's specials
    ids = []
    for _ in range(batch):
        body = allowed[torch.randint(0, len(allowed), (text,), generator=g)]
        ids.append(
            torch.cat(
                [
                    torch.tensor([model_config.vision_start_token_id]),
                    torch.full((image_tokens,), model_config.image_token_id),
                    torch.tensor([model_config.vision_end_token_id]),
                    body,
                ]
            )
        )
    input_ids = torch.stack(ids)
    labels = input_ids.clone()
    labels[:, : image_tokens + 2] = -100
    patch_dim = 3 * vc.temporal_patch_size * vc.patch_size**2
    host = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "mm_token_type_ids": (input_ids == model_config.image_token_id).long(),
        "pixel_values": torch.randn(batch * patches, patch_dim, generator=g),
        "image_grid_thw": torch.tensor([[1, grid_side, grid_side]] * batch),
    }
    return host, [(1, grid_side, grid_side)] * batch


def run(
    backend: str,
    out: Path,
    steps: int,
    methods: list[str],
    model_name: str = MODEL,
    text: int = TEXT_TOKENS,
    side: int = IMAGE_SIDE,
    checkpointing: tuple[str, ...] = ("off", "on"),
) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlft import measure
    from vlft.config import build_config
    from vlft.data.batching import label_count, to_device
    from vlft.models.adapting import compute_adapters_in_autocast_dtype, enable_checkpointing, upcast_trainable
    from vlft.models.loading import model_config_and_family, resolve_model_path
    from vlft.planning import memory, trace
    from vlft.planning.plan import choose_backend, require_available, resolve_policies
    from vlft.planning.preflight import plan_targets
    from vlft.registry import load_registry
    from vlft.training.step import StepPolicy, train_step

    registry = load_registry()
    choice = choose_backend(registry, backend)
    require_available(choice)
    path = resolve_model_path(model_name, registry)
    model_config, family = model_config_and_family(path, registry)
    results = {
        "backend": choice.info.name,
        "versions": choice.probe.versions,
        "model": model_name,
        "settings": {
            "batch": BATCH,
            "text_tokens": text,
            "image": f"{side}x{side}",
            "targets": f"text attention + last {VISION_LAST_N} vision blocks",
        },
        "runs": [],
    }
    # checkpointing off first, LoRA before OFT: the field report's rows come first, and each run's figures
    # are written as soon as it ends, so a step cut short by the device check's timeout keeps them
    for ckpt in checkpointing:
        for method in methods:
            config = build_config(
                {},
                {
                    "backend": choice.info.name,
                    "method": method,
                    "model": model_name,
                    "vision_last_n": VISION_LAST_N,
                    "batch_size": BATCH,
                    "grad_checkpointing": ckpt,
                },
            )
            setup = registry.first("vlft_setup_device", backend=choice.info.name, config=config)
            device = setup.device
            plan = resolve_policies(registry, config, path, model_config, choice, family=family)
            compute = getattr(torch, plan.precision.autocast_dtype or plan.precision.param_dtype)
            host, grids = synthetic_batch(model_config, text=text, side=side)
            shape = trace.BatchShape(BATCH, host["input_ids"].shape[1], grids)
            sk, _ = plan_targets(registry, plan, trace.skeleton(model_config, plan.attention, compute))
            if plan.precision.autocast_dtype:
                sk.to(compute)
                compute_adapters_in_autocast_dtype(sk)
            capacity = registry.hook.vlft_device_capacity(backend=choice.info.name, config=config)
            est = memory.plan_memory(
                memory.MemoryBasis(
                    sk,
                    model_config,
                    plan.precision.param_dtype,
                    plan.precision.autocast_dtype,
                    plan.family,
                    reserved_bytes=capacity.reserved_bytes if capacity else 0,
                    capacity_bytes=capacity.total_bytes if capacity else None,
                    capacity_source=capacity.source if capacity else "",
                ),
                shape,
            )
            est.checkpointing = ckpt == "on"
            del sk

            t0 = time.perf_counter()
            torch.manual_seed(0)
            with torch.device(device):  # random weights made on the device: no 16 GB host copy
                base = AutoModelForImageTextToText.from_config(
                    model_config,
                    dtype=getattr(torch, plan.precision.param_dtype),
                    attn_implementation=plan.attention.as_attn_implementation(),
                )
            registry.hook.vlft_patch_model(
                backend=choice.info.name, model=base, config=config, attention=plan.attention, family=plan.family
            )
            model = plan_targets(registry, plan, base)[0].to(device)
            upcast_trainable(model)
            if ckpt == "on":
                enable_checkpointing(model, vision_adapted=True, family=plan.family)
            if plan.precision.autocast_dtype:
                compute_adapters_in_autocast_dtype(model)
            build_s = time.perf_counter() - t0
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-5)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
            scaler = plan.precision.make_scaler() if plan.precision.loss_scaling else None
            autocast = getattr(torch, plan.precision.autocast_dtype) if plan.precision.autocast_dtype else None
            policy = StepPolicy(device, autocast, scaler, 1.0, 1, 1)
            batch = to_device(host, device)
            tokens = label_count(host)
            module = torch.get_device_module(device.type)
            sync = getattr(module, "synchronize", lambda *a: None)
            model.train()
            for _ in range(2):  # warm-up: kernels chosen, AdamW state made
                train_step(model, optimizer, scheduler, [batch], policy, tokens)
            sync()
            # the allocator's peak on a device; on the CPU (a smoke test of this script) live storages
            meter = None
            if hasattr(module, "reset_peak_memory_stats"):
                module.reset_peak_memory_stats(device)
            else:
                meter = measure.LiveTensorMeter(
                    [
                        *model.parameters(),
                        *model.buffers(),
                        *(v for st in optimizer.state.values() for v in st.values()),
                    ]
                )
                meter.__enter__()
            times, losses = [], []
            for _ in range(steps):
                sync()
                t = time.perf_counter()
                step_out = train_step(model, optimizer, scheduler, [batch], policy, tokens)
                sync()
                times.append(time.perf_counter() - t)
                losses.append(float(step_out.loss_sum) / tokens)
            if meter is not None:
                meter.__exit__(None, None, None)
            peak = meter.peak if meter is not None else int(module.max_memory_allocated(device))
            run = {
                "method": method,
                "checkpointing": ckpt == "on",
                "precision": plan.precision.name,
                "param_dtype": plan.precision.param_dtype,
                "attention": plan.attention.text,
                "trainable_parameters": sum(p.numel() for p in trainable),
                "median_step_s": statistics.median(times),
                "samples_per_s": BATCH / statistics.median(times),
                "peak_bytes": peak,
                "estimate_bytes": est.total_bytes() - est.reserved_bytes,
                "estimate_with_reserve_bytes": est.total_bytes(),
                "losses": losses,
                "build_s": build_s,
            }
            run["estimate/measured"] = run["estimate_bytes"] / peak
            results["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "losses"}), flush=True)
            write(results, out)
            del model, base, optimizer, batch
            getattr(module, "empty_cache", lambda: None)()
    write(results, out)
    return results


def write(results: dict, out: Path) -> None:
    by = {(r["method"], r["checkpointing"]): r for r in results["runs"]}
    if ("lora", False) in by and ("oft", False) in by:
        results["oft/lora step time"] = by[("oft", False)]["median_step_s"] / by[("lora", False)]["median_step_s"]
        results["oft/lora peak memory"] = by[("oft", False)]["peak_bytes"] / by[("lora", False)]["peak_bytes"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "device-scale.json").write_text(json.dumps(results, indent=2))
    (out / "device-scale.md").write_text(markdown(results))


def markdown(r: dict) -> str:
    gib = 2**30
    lines = [
        f"# {r['model']} shape on {r['backend']} ({r['versions'].get('gpu') or r['versions']})",
        "",
        f"Settings: {r['settings']}",
        "",
        "| method | checkpointing | precision | step | samples/s | peak | plan estimate | estimate/measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in r["runs"]:
        lines.append(
            f"| {x['method']} | {'on' if x['checkpointing'] else 'off'} | {x['precision']} "
            f"(weights {x['param_dtype']}) | {x['median_step_s'] * 1e3:.0f} ms | {x['samples_per_s']:.2f} | "
            f"{x['peak_bytes'] / gib:.2f} GiB | {x['estimate_bytes'] / gib:.2f} GiB | "
            f"{x['estimate/measured']:.3f} |"
        )
    if "oft/lora step time" in r:
        lines += [
            "",
            f"OFT/LoRA step time {r['oft/lora step time']:.3f}, peak memory "
            f"{r['oft/lora peak memory']:.3f} (checkpointing off).",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default="device-check-results")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--methods", default="lora,oft")
    ap.add_argument("--model", default=MODEL, help="a bundled config name or a model folder (its shape only)")
    ap.add_argument("--text-tokens", type=int, default=TEXT_TOKENS)
    ap.add_argument("--image-side", type=int, default=IMAGE_SIDE)
    ap.add_argument("--checkpointing", default="off,on", help="off, on, or both (off,on)")
    args = ap.parse_args(argv)
    run(
        args.backend,
        Path(args.out),
        args.steps,
        args.methods.split(","),
        args.model,
        args.text_tokens,
        args.image_side,
        tuple(args.checkpointing.split(",")),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
