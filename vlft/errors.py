"""Errors a user can act on.

A ``VlftError`` is caught by the CLI and printed without a traceback: its
message must say what is wrong, where, and how to fix it.
"""


class VlftError(Exception):
    """A problem with the user's input, configuration or machine."""


class ConfigError(VlftError):
    """A bad flag, config-file key or value."""


class DataError(VlftError):
    """A bad data file or record; the message names the file and line or record."""


class BackendUnavailable(VlftError):
    """The chosen backend cannot run on this machine; the message carries the probe's reason."""


class PluginError(VlftError):
    """A plugin's answer breaks its contract (a model family's field, or an error inside one of its functions);
    the message names the plugin and the field."""


def call_plugin(owner: str, what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, one of a plugin's functions (``what``: its field, ``owner``: the plugin in words),
    an error inside it raised as a PluginError naming both; vlft's own errors (a bad record) pass as they are."""
    try:
        return fn(*args, **kwargs)
    except VlftError:
        raise
    except Exception as e:
        raise PluginError(f"{owner}: {what} raised {type(e).__name__}: {e}") from e
