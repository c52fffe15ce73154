"""torch's module path of the safetensors storage classes
(``torch.distributed.checkpoint.hf_storage``); they live in :mod:`.formats.safetensors`."""
from .formats.safetensors import HuggingFaceStorageReader, HuggingFaceStorageWriter

__all__ = ["HuggingFaceStorageReader", "HuggingFaceStorageWriter"]
