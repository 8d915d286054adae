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
from vlft.plugins import get_registry
from vlft.session import prepare
from vlft.train import model_inputs, to_device


def main(config_path: str, checkpoint: str, out: str) -> None:
    config = build_config({}, json.loads(Path(config_path).read_text()))
    if config.rank != 0:  # only rank 0 reads the weights; the others receive their shares from it
        import vlft.model

        def refuse(*args, **kwargs):
            raise AssertionError(f"rank {config.rank} read the model's weights")

        vlft.model.load_model = refuse
    s = prepare(get_registry(), config, resume_from=Path(checkpoint))
    assert s.sharded and s.config.world_size == 2
    batch = s.collate([s.encoder.encode(r) for r in s.val_records[:4]])
    s.model.eval()
    with torch.no_grad():
        logits = s.model(**model_inputs(to_device(batch, s.device))).logits
    to_save = s.adapter_to_save(s.model)  # collective
    if config.rank == 0:
        s.save_adapter(to_save, Path(out) / "adapter")
        torch.save({"logits": logits, "batch": batch}, Path(out) / "sharded.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
