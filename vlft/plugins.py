"""The registry's former name: ``vlft.plugins.load_registry`` (as older docs wrote it) keeps working for
plugins' tests. New code imports from ``vlft.registry``."""

from vlft.registry import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    Registry,
    get_registry,
    load_registry,
)

__all__ = ["DISABLE_ENV", "ENTRY_POINT_GROUP", "Registry", "get_registry", "load_registry"]
