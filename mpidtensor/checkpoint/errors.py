"""The checkpoint package's error (problems are listed by ``runtime.agreement.raise_listed``)."""
from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state dict it is loaded into, or is corrupt."""
