"""Distributed checkpoints, with the call shape of ``torch.distributed.checkpoint``.

``save``/``load`` write and read nested state dicts of DTensors, tensors and values
(any layout in, any layout out; one data file per writing rank); ``state_dict`` has
the ``get_``/``set_`` helpers for models and optimizers; ``plain`` reads or writes a
checkpoint in one process without MPI; ``convert`` goes to and from ``torch.save``
files. The format: docs/checkpoint-format.md.
"""
from .api import load, save
from .convert import from_torch_save, to_torch_save
from .format import CheckpointError
from .plain import load_plain
from .state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "CheckpointError",
    "StateDictOptions",
    "from_torch_save",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "load",
    "load_plain",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "to_torch_save",
]
