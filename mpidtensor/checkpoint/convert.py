"""Conversion between checkpoints and ``torch.save`` files, in one process without MPI."""
from __future__ import annotations

import os

import torch

from .plain import load_plain, save_plain


def to_torch_save(checkpoint_id: str | os.PathLike, path: str | os.PathLike) -> None:
    """Write the checkpoint's whole state (plain tensors, nested as saved) with ``torch.save``."""
    torch.save(load_plain(checkpoint_id), path)


def from_torch_save(path: str | os.PathLike, checkpoint_id: str | os.PathLike) -> None:
    """Make a checkpoint of the state a ``torch.save`` file holds (tensors must be plain)."""
    save_plain(torch.load(path, map_location="cpu", weights_only=True), checkpoint_id)
