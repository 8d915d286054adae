"""Preference records: one prompt with a chosen and a rejected reply, both under the prompt's images; and
unpaired ones (KTO's): one prompt with one reply marked desirable or not.

Two layouts, as a JSON array or JSON Lines (README "Data", preference layouts):

- LLaMA-Factory: the prompt as ``conversations`` (``from``/``value``) or ``messages`` (``role``/``content``),
  ``chosen`` and ``rejected`` each one assistant message (or a list of them), ``images`` beside:
  ``{"conversations": [{"from": "human", "value": "<image>What is wrong?"}], "chosen": {"from": "gpt",
  "value": "a crack"}, "rejected": {"from": "gpt", "value": "a stain"}, "images": ["a.png"]}``
- TRL: ``prompt``, ``chosen`` and ``rejected`` as message lists (content strings or typed parts) or plain
  strings, ``images`` beside: ``{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
  "text": "What is wrong?"}]}], "chosen": [{"role": "assistant", "content": "a crack"}], "rejected": [...],
  "images": ["a.png"]}``

Unpaired, as KTO reads them (``parse_unpaired``):

- LLaMA-Factory: a conversation (``messages`` or ``conversations``) ending with the assistant's reply, its
  ``kto_tag`` column (LLaMA-Factory's demo names it ``label``) true for a desirable reply, false for an
  undesirable one, ``images`` beside;
- TRL: ``prompt`` and ``completion`` (message lists or strings) and ``label``, ``images`` beside.

``parse_preference`` reads one JSON object into the chosen conversation (a ``formats.Parsed``) with the
rejected conversation in its ``rejected`` turns; ``records.read_records_collecting(..., parse=parse_preference)``
then checks roles, resolves and opens the images and reports each problem with its file:line, as for any
record. Refused here: a missing side, a side that is not assistant turns, images that differ between the
sides (an image in a reply), and chosen and rejected replies that are the same.
"""

from __future__ import annotations

from vlft.data.formats import FormatProblem, Parsed, parse_record, stray_marker
from vlft.data.records import ROLE_ALIASES, _check_turns

SIDES = ("chosen", "rejected")
PROMPT_KEYS = ("prompt", "conversations", "conversation", "messages")


def is_preference(obj: dict) -> bool:
    """The object carries a preference pair (either side named)."""
    return any(k in obj for k in SIDES)


def parse_preference(obj: dict, add_placeholders: bool = False) -> Parsed:
    """The chosen conversation, its ``rejected`` the rejected one; ``FormatProblem`` says what to fix."""
    missing = [k for k in SIDES if obj.get(k) in (None, "", [])]
    if missing:
        raise FormatProblem(
            f"no '{missing[0]}' reply: a preference record needs both 'chosen' and 'rejected' "
            f"(its keys: {', '.join(sorted(map(str, obj)))})"
        )
    key = next((k for k in PROMPT_KEYS if k in obj), None)
    if key is None:
        raise FormatProblem(
            "a preference record needs its prompt beside 'chosen' and 'rejected': 'prompt' (TRL) or "
            f"'conversations'/'messages' (LLaMA-Factory); its keys: {', '.join(sorted(map(str, obj)))}"
        )
    turns_key = "messages" if key == "prompt" else key
    prompt = _turns(obj[key], "user", turns_key, key)
    rest = {k: v for k, v in obj.items() if k not in SIDES and k not in PROMPT_KEYS}
    sides = {}
    for side in SIDES:
        reply = _turns(obj[side], "assistant", turns_key, side)
        for i, turn in enumerate(reply):
            role = turn.get("role", turn.get("from"))
            if ROLE_ALIASES.get(role) != "assistant":
                raise FormatProblem(f"{side}: turn {i} has role {role!r}; a reply holds assistant turns only")
        try:
            sides[side] = parse_record({**rest, turns_key: [*prompt, *reply]}, add_placeholders)
        except FormatProblem as e:
            raise FormatProblem(f"{side}: {e}") from None
    chosen, rejected = sides["chosen"], sides["rejected"]
    if chosen.images != rejected.images or chosen.videos != rejected.videos:
        counts = [
            f"{len(p.images)} image(s)" + (f" and {len(p.videos)} video(s)" if p.videos else "")
            for p in (chosen, rejected)
        ]
        raise FormatProblem(
            f"chosen and rejected must share the prompt's images: chosen has {counts[0]}, rejected "
            f"{counts[1]}" + (" (different ones)" if counts[0] == counts[1] else "") + "; put images in the prompt only"
        )
    for side, parsed in sides.items():
        _prompt_replies_untrained(parsed, len(prompt))
        problem = _check_turns(parsed)
        if problem:
            raise FormatProblem(f"{side}: {problem}")
    n = len(prompt) + (1 if "system" in obj and obj["system"] is not None else 0)
    replies = [[t.text for t in p.turns[n:]] for p in (chosen, rejected)]
    if replies[0] == replies[1]:
        raise FormatProblem(
            f"chosen and rejected are the same reply ({replies[0][-1][:60]!r}): there is nothing to "
            "prefer; drop the record or give a different rejected reply"
        )
    marker = next((m for t in rejected.turns[n:] if (m := stray_marker(t.text))), None)
    if marker:
        raise FormatProblem(
            f"rejected: '{marker}' looks like an image marker vlft does not read; images belong in the prompt"
        )
    chosen.layout = f"preference ({'trl' if key == 'prompt' else key})"
    chosen.rejected = rejected.turns
    return chosen


def _turns(value, role: str, turns_key: str, name: str) -> list:
    """A prompt or a reply as turn objects of ``turns_key``'s layout: a message, a list of them, or a string."""
    if isinstance(value, str):
        return [{"role": role, "content": value} if turns_key == "messages" else {"from": role, "value": value}]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and all(isinstance(t, dict) for t in value):
        return list(value)
    raise FormatProblem(f"'{name}' must be a message, a list of messages or a string, got {type(value).__name__}")


def _prompt_replies_untrained(parsed: Parsed, n_prompt: int) -> None:
    """Assistant turns inside the prompt (an earlier exchange) stay in the context and out of the loss: only the
    side's own reply is scored."""
    system = 1 if parsed.turns and parsed.turns[0].role == "system" else 0
    for t in parsed.turns[: n_prompt + system]:
        if ROLE_ALIASES.get(t.role) == "assistant":
            t.loss = False


UNPAIRED_TAGS = ("label", "kto_tag")  # TRL's and LLaMA-Factory demo's name; LLaMA-Factory's column name


def parse_unpaired(obj: dict, add_placeholders: bool = False) -> Parsed:
    """The conversation up to and with its reply, ``desirable`` its tag; ``FormatProblem`` says what to fix."""
    tag = next((k for k in UNPAIRED_TAGS if k in obj), None)
    if tag is None:
        raise FormatProblem(
            "an unpaired preference record needs 'label' (or LLaMA-Factory's 'kto_tag'): true for "
            f"a desirable reply, false for an undesirable one (its keys: {', '.join(sorted(map(str, obj)))})"
        )
    if not isinstance(obj[tag], bool):
        raise FormatProblem(f"'{tag}' must be true (a desirable reply) or false (an undesirable one), got {obj[tag]!r}")
    rest = {k: v for k, v in obj.items() if k not in UNPAIRED_TAGS}
    if "prompt" in obj or "completion" in obj:  # TRL
        if obj.get("prompt") in (None, "", []) or obj.get("completion") in (None, "", []):
            raise FormatProblem("TRL's unpaired layout needs both 'prompt' and 'completion'")
        prompt = _turns(obj["prompt"], "user", "messages", "prompt")
        reply = _turns(obj["completion"], "assistant", "messages", "completion")
        for i, turn in enumerate(reply):
            if ROLE_ALIASES.get(turn.get("role", turn.get("from"))) != "assistant":
                raise FormatProblem(
                    f"completion: turn {i} has role {turn.get('role', turn.get('from'))!r}; a "
                    "completion holds assistant turns only"
                )
        rest = {k: v for k, v in rest.items() if k not in ("prompt", "completion")}
        parsed = parse_record({**rest, "messages": [*prompt, *reply]}, add_placeholders)
        _prompt_replies_untrained(parsed, len(prompt))
        layout = "unpaired (trl)"
    else:
        parsed = parse_record(rest, add_placeholders)
        if not parsed.turns or ROLE_ALIASES.get(parsed.turns[-1].role) != "assistant":
            raise FormatProblem(
                "the last turn must be the assistant's reply: it is what the tag marks desirable or not"
            )
        layout = f"unpaired ({parsed.layout})"
    problem = _check_turns(parsed)
    if problem:
        raise FormatProblem(problem)
    parsed.layout, parsed.desirable = layout, obj[tag]
    return parsed
