"""Two processes on the host (gloo), each taking vlft's step under DDP with the sync counter on: the syncs a
step makes under torchrun, where the label count and the stop flag are reduced across processes."""

from __future__ import annotations

import tempfile
from pathlib import Path


def two_process_syncs(records, method: str = "lora", world: int = 2, timeout_s: float = 300) -> list[dict]:
    """Per process: the counter's summary over one step plus the stop-flag check that follows it."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init = Path(folder) / "rendezvous"
        procs = [
            ctx.Process(target=_worker, args=(rank, world, str(init), method, list(records), queue))
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        results = [queue.get(timeout=timeout_s) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    failed = [r for r in results if "error" in r]
    if failed:
        raise RuntimeError(failed[0]["error"])
    return sorted(results, key=lambda r: r["rank"])


def _worker(rank: int, world: int, init: str, method: str, records, queue) -> None:
    import traceback

    import torch

    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        queue.put({"rank": rank, **_count(rank, world, method, records)})
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _count(rank: int, world: int, method: str, records) -> dict:
    import torch

    from bench.support.counters import sync_counter
    from bench.support.data import encode_batches, to_device
    from bench.support.env import BATCH_SIZE, resolve_env
    from bench.support.models import adapted_model, model_size
    from bench.support.training import trainer
    from vlft.data.batching import label_count
    from vlft.models.embedded import embedded_model_dir
    from vlft.training.signals import StopRequest

    env = resolve_env("cpu", 1)
    size = model_size("embedded", str(embedded_model_dir(env.registry)), env.registry)
    model = adapted_model(env, size, method)[0]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    tr = trainer(env, ddp, as_on_a_device=True)
    tr.policy.world_size = world
    mine = records[rank * BATCH_SIZE : (rank + 1) * BATCH_SIZE]
    host = encode_batches(size, mine)[0]
    dev = to_device(env, host)
    stop = StopRequest()
    tr.step(host, dev)  # first step: lazy initialisation out of the way
    stop.agreed(world, env.device)
    tokens = label_count(host)  # on the host, before the step, as the trainer's step does
    counter = sync_counter(env.device, host_tensors=tr.host_state())
    with counter:
        out = tr.step_counted(tokens, dev)
        agreed = stop.agreed(world, env.device)
    stop.__exit__(None, None, None)  # waits for the flag's reduction still in flight
    return {"syncs": counter.summary(), "global_tokens": out.global_units, "local_tokens": tokens, "agreed": agreed}
