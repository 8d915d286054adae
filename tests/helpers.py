"""Helpers shared by test modules (a plain module: conftest files are not importable by name)."""

from __future__ import annotations


def base_model(model_dir, attn="eager"):
    """The embedded base model in fp32 with one attention implementation for both towers."""
    from vlft.models.loading import load_model
    from vlft.policies import AttentionPolicy, PrecisionPolicy

    return load_model(model_dir, AttentionPolicy(attn, attn), PrecisionPolicy("fp32"))


def vlft_command() -> list[str]:
    """The installed ``vlft`` console script (``python -m vlft`` where it is not beside this Python)."""
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("vlft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vlft"]
