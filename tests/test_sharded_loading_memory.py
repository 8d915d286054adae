"""``--shard fsdp`` loading, each process its own shares: no process's memory grows past its share of the weights
plus the stated overhead (``bench/loading_memory.py``'s bound, the plan's ``loading_bytes`` plus 64 MiB; its
resident memory also the safetensors pages it mapped, at most its share again).

A real ``vlft run --shard fsdp`` of 2 processes on the CPU (gloo) over a generated Qwen2.5-VL checkpoint of
0.3 GiB in fp32 (large enough that a whole model in one process is 4 bounds' slack over its share), each
process a ``bench/loading_probe.py`` worker that stops once its weights are read: loading, not the step, is
what this checks (the two loadings' equal losses are ``tests/parity/test_several_processes.py``'s; the multi-GB
figures are in docs/parallel.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a package of the repository, not an installed one
    sys.path.insert(0, str(ROOT))

from bench.loading_memory import SMALL, bound_violations, checkpoint, loading_figures, probed_run, weight_bytes  # noqa: E402


def test_each_process_loading_its_own_shares_holds_its_share_plus_the_stated_overhead(small_data, tmp_path):
    model = checkpoint(SMALL)
    whole, largest = weight_bytes(model)
    run = probed_run(model, small_data[0], tmp_path / "run", 2, "auto", stop="after_loading")
    assert run["loading"] == "each", run["loading"]
    assert not bound_violations(run, whole, largest)
    share = -(-whole // 2)
    for rank, point in run["ranks"].items():  # the weights did land in each process: the probe saw them
        grown = loading_figures(point, share)["own_growth_bytes"]
        assert grown > 0.9 * share, (rank, grown, share)
