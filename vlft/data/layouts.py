"""The record layouts an objective names (``vlft.Layout``) as the core's readers, encoders and collators, and
the embedded demo task in each.

An objective with a layout of its own gives its ``RecordFormat`` (GRPO's prompts); ``record_format`` passes it
through, so the stages that read, check and batch records ask one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlft.contracts.objective import Layout
from vlft.data import demo
from vlft.data.formats import parse_record
from vlft.data.pairs import PairCollator, PairEncoder, UnpairedCollator, UnpairedEncoder
from vlft.data.preferences import parse_preference, parse_unpaired


@dataclass(frozen=True)
class Format:
    """A layout as the core reads it (``vlft.contracts.objective.RecordFormat``)."""

    description: str
    parse: Callable[..., Any]
    encoder: Callable[[Any], Any]
    collate: Callable[[Any], Any]


def _same(x):
    return x


FORMATS = {
    Layout.CONVERSATIONS: Format(Layout.CONVERSATIONS.description, parse_record, _same, _same),
    Layout.PREFERENCE_PAIRS: Format(Layout.PREFERENCE_PAIRS.description, parse_preference, PairEncoder, PairCollator),
    Layout.UNPAIRED_PREFERENCES: Format(
        Layout.UNPAIRED_PREFERENCES.description, parse_unpaired, UnpairedEncoder, UnpairedCollator
    ),
}
DEMO_WRITERS = {
    Layout.CONVERSATIONS: demo.write_demo_dataset,
    Layout.PREFERENCE_PAIRS: demo.write_demo_preferences,
    Layout.UNPAIRED_PREFERENCES: demo.write_demo_unpaired,
}


def record_format(layout) -> Any:
    """The reader, encoder and collator of ``layout``: a ``Layout``'s, or an objective's own format as given."""
    return FORMATS[layout] if isinstance(layout, Layout) else layout


def demo_files(objective, folder) -> tuple[Any, Any]:
    """(train, val) of the embedded demo task for ``objective``: its own (``Objective.demo_data``), or its
    layout's (an objective of its own layout without demo data trains on the conversations)."""
    own = objective.demo_data(folder)
    if own is not None:
        return own
    ds = DEMO_WRITERS.get(objective.layout, demo.write_demo_dataset)(folder)
    return ds.train, ds.val
