"""Built-in reward functions (``--reward NAME[=ARGUMENT]``) for objectives that score generations (``grpo``),
offered through ``vlft_rewards`` as a third party would offer its own.

Each function scores completions against their record's reference (the assistant reply of the data), one
number per completion:

- ``fields``: the share of the reference's ``field: value`` pairs the completion names with the same value,
  read as ``vlft eval``'s field scorer reads answers (``colour: red, defect: none``); a reference without
  such pairs cannot be scored (an error before step 1: use ``exact``);
- ``exact``: 1 where the completion equals the reference after trimming and collapsing white space
  (``vlft eval``'s exact match), else 0;
- ``format=REGEX``: 1 where the whole (trimmed) completion matches REGEX, else 0;
- ``numeric`` (``numeric=TOL``): 1 where the last number in the completion equals the last number in the
  reference within relative tolerance TOL (default 1e-6), else 0; a reference without a number is an error.

Imports inside functions: the core's answer scorer (``vlft.evaluation.scoring``) loads when a reward is
built, at plan time, so listing the plugins stays light.
"""

from __future__ import annotations

import math
import re

from vlft import ConfigError, Reward, hookimpl

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@hookimpl
def vlft_rewards():
    return [
        Reward("fields", "share of the reference's 'field: value' pairs the completion gets right (vlft eval's "
                         "field scorer)", _plain("fields", fields_reward)),
        Reward("exact", "1 if the completion equals the reference (white space collapsed), else 0",
               _plain("exact", exact_reward)),
        Reward("format", "1 if the whole completion matches the regex, else 0", _format, argument="REGEX"),
        Reward("numeric", "1 if the completion's last number equals the reference's (relative tolerance, default "
                          "1e-6), else 0", _numeric, argument="TOLERANCE (optional)"),
    ]


def _plain(name, function):
    def build(argument):
        if argument is not None:
            raise ConfigError(f"--reward {name}={argument}: the {name} reward takes no argument")
        return function
    return build


def fields_reward(completions, references, **context):
    from vlft.evaluation.scoring import parse_fields  # the field reader of vlft eval, so the two agree

    out = []
    for completion, reference in zip(completions, references):
        wanted = parse_fields(reference)
        if not wanted:
            raise ValueError(f"the reference {reference!r} holds no 'field: value' pairs; score it with "
                             f"--reward exact (or another reward)")
        got = parse_fields(completion)
        out.append(sum(got.get(k) == v for k, v in wanted.items()) / len(wanted))
    return out


def exact_reward(completions, references, **context):
    from vlft.evaluation.scoring import normalise  # vlft eval's exact match, so the two agree

    return [float(normalise(c) == normalise(r)) for c, r in zip(completions, references)]


def _format(argument):
    if not argument:
        raise ConfigError("--reward format needs a regex the whole completion must match, e.g. "
                          "--reward 'format=colour: \\w+, defect: \\w+'")
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
