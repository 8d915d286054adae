"""Built-in metric sinks for ``--report-to`` (a plugin, entry point ``sinks``): TensorBoard.

Other sinks (Weights & Biases, MLflow, ...) belong in their own plugins, answering ``vlft_metric_sink``
for their name exactly as this module does for ``tensorboard``.

Imports inside functions: `vlft plugins` imports every plugin to list it, so torch loads only when a
hook runs.
"""

from __future__ import annotations

from pathlib import Path

from vlft.contracts.sinks import MetricSink
from vlft.errors import ConfigError
from vlft.hookspecs import hookimpl


class TensorBoardSink(MetricSink):
    """Every numeric field of a metrics record as a scalar at its step, under ``RUN/tensorboard``."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


@hookimpl
def vlft_metric_sink(name, config):
    if name != "tensorboard":
        return None
    try:
        import tensorboard  # noqa: F401 - torch's writer needs it; say so before any weight is loaded
    except ImportError:
        raise ConfigError(
            "--report-to tensorboard needs the tensorboard package: pip install 'vlft[tensorboard]'"
        ) from None
    return lambda output: TensorBoardSink(Path(output) / "tensorboard")
