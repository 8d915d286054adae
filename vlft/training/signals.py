"""What stops a run between steps: SIGTERM or Ctrl-C (``StopRequest``), and too many non-finite steps.

SIGTERM or a first SIGINT sets a flag the loop reads between steps (under
torchrun the flag is all-reduced, so every rank stops at the same step); a
second SIGINT interrupts at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import torch

from vlft.errors import VlftError


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
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            # a second Ctrl-C: stop at once; checkpoints are renamed into place only when whole
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
              f"(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
        return False

    def agreed(self, world_size: int, device) -> int | None:
        """The signal every rank acts on: any rank's, all-reduced when there are several processes."""
        if world_size <= 1:
            return self.signum

        flag = torch.tensor([self.signum or 0], device=device, dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        value = int(flag.item())
        return value or None
