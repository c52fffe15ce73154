"""mpidtensor: PyTorch DTensor semantics on MPI.

Public names match ``torch.distributed.tensor``; launch with ``mpiexec``/``srun``.
"""
import torch as _torch

from .api import distribute_module, distribute_tensor
from .dtensor import DTensor, to_dtensor as _to_dtensor
from .factories import empty, full, ones, rand, randn, zeros
from .mesh import DeviceMesh, init_device_mesh
from .placements import Partial, Placement, Replicate, Shard
from . import ops  # noqa: F401  (registers the sharding rules)

_torch.Tensor.to_dtensor = _to_dtensor  # local_tensor.to_dtensor(device_mesh=..., placements=...)

# Optimizers and gradient clipping take their multi-tensor (foreach) kernels for DTensor
# parameters, on CPU too (one dispatch per op for all parameters, not one per parameter).
# Elementwise torch.optim optimizers step DTensor parameters on their local tensors
# (no dispatch per op) when gradients and state share the parameter's spec.
from . import foreach as _foreach  # noqa: E402
from . import local_step as _local_step  # noqa: E402

_foreach.install()
_local_step.install()

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
