"""``metrics.jsonl`` and the metric sinks (``--report-to``): what the loop logs, one line per logged step."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step (rank 0 writes)."""

    def __init__(self, path: Path | None, sinks: list | None = None):
        self.sinks = sinks or []  # policies.MetricSink objects, opened at set-up (--report-to)
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step``: a resumed run rewrites them."""
        if self.path is None or not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
