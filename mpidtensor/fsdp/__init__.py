"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on MPI: sharded parameters gathered per
module group with non-blocking collectives; HSDP on 2-D meshes; FSDP x TP and HSDP x TP;
``clip_grad_norm_`` over gradients on several meshes."""
from .api import FSDPModule, UnshardHandle, fully_shard
from .clip import clip_grad_norm_
from .mixed_precision import MixedPrecisionPolicy

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "UnshardHandle", "clip_grad_norm_", "fully_shard"]
