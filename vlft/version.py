"""vlft's release, read by ``vlft --version`` and re-exported as ``vlft.__version__``."""

__version__ = "0.1.0"
