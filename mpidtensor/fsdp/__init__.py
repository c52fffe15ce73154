"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on MPI: sharded parameters gathered per
module group with non-blocking collectives; HSDP on 2-D meshes; FSDP x TP and HSDP x TP;
``clip_grad_norm_`` over gradients on several meshes; offload policies, extra forward
methods and the ``FSDPModule`` settings frameworks call; torch 2.13's ``DataParallelMeshDims``
(FSDP over the data-parallel dims of a full SPMD mesh), ``fully_shard`` of a list of modules
as one group, and ``share_comm_ctx``."""
from .api import fully_shard
from .clip import clip_grad_norm_
from .forward_method import register_fsdp_forward_method
from .module import FSDPModule, UnshardHandle, share_comm_ctx
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .spmd import DataParallelMeshDims

__all__ = [
    "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle",
    "clip_grad_norm_", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx",
]
