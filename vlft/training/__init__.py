"""The training stage: the trainer that owns a run (model, adapter, optimizer, data order, checkpoints, metrics,
the loop and validation), how its parts are set up, the step, checkpoints and resume, signals, FSDP2, torchrun.
"""

import torch as _torch

from vlft.floors import torch_too_old as _torch_too_old

if (_too_old := _torch_too_old(_torch.__version__)) is not None:
    raise ImportError(_too_old)
