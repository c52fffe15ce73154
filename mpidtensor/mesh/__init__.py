"""Device meshes, their MPI communicators, and collectives on torch tensors."""
from .device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
