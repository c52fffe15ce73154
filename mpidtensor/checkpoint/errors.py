"""The checkpoint package's error, and the one way it lists the problems it found."""
from __future__ import annotations

__all__ = ["CheckpointError", "raise_if"]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state dict it is loaded into, or is corrupt."""


def raise_if(problems: list[str | None], cls: type[Exception] = CheckpointError) -> None:
    """Raise one ``cls`` naming every distinct problem in ``problems`` (Nones skipped), if
    any. Local: call it with a list every rank holds alike (or agree on it first)."""
    found = [p for p in problems if p]
    if found:
        raise cls("; ".join(dict.fromkeys(found)))
