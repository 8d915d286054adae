"""The commands, each a thin layer over the stages: run, parity, doctor, data check, predict and eval,
export, report. Only the CLI (through ``vlft.builtin.commands``) imports them.
"""
