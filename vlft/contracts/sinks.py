"""What a metric-sink plugin answers (``vlft_metric_sink``): where logged metrics go besides metrics.jsonl."""


class MetricSink:
    """Where logged metrics go besides ``metrics.jsonl`` (``--report-to``): returned by ``vlft_metric_sink``.

    ``write`` receives each record ``metrics.jsonl`` receives (``step`` plus scalars); ``close`` is
    called once at the end of the run. A plain object: the training loop calls it without hooks.
    """

    def write(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
