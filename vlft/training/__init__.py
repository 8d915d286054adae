"""The training stage: the session (device, model, adapter, optimizer), the step, the loop, metrics,
checkpoints and resume, signals, FSDP2, torchrun.
"""
