"""A test's own plugin: writes down what each process's ``generate`` sampled, for the two-process GRPO test
(``tests/test_grpo.py::test_two_processes_sample_and_train``), which reads it beside the run's logged totals.

Loaded in torchrun's workers through ``VLFT_PLUGINS=grpo_samples`` with this folder on ``PYTHONPATH``; it wraps
the loaded model's ``generate`` (``vlft_patch_model``, before the adapter: PEFT's ``generate`` ends in it) and,
for every sampling call (``do_sample``), appends one line to ``rank-<RANK>.jsonl`` in the folder
``VLFT_TEST_SAMPLES`` names: the prompt ids and the new tokens of each returned sequence, as generate returned
them (nothing of GRPO's own counting). Greedy calls (evaluation examples) pass through unrecorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vlft.hookspecs import hookimpl

FOLDER_ENV = "VLFT_TEST_SAMPLES"


@hookimpl
def vlft_patch_model(backend, model, config, attention, family):
    folder = os.environ.get(FOLDER_ENV)
    if not folder:
        return None
    generate = model.generate

    def recording_generate(*args, **kwargs):
        sequences = generate(*args, **kwargs)
        if kwargs.get("do_sample"):
            prompt = kwargs["input_ids"]
            line = {"prompt": prompt.tolist(), "new": sequences[:, prompt.shape[1] :].tolist()}
            with (Path(folder) / f"rank-{os.environ.get('RANK', '0')}.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        return sequences

    model.generate = recording_generate
    return [f"grpo_samples: generate's sampled tokens written to {folder}"]


def characters(completions, references, **context):
    """A reward for tests (``--reward grpo_samples:characters``): each completion's length in characters, so
    the completions of one prompt are told apart from an untrained model's first step on."""
    return [len(c) / 10 for c in completions]
