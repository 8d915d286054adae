"""A torchrun worker for test_several_processes.py (not a test): the sharded model of a checkpoint, its logits on a
fixed batch, and its adapter saved through vlft's sharded saving path.

    torchrun --nproc-per-node 2 fsdp_worker.py CONFIG.json CHECKPOINT OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vlft.config import build_config
from vlft.data.batching import model_inputs, to_device
from vlft.registry import get_registry
from vlft.training.trainer import build_trainer


def main(config_path: str, checkpoint: str, out: str) -> None:
    config = build_config({}, json.loads(Path(config_path).read_text()))
    import vlft.training.setup  # where the trainer finds load_model

    def refuse(*args, **kwargs):  # each process reads only its own shares: none loads the whole checkpoint
        raise AssertionError(f"rank {config.rank} loaded the whole checkpoint")

    vlft.training.setup.load_model = refuse
    s = build_trainer(get_registry(), config, resume_from=Path(checkpoint))
    assert s.sharded and s.config.world_size == 2
    batch = s.collate([s.plan.encoder.encode(r) for r in s.plan.val_records[:4]])
    s.model.eval()
    with torch.no_grad():
        logits = s.model(**model_inputs(to_device(batch, s.device))).logits
    s.save_adapter(Path(out) / "adapter")  # collective: gathered on every process, written by rank 0
    skip = non_finite_step_is_not_applied(s, batch)
    if config.rank == 0:
        torch.save({"logits": logits, "batch": batch, "skip": skip}, Path(out) / "sharded.pt")
    torch.distributed.destroy_process_group()


def non_finite_step_is_not_applied(s, batch) -> dict:
    """Steps on a batch whose pixels are NaN: skipped on every process, and each process's shards of the
    adapter and of the AdamW state (restored from the checkpoint) come back bit for bit; both as the CPU
    does it (the step not taken) and as an accelerator does (taken and undone shard by shard on the device)."""
    import dataclasses

    from vlft.planning.sharding import local
    from vlft.training.step import train_step_on

    def shards():
        params = [local(p).clone() for p in s.model.parameters() if p.requires_grad]
        state = [local(v).clone() for st in s.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return params, state

    before = shards()
    poisoned = {**batch, "pixel_values": torch.full_like(batch["pixel_values"], float("nan"))}
    s.model.train()
    skipped = []
    for on_host in (True, False):
        out = train_step_on(
            s.model, s.optimizer, s.scheduler, [poisoned], dataclasses.replace(s.policy, flags_on_host=on_host)
        )
        skipped.append(bool(out.skipped))
    after = shards()
    same = all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
    return {"skipped": all(skipped), "unchanged": same, "state_tensors": len(before[1])}


if __name__ == "__main__":
    from vlft.training.launch import end_worker

    main(*sys.argv[1:4])
    end_worker(0)  # as vlft run's workers leave: without the finalization that can abort a finished gloo job
