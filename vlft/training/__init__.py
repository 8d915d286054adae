"""The training stage: the session (device, model, adapter, optimizer), the step, the loop, metrics,
checkpoints and resume, signals, FSDP2, torchrun.
"""

import torch as _torch

from vlft.floors import torch_too_old as _torch_too_old

if (_too_old := _torch_too_old(_torch.__version__)) is not None:
    raise ImportError(_too_old)
