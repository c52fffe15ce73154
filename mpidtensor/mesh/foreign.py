"""The one check at mpidtensor's entry points that take a mesh or placements: an object of
torch's own class where mpidtensor's belongs (torch's ``DeviceMesh``, ``DTensor`` or
placements) is a ``TypeError`` that says so and names the module the class came from,
instead of a misleading error later ("fully_shard needs a 1-D (FSDP) or 2-D (HSDP)
DeviceMesh, got DeviceMesh((fsdp=2), ...)", ``AttributeError: '_require_live'``).

Every rank runs the same program and builds the same kinds of objects, so the check raises
on every rank alike. It runs where a mesh enters (``distribute_tensor``, ``from_local``,
``fully_shard``, ``parallelize_module``...), never on the dispatch path: a mesh of
mpidtensor's class costs one ``type`` comparison.
"""
from __future__ import annotations

from typing import Any

from .device_mesh import DeviceMesh, current_mesh

__all__ = ["foreign_message", "refuse_torch_dtensor", "require_mesh"]


def require_mesh(mesh: Any, api: str) -> DeviceMesh:
    """``mesh`` if it is a live mpidtensor ``DeviceMesh``; ``None`` is the mesh of the
    innermost ``with mesh:`` block. Else ``TypeError`` (another class), ``ValueError`` (no
    mesh) or ``RuntimeError`` (freed), raised alike on every rank."""
    if mesh.__class__ is DeviceMesh or isinstance(mesh, DeviceMesh):
        mesh._require_live()
        return mesh
    if mesh is None:
        found = current_mesh()
        if found is None:
            raise ValueError(f"{api} needs a device_mesh (or a `with mesh:` block around it)")
        return require_mesh(found, api)
    raise TypeError(foreign_message(mesh, api, "DeviceMesh"))


def refuse_torch_dtensor(tensor: Any, api: str) -> None:
    """A ``TypeError`` if ``tensor`` is torch's own DTensor (a plain tensor passes)."""
    cls = type(tensor)
    if cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed"):
        raise TypeError(foreign_message(tensor, api, "DTensor"))


def foreign_message(value: Any, api: str, kind: str) -> str:
    """What to say when ``api`` gets ``value`` where mpidtensor's ``kind`` belongs."""
    cls = type(value)
    origin = f"{cls.__module__}.{cls.__qualname__}"
    if not cls.__module__.startswith("torch"):
        return f"{api} expects mpidtensor's {kind}, got {origin}: {value!r:.200}"
    return (f"{api} got torch's own {kind} ({origin}, made by torch's module {cls.__module__}), not mpidtensor's: "
            f"mpidtensor's APIs take mpidtensor's {kind}. Under the torch.distributed switch (python -m "
            f"mpidtensor.run) user code reaching torch.distributed.device_mesh, torch.distributed.tensor or "
            f"torch.distributed.init_device_mesh gets mpidtensor's; this one came from {cls.__module__} by a path "
            f"the switch does not route: code under torch.* (which keeps torch's classes), an import made before "
            f"the switch was installed, or a module that bound torch's names before it. Build it with "
            f"mpidtensor's class (mpidtensor.init_device_mesh, mpidtensor.Shard, ...).")
