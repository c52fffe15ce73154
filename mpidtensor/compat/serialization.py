"""``torch.save`` and ``torch.load`` as the switch gives them to user code: DTensors saved
in torch's format (a plain torch process loads them), loaded as mpidtensor's.

``save`` is torch's with DTensors pickled as torch's DTensor (:mod:`mpidtensor.tensor.
torch_format`); ``load`` is torch's with torch's DTensor names read as mpidtensor's, so a
file this ``save`` wrote, one torch wrote, and one in mpidtensor's own format (``torch.save``
outside the switch, and files written before the switch saved torch's format) all give
mpidtensor's DTensors on the live mesh. A program outside the switch may call both
directly: its own ``torch.save``/``torch.load`` keep mpidtensor's format.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from ..tensor import torch_format

__all__ = ["load", "save"]

_TRUE = ("1", "y", "yes", "true")


def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    """``torch.save(obj, f, ...)`` writing DTensors in torch's format."""
    with torch_format.saving():
        torch.save(obj, f, *args, **kwargs)


def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: bool | None = None,
         mmap: bool | None = None, **pickle_load_args: Any) -> Any:
    """``torch.load(f, ...)`` with torch's DTensors (and older mpidtensor pickles) loaded as
    mpidtensor's."""
    with torch_format.loading():  # the weights_only unpickler's names
        if not _weights_only(weights_only, pickle_module):  # pickle's: a pickle module that maps them
            pickle_module, weights_only = torch_format.unpickler_module(pickle_module or pickle), False
        return torch.load(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **pickle_load_args)


def _weights_only(weights_only: bool | None, pickle_module: Any) -> bool:
    """Whether torch.load will use its weights-only unpickler (torch's rule: the argument,
    else True without a pickle module; its two environment variables)."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        return pickle_module is None and os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in _TRUE
    return bool(weights_only)
