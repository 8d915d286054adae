"""What every benchmark group shares, one module a concern.

Everything here goes through vlft's own set-up path (plugin registry, plan,
``load_model``, the method plugins' ``vlft_apply_adapter``), so the numbers
are those of a real run, on whatever backend ``--backend`` names.

- ``env``: the backend resolved once through the plugin hooks (``BenchEnv``),
  and the settings every group shares (batch size, targets);
- ``models``: the model sizes and the models built from them (adapted,
  frozen, base);
- ``data``: the mixed-length data set, batches encoded and moved;
- ``training``: optimizer, step policy and ``Trainer``, one ``train_step``;
- ``timing``: ``Interleaved``, the variants timed side by side;
- ``figures``: the figures a group reports, and its ``extra_info`` record;
- ``memory``: peak memory of one step, as each backend can measure it;
- ``counters``: host-device synchronisations inside a step.

The meters and counters that the tests use too live in ``vlft.measure``
(``SavedTensorMeter``, ``LiveTensorMeter``, ``HookCallCounter``), not here.
"""
