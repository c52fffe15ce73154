"""``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``: FSDP
over the data-parallel dims of a full SPMD mesh (torch 2.13).

The parameters are already DTensors on ``full_mesh`` (tensor parallelism, or
``distribute_module``), ``Replicate()`` on every dim the ``DataParallelMeshDims`` names.
FSDP shards them over the ``shard`` dims (several are flattened into one, as torch does)
and, for HSDP, replicates them over the ``replicate`` dims (likewise flattened); the
placements on the other dims are kept. Underneath this is FSDP x TP: the data-parallel
mesh is cut from ``full_mesh`` and each parameter's layout on the remaining dims is its
"TP" layout (``SpmdLayout.tp_view``), so the sharded parameters live on ``full_mesh``
itself when one dim shards and at most one replicates, in that order, as torch's do. The
module computes with the unsharded parameters as DTensors on ``full_mesh`` with their
original placements. Every check depends only on names, meshes and placements, which all
ranks share, so bad input raises the same ``ValueError`` on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..mesh import DeviceMesh
from ..mesh.relations import joint_mesh
from ..tensor.dtensor import DTensor
from ..tensor.placements import Replicate
from ..tensor.spec import DTensorSpec


@dataclass
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data-parallel (torch 2.13's class): ``shard``, the
    dim name(s) FSDP shards over (several: flattened into one), ``replicate``, the HSDP
    (or, alone, DDP) replication dim name(s) (several: flattened). One of them is needed."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


class SpmdLayout:
    """The data-parallel mesh cut from a full SPMD mesh, and each parameter's layout on the
    dims left (its "TP" layout under FSDP x TP)."""

    def __init__(self, mesh: DeviceMesh, dims: DataParallelMeshDims) -> None:
        if not isinstance(dims, DataParallelMeshDims):
            raise TypeError(f"dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
        if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
            raise ValueError(f"dp_mesh_dims needs a DeviceMesh with mesh_dim_names as fully_shard's mesh, got {mesh!r}")
        shard, replicate = dims.shard_names, dims.replicate_names
        names = mesh.mesh_dim_names
        missing = [n for n in shard + replicate if n not in names]
        if missing:
            raise ValueError(f"DataParallelMeshDims names {missing}, not dims of the mesh {names}")
        if len(set(shard + replicate)) != len(shard + replicate):
            raise ValueError(f"DataParallelMeshDims names a dim twice: shard={shard}, replicate={replicate}")
        for group in (shard, replicate):
            if list(group) != sorted(group, key=names.index):
                raise ValueError(f"DataParallelMeshDims names {group} out of the mesh's order {names}")
        self.mesh = mesh
        self.dp_indices = frozenset(names.index(n) for n in shard + replicate)
        rest = tuple(n for n in names if n not in shard + replicate)
        self.tp_mesh = mesh[rest] if rest else None
        self.tp_indices = tuple(names.index(n) for n in rest)
        self.dp_mesh = _dp_mesh(mesh, shard, replicate)

    def check(self, param: object, name: str) -> None:
        """Raise ``ValueError`` unless ``param`` is a DTensor on the full mesh, replicated over
        the data-parallel dims and not Partial."""
        if not isinstance(param, DTensor):
            raise ValueError(f"with dp_mesh_dims every parameter must be a DTensor on the full SPMD mesh "
                             f"(e.g. via distribute_module); {name!r} is a {type(param).__name__}")
        if param.device_mesh != self.mesh:
            raise ValueError(f"with dp_mesh_dims every parameter must be a DTensor on fully_shard's mesh "
                             f"{self.mesh!r}; {name!r} is on {param.device_mesh!r}")
        names = self.mesh.mesh_dim_names
        for i, placement in enumerate(param.placements):
            if i in self.dp_indices and not isinstance(placement, Replicate):
                raise ValueError(f"parameter {name!r} is {placement} on the data-parallel dim {names[i]!r}: "
                                 f"a dim tensor parallelism uses cannot also be a DataParallelMeshDims dim "
                                 f"(placements {list(param.placements)})")
            if placement.is_partial():
                raise ValueError(f"fully_shard cannot shard parameter {name!r} with a Partial placement: "
                                 f"{list(param.placements)}")

    def tp_view(self, spec: DTensorSpec) -> DTensorSpec | None:
        """``spec`` (on the full mesh) as a spec on the dims that are not data-parallel (the
        local tensor is the same: the data-parallel dims are Replicate), None if none are left."""
        if self.tp_mesh is None:
            return None
        placements = tuple(spec.placements[i] for i in self.tp_indices)
        return DTensorSpec(self.tp_mesh, placements, spec.shape, spec.stride, spec.dtype)


def _dp_mesh(mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]) -> DeviceMesh:
    """The 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) data-parallel mesh: a slice of
    ``mesh`` where one dim shards and at most one, before it, replicates; otherwise made of
    flattened slices (and a size-1 shard dim for replication alone)."""
    names = mesh.mesh_dim_names
    if len(shard) == 1 and len(replicate) <= 1 and (not replicate or names.index(replicate[0]) < names.index(shard[0])):
        return mesh[replicate + shard]
    rep = _one_dim(mesh, replicate) if replicate else None
    if not shard:  # replication alone (DDP): HSDP whose shard groups are single ranks
        return rep._unflatten(0, (rep.size(), 1), (rep.mesh_dim_names[0], "_fsdp_unit"))
    sh = _one_dim(mesh, shard)
    return sh if rep is None else joint_mesh(rep, sh)[0]


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    sub = mesh[names]
    return sub if len(names) == 1 else sub._flatten("_".join(names))
