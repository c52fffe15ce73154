"""mpidtensor: PyTorch DTensor semantics on MPI.

Public names match ``torch.distributed.tensor``; launch with ``mpiexec``/``srun``.
Importing the package changes nothing in torch or Python: the process-wide effects
(the abort hook, ``Tensor.to_dtensor``, optimizer hooks...) are installed when the first
mesh is built; ``mpidtensor.runtime.effects.describe()`` lists them.
"""
from .api import distribute_module, distribute_tensor
from .dtensor import DTensor
from .factories import empty, full, ones, rand, randn, zeros
from .mesh import DeviceMesh, init_device_mesh
from .placements import Partial, Placement, Replicate, Shard
from .runtime.caches import clear_all as clear_cache
from .runtime.effects import effect as _effect
from .runtime.settings import settings
from . import ops  # noqa: F401  (registers the sharding rules)

# Optimizers and gradient clipping take their multi-tensor (foreach) kernels for DTensor
# parameters, on CPU too (one dispatch per op for all parameters, not one per parameter).
# Elementwise torch.optim optimizers step DTensor parameters on their local tensors
# (no dispatch per op) when gradients and state share the parameter's spec.
# Both patch torch's optimizer tables: process-wide effects, installed at the first mesh.
from . import foreach as _foreach  # noqa: E402
from . import local_step as _local_step  # noqa: E402

_effect("optimizer foreach kernels", "first mesh",
        "torch's foreach type lists take DTensor; global optimizer step pre/post hooks pick "
        "foreach kernels for CPU DTensor parameter groups")(_foreach.install)
_effect("local optimizer step", "first mesh",
        "global optimizer step hooks step elementwise optimizers on DTensor parameters' local "
        "tensors")(_local_step.install)

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
    "ones",
    "rand",
    "randn",
    "settings",
    "zeros",
]
