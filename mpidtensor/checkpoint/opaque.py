"""Tensor subclasses whose blocks cannot be viewed as bytes (torchao's ``NF4Tensor``,
other wrapper subclasses): each rank's local block is stored as its ``torch.save``
bytes, as torch DCP's ``FileSystemWriter`` stores every chunk, and restored with
``torch.load(weights_only=True)`` and ``copy_`` into a target holding the same box.

Whether a leaf is such a subclass is decided by the type of its local block, which
every rank exchanges with the leaf's metadata (:func:`.shards.leaf_meta`), so all ranks
decide alike. Opaque bytes cannot be resharded: a target box must be a saved box.
"""
from __future__ import annotations

import io as pyio
from typing import Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..tensor.dtensor import DTensor
from .errors import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]


def class_name(t: torch.Tensor) -> str | None:
    """The qualified class of ``t``'s local block when it is a wrapper subclass that is
    stored opaquely; None for a plain tensor (an ``nn.Parameter`` of one included) and
    for a subclass that hands out its values as plain bytes (torchao's float8 training
    weights unwrap to their high-precision tensor: stored raw, they reshard on load)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if type(local) is torch.Tensor or not is_traceable_wrapper_subclass(local) or _reads_as_bytes(local):
        return None
    return f"{type(local).__module__}.{type(local).__qualname__}"


def _reads_as_bytes(local: torch.Tensor) -> bool:
    """Whether the subclass gives a plain byte view of its values (what the raw writers
    take); NF4 does not. Ranks exchange the verdict with the leaf's metadata, so one that
    differs raises on every rank."""
    try:
        view = local.detach()[(0,) * local.ndim if local.numel() else ...].reshape(-1).view(torch.uint8)
    except Exception:  # noqa: BLE001 - a subclass refuses the ops in its own ways
        return False
    return type(view) is torch.Tensor


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """The ``torch.save`` bytes of ``t``'s local block (detached, on the CPU)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    buf = pyio.BytesIO()
    torch.save(local.detach().cpu(), buf)
    return np.frombuffer(buf.getvalue(), np.uint8)


def from_bytes(raw: np.ndarray | bytes, key: str) -> torch.Tensor:
    """The block that :func:`to_bytes` stored (of the leaf ``key``), loaded on the CPU with
    ``weights_only=True``; a ``CheckpointError`` saying how to allow a refused class."""
    try:
        return torch.load(pyio.BytesIO(memoryview(raw)), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(
            f"the saved block of {key!r} does not load with torch.load(weights_only=True) "
            f"({type(err).__name__}: {err}); if the checkpoint is trusted and its class is refused, "
            f"allow it with torch.serialization.add_safe_globals") from None


def kind_error(key: str, saved: str | None, target: str | None) -> str | None:
    """Why a target of class ``target`` cannot load ``key`` saved as ``saved`` (each None
    for a plain tensor): subclasses and plain tensors do not load into each other."""
    if (saved is None) == (target is None):
        return None
    return (f"{key!r} is {_kind(saved)} in the checkpoint but {_kind(target)} in the state dict: tensor "
            "subclasses and plain tensors do not load into each other (load into the saved kind, then convert)")


def _kind(cls: str | None) -> str:
    return "a plain tensor" if cls is None else f"a {cls}"


def layout_error(key: str, cls: str, saved: Sequence[Box], targets: Sequence[Box]) -> str | None:
    """Why the boxes ``targets`` of ``key`` cannot be filled from its opaque ``saved``
    boxes (each non-empty target box must be one of them); None when they can."""
    saved = [(tuple(s), tuple(n)) for s, n in saved]
    if all(b in saved or 0 in b[1] for b in targets):
        return None
    return (f"{key!r} ({cls}) was saved as opaque torch.save blocks {saved}, which cannot be resharded "
            f"into the target boxes {list(dict.fromkeys(targets))}: load it into the layout it was saved from")
