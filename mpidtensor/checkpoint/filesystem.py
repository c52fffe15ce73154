"""torch's module path of the torch DCP layout's storage classes
(``torch.distributed.checkpoint.filesystem``); they live in :mod:`.formats.dcp`."""
from .formats.dcp import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
