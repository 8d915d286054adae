"""The training stage: the trainer that owns a run (model, adapter, optimizer, data order, checkpoints, metrics,
the loop and validation), how its parts are set up, the step, checkpoints and resume, signals, FSDP2, torchrun.

Importing it needs no particular torch: the torch it trains with is checked when a run is planned
(``vlft.floors.require_torch``, from ``planning.preflight.plan_run``), with a message naming the version.
"""
