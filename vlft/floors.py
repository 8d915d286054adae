"""The versions vlft needs, checked without importing them: torch 2.6 for ``torch.nn.utils.get_total_norm``
(the gradient norm without clipping) and the public ``torch.distributed.fsdp.fully_shard`` (FSDP2).
"""

from __future__ import annotations

import re

from vlft.errors import ConfigError

TORCH_FLOOR = "2.6"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def torch_too_old(version: str) -> str | None:
    """The message for a torch older than ``TORCH_FLOOR``, or None."""
    if _release(version)[:2] >= _release(TORCH_FLOOR)[:2]:
        return None
    return (
        f"torch {version} is older than vlft needs ({TORCH_FLOOR}): training uses "
        f"torch.nn.utils.get_total_norm and torch.distributed.fsdp.fully_shard. "
        f"Install a newer one: pip install 'torch>={TORCH_FLOOR}' (with its matching torchvision)"
    )


def require_torch() -> None:
    """Stop, with ``torch_too_old``'s message, where the installed torch is older than ``TORCH_FLOOR``: checked
    when a run is planned, before anything of it is loaded (importing vlft's stages needs no such torch)."""
    import torch  # the face loads torch only when asked, as here

    too_old = torch_too_old(torch.__version__)
    if too_old is not None:
        raise ConfigError(too_old)
