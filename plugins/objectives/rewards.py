"""Built-in reward functions (``--reward NAME[=ARGUMENT]``) for objectives that score generations (``grpo``),
offered through ``vlft_rewards`` as a third party would offer its own.

Each function scores completions against their record's reference (the assistant reply of the data), one
number per completion:

- ``format=REGEX``: 1 where the whole (trimmed) completion matches REGEX, else 0;
- ``numeric`` (``numeric=TOL``): 1 where the last number in the completion equals the last number in the
  reference within relative tolerance TOL (default 1e-6), else 0; a reference without a number is an error.

Every scorer (``vlft_scorers``: ``fields``, ``exact``, ``anls``, ``relaxed``, ``iou``, ...) is a reward too: the
core offers each one as ``--reward NAME`` beside these, so a reward and ``vlft eval``'s figure are one function.
"""

from __future__ import annotations

import math
import re

from vlft import ConfigError, Reward, hookimpl

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@hookimpl
def vlft_rewards():
    return [
        Reward("format", "1 if the whole completion matches the regex, else 0", _format, argument="REGEX"),
        Reward(
            "numeric",
            "1 if the completion's last number equals the reference's (relative tolerance, default 1e-6), else 0",
            _numeric,
            argument="TOLERANCE (optional)",
        ),
    ]


def _format(argument):
    if not argument:
        raise ConfigError(
            "--reward format needs a regex the whole completion must match, e.g. "
            "--reward 'format=colour: \\w+, defect: \\w+'"
        )
    try:
        pattern = re.compile(argument)
    except re.error as e:
        raise ConfigError(f"--reward format={argument}: not a regular expression ({e})") from None

    def format_reward(completions, references, **context):
        return [float(pattern.fullmatch(c.strip()) is not None) for c in completions]

    return format_reward


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def _numeric(argument):
    try:
        tolerance = 1e-6 if argument is None else float(argument)
    except ValueError:
        raise ConfigError(f"--reward numeric={argument}: the argument is a relative tolerance (a number)") from None
    if tolerance < 0:
        raise ConfigError(f"--reward numeric={argument}: the tolerance must not be negative")

    def numeric_reward(completions, references, **context):
        out = []
        for completion, reference in zip(completions, references):
            want = last_number(reference)
            if want is None:
                raise ValueError(f"the reference {reference!r} holds no number")
            got = last_number(completion)
            out.append(float(got is not None and math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance)))
        return out

    return numeric_reward
