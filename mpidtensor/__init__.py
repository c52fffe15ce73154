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

# As torch's DTensor does: optimizers and gradient clipping take their multi-tensor
# (foreach) kernels for DTensor parameters wherever they would for plain tensors.
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types  # noqa: E402
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types  # noqa: E402

for _types in (_optim_foreach_types, _util_foreach_types):
    if DTensor not in _types:
        _types.append(DTensor)

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
