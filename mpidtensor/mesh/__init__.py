"""Device meshes: ranks related by MPI Cartesian communicators (``Cart_create``), each mesh
dimension, slice or flattened group a ``Cart_sub``; GPU binding and the mislaunch check.

Importing this package changes nothing outside it: the abort hook (an uncaught exception
on one rank ends the job instead of hanging the others) is a process-wide effect
installed when the first mesh is built (:mod:`mpidtensor.runtime.effects`).
"""
from ..runtime import abort  # noqa: F401  (registers the abort hook with the first-mesh effects)
from .device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
