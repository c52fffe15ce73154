"""Distributed checkpoints, with the module layout and call shape of
``torch.distributed.checkpoint``.

``save``/``load``/``async_save`` write and read nested state dicts of DTensors, tensors,
values and ``Stateful`` objects (any layout in, any layout out; one data file per
writing rank), through a storage writer/reader (the native format by default);
``stateful`` has the ``Stateful`` protocol; ``state_dict`` the ``get_``/``set_``
helpers for models and optimizers; ``format_utils`` converts to and from
``torch.save`` files; ``plain`` reads a checkpoint in one process; ``metadata`` has
torch's ``Metadata`` classes, which ``save`` returns; ``filesystem`` and ``hf_storage``
torch's paths of the storage classes. Every format's save and load is one transaction
(``transaction``), each format (``formats/``) giving its encoding. The format:
docs/checkpoint-format.md.
"""
from .api import load, save
from .async_saver import AsyncCheckpointerType, HostStager, async_save
from .errors import CheckpointError
from .formats.dcp import FileSystemReader, FileSystemWriter
from .formats.native import NativeReader, NativeWriter
from .formats.safetensors import HuggingFaceStorageReader, HuggingFaceStorageWriter
from .metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorStorageMetadata
from .plain import dcp_to_torch_save, from_torch_save, load_plain, to_torch_save, torch_save_to_dcp
from .state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from .stateful import Stateful
from .storage import StorageReader, StorageWriter

__all__ = [
    "AsyncCheckpointerType",
    "BytesStorageMetadata",
    "CheckpointError",
    "ChunkStorageMetadata",
    "FileSystemReader",
    "FileSystemWriter",
    "HostStager",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "Metadata",
    "NativeReader",
    "NativeWriter",
    "StateDictOptions",
    "Stateful",
    "StorageReader",
    "StorageWriter",
    "TensorStorageMetadata",
    "async_save",
    "dcp_to_torch_save",
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
    "torch_save_to_dcp",
]
