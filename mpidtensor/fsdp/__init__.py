"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on MPI: sharded parameters gathered per
module group with non-blocking collectives; HSDP on 2-D meshes; FSDP x TP."""
from .api import FSDPModule, UnshardHandle, fully_shard
from .mixed_precision import MixedPrecisionPolicy

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "UnshardHandle", "fully_shard"]
