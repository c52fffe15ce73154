"""mpidtensor: PyTorch DTensor semantics on MPI.

Public names match ``torch.distributed.tensor``; launch with ``mpiexec``/``srun``.
"""
import torch as _torch

from .api import distribute_module, distribute_tensor
from .dtensor import DTensor, to_dtensor as _to_dtensor
from . import dispatch as _dispatch  # noqa: F401  (installs DTensor's dispatcher)
from .factories import empty, full, ones, rand, randn, zeros
from .mesh import DeviceMesh, init_device_mesh
from .placements import Partial, Placement, Replicate, Shard
from . import ops  # noqa: F401  (registers the sharding rules)

_torch.Tensor.to_dtensor = _to_dtensor  # local_tensor.to_dtensor(device_mesh=..., placements=...)

# The optimizer fast paths register their hooks as effects installed at the first mesh:
# multi-tensor (foreach) kernels for DTensor parameters on CPU too, and elementwise
# optimizers stepping DTensor parameters on their local tensors.
from .fast import foreach as _foreach, optim_step as _optim_step  # noqa: E402,F401

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "init_device_mesh",
    "ones",
    "rand",
    "randn",
    "zeros",
]
