"""What stops a run between steps: SIGTERM or Ctrl-C (``StopRequest``), and too many non-finite steps.

SIGTERM or a first SIGINT sets a flag the loop reads between steps (under
torchrun the flag is all-reduced, so every rank stops at the same step); a
second SIGINT interrupts at once.

Under torchrun the flag travels on the host: an asynchronous all-reduce over a gloo group of host tensors
(``host_group``), started after one step and read after the next, so checking it never waits for the device
(a stop asked during step k takes effect after step k + 1).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlft.errors import VlftError

_HOST_GROUP: list = []


def host_group():
    """A process group over every process for host (CPU) tensors: the default group where it is gloo, else
    a gloo group made once (collectively: every process makes it at the same call, its first use)."""
    dist = torch.distributed
    if dist.get_backend() == "gloo":
        return None
    if not _HOST_GROUP:
        _HOST_GROUP.append(dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


def host_all_reduce(values, dtype, op=None):
    """Start an all-reduce of host ``values`` over ``host_group``; returns (work, array): ``array`` holds the
    result once ``work.wait()`` returned. Host memory on every backend: reading it waits for no device."""
    array = np.asarray(values, dtype=dtype)
    kwargs = {"op": op} if op is not None else {}
    work = torch.distributed.all_reduce(torch.from_numpy(array), group=host_group(), async_op=True, **kwargs)
    return work, array


class Interrupted(Exception):
    """Training stopped at a step boundary on a signal; the checkpoint of that step is written."""

    def __init__(self, step: int, signum: int, checkpoint: Path | None):
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}")
        self.step, self.signum, self.checkpoint = step, signum, checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process killed by the signal: 143, 130


class NonFiniteStop(VlftError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


class StopRequest:
    """SIGTERM/SIGINT handlers that ask the loop to stop after the current step (main thread only)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}  # signal number -> the handler signal.signal replaced
        self._pending = None  # (work, array): the flag all-reduced after the previous step

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            # a second Ctrl-C: stop at once; checkpoints are renamed into place only when whole
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
            f"(Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        if self._pending is not None and exc[0] is None:  # every process started the same reductions
            self._pending[0].wait()
        self._pending = None
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
        return False

    def agreed(self, world_size: int, device=None) -> int | None:
        """The signal every rank acts on: any rank's, all-reduced when there are several processes. There
        the answer is the reduction started at the previous call (every rank calls once per step), so no
        call waits for the device, and every rank stops at the same step, one step after the signal."""
        if world_size <= 1:
            return self.signum
        value = 0
        if self._pending is not None:
            work, array = self._pending
            work.wait()  # started a step ago, on the host
            value = int(array[0])
        self._pending = None if value else host_all_reduce([self.signum or 0], np.int32, torch.distributed.ReduceOp.MAX)
        return value or None
