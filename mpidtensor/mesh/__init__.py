"""Device meshes, their MPI communicators, and collectives on torch tensors.

Importing this package (which any mpidtensor import does) installs the abort hook:
an uncaught exception on one rank ends the job instead of hanging the others.
"""
from . import abort
from .device_mesh import DeviceMesh, init_device_mesh

abort.install()

__all__ = ["DeviceMesh", "init_device_mesh"]
