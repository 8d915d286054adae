"""A ``vlft run`` worker that records its own host memory around loading: run it where torchrun runs ``-m vlft``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/loading_probe.py OUT.json run ARGS...

Each process writes ``OUT.json.<rank>`` (rewritten at every point, since a torchrun worker ends with
``os._exit``) with ``/proc/self/status``'s figures at four points:

* ``imports``: torch, transformers and the trainer imported, nothing built;
* ``before_loading``: the run's plan made, entering the model's construction (``setup.base_model``);
* ``after_loading``: the model sharded and its weights read (``setup.place`` returned), before step 1;
* ``after_step_1``: the first optimizer step done.

The kernel's high-water mark (``VmHWM``) is reset to the current resident size on entering the model's
construction (``/proc/self/clear_refs``, 5), so ``after_loading``'s ``VmHWM`` is the loading's own peak and
``after_step_1``'s the peak of loading and the first step. ``VmHWM`` counts the process's own memory
(``RssAnon``) and the pages of memory-mapped files it touched (``RssFile``: safetensors maps its files and
copies each slice out), which are the kernel's page cache, reclaimable, not the process's. The kernel keeps no
peak of ``RssAnon`` alone, so a thread samples it every 5 ms from the reset to step 1's end (``anon_peak``, ``file_peak``).

The probe wraps two functions of ``vlft.training.setup`` before the trainer imports them; the run is otherwise
the CLI's own. ``VLFT_PROBE_STOP=after_loading`` ends each process there (exit 0), for a measurement of loading
alone.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def status() -> dict[str, int]:
    """The ``FIELDS`` of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


class Probe:
    def __init__(self, path: str):
        self.path = f"{path}.{os.environ.get('RANK', '0')}"
        self.points: dict[str, dict] = {}
        self.anon_peak = self.file_peak = 0
        self.sampling = False
        self.loading: str | None = None

    def mark(self, point: str) -> None:
        now = status()
        if self.sampling:
            now.update(anon_peak=max(self.anon_peak, now["RssAnon"]), file_peak=max(self.file_peak, now["RssFile"]))
        self.points[point] = {**now, "t": time.monotonic(), "loading": self.loading}
        with open(self.path, "w") as f:
            json.dump(self.points, f)
        if os.environ.get("VLFT_PROBE_STOP") == point:
            sys.stdout.flush()
            os._exit(0)

    def reset_peaks(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current VmRSS (Linux >= 4.0)
        now = status()
        self.anon_peak, self.file_peak = now["RssAnon"], now["RssFile"]
        if not self.sampling:
            self.sampling = True
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self.sampling:
            now = status()
            self.anon_peak = max(self.anon_peak, now["RssAnon"])
            self.file_peak = max(self.file_peak, now["RssFile"])
            time.sleep(0.005)


def main() -> int:
    probe = Probe(sys.argv[1])
    import transformers  # noqa: F401  (a run imports it; counted in the baseline)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import vlft.training.setup as setup

    base_model, place = setup.base_model, setup.place

    def probed_base_model(*args, **kwargs):
        probe.mark("before_loading")
        probe.reset_peaks()
        return base_model(*args, **kwargs)

    def probed_place(model, plan, device):
        place(model, plan, device)
        probe.loading = plan.sharding.loading  # "each" or "rank0": which way the plan chose
        probe.mark("after_loading")

    setup.base_model, setup.place = probed_base_model, probed_place

    def after_step(optimizer, args, kwargs):
        if "after_step_1" not in probe.points:
            probe.mark("after_step_1")
            probe.sampling = False

    register_optimizer_step_post_hook(after_step)
    import vlft.training.trainer  # noqa: F401  (after the wraps: it imports base_model and place by name)
    from vlft.cli import main as vlft_main

    probe.mark("imports")
    return vlft_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
