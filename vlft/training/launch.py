"""Multi-process runs through torchrun (``torch.distributed.run``), not a launcher of our own.

``vlft run --nproc-per-node N ...`` re-runs the same command under torchrun;
``torchrun -m vlft run ...`` works directly too. torchrun's elastic agent
stops every process when one fails and reports the failing rank.

A worker ends with ``os._exit`` once its run is done (``end_worker``): see there for why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def wanted(self) -> bool:
        """A multi-process launch is asked for, and we are not already inside one."""
        return (self.nproc_per_node > 1 or self.nnodes > 1) and "LOCAL_RANK" not in os.environ


def torchrun_command(opts: LaunchOptions, vlft_args: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={opts.nproc_per_node}",
        f"--nnodes={opts.nnodes}",
        f"--node-rank={opts.node_rank}",
    ]
    if opts.nnodes == 1 and opts.master_port is None:
        # torchrun's own rendezvous binds port 0 and keeps the socket: a port found free and then
        # closed here could be taken by another job (a second test suite) before torchrun binds it
        cmd.append("--standalone")
    else:
        cmd += [f"--master-addr={opts.master_addr or '127.0.0.1'}", f"--master-port={opts.master_port or 29500}"]
    return cmd + ["-m", "vlft", *vlft_args]


def relaunch(opts: LaunchOptions, vlft_args: list[str]) -> int:
    """Run ``vlft <vlft_args>`` in ``nproc_per_node`` processes; return torchrun's exit code."""
    env = dict(os.environ)
    # each process gets its share of the cores, not all of them
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // opts.nproc_per_node)))
    return subprocess.call(torchrun_command(opts, vlft_args), env=env)


_IN_GROUP: list[bool] = []


def joined_group() -> None:
    """Note that this process joined a process group of several processes (it is a torchrun worker)."""
    _IN_GROUP.append(True)


def end_worker(code) -> None:
    """Exit now with ``code`` (a ``SystemExit`` code) if this process joined a group of several processes
    (``vlft run`` calls it once the run is done, or interrupted with its checkpoint written).

    Such a worker skips the interpreter's finalization, which can abort a run that finished well: the gloo
    group outlives ``destroy_process_group`` (FSDP's device mesh holds it), and a gloo worker thread that
    drops the last reference to a finished collective's tensors (``all_gather_object``'s, the evaluation's last
    collective) takes the GIL; during finalization that ends the thread mid-C++ and the process dies with
    SIGABRT, "terminate called without an active exception" (pytorch/pytorch#190489). A late thread needs a
    busy machine: 3 of 30 two-process gloo jobs that ended this way aborted beside two busy cores, none of 70
    with this exit. Every output is written and closed by then; only the standard streams need flushing.
    A run that fails exits non-zero through its error as before."""
    if not _IN_GROUP:
        return
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
