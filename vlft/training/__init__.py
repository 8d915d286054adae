"""The training stage: the session (device, model, adapter, optimizer), the step, the loop, metrics,
checkpoints and resume, signals, FSDP2, torchrun.

Importing it needs no particular torch: the torch it trains with is checked when a run is planned
(``vlft.floors.require_torch``, from ``planning.preflight.plan_run``), with a message naming the version.
"""
