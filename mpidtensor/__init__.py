"""mpidtensor: PyTorch DTensor semantics on MPI.

Public names match ``torch.distributed.tensor``; launch with ``mpiexec``/``srun``.
Importing the package changes nothing in torch or Python; it starts MPI (mpi4py's default,
``runtime.effects.AT_IMPORT``). The process-wide effects (the abort hook,
``Tensor.to_dtensor``, optimizer hooks, the custom ops...) are installed when the first mesh
is built; ``mpidtensor.runtime.effects.describe()`` lists them.
"""
from .tensor.api import distribute_module, distribute_tensor
from .tensor.dtensor import DTensor
from . import dispatch as _dispatch  # noqa: F401  (installs DTensor's dispatcher)
from .tensor.factories import empty, full, ones, rand, randn, zeros
from .mesh import DeviceMesh, init_device_mesh
from .tensor.placements import Partial, Placement, Replicate, Shard, _StridedShard
from .runtime.caches import clear_all as clear_cache
from .runtime.settings import settings
from .compat.switch import install_torch_distributed
from . import ops  # noqa: F401  (registers the sharding rules)

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
    "clear_cache",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "init_device_mesh",
    "install_torch_distributed",
    "ones",
    "rand",
    "randn",
    "settings",
    "zeros",
]
