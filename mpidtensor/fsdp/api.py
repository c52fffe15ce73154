"""``fully_shard``: FSDP2's entry point on MPI.

``fully_shard(module)`` turns the parameters that ``module`` owns (those not already
owned by a ``fully_shard``-ed descendant) into ``Shard(d)`` DTensors (``d`` from
``shard_placement_fn``, else 0: a ``_StridedShard`` where TP shards it too, as torch's,
unless that cannot describe the rows, then the first dim TP leaves whole), gathers them
as one group (``group.ParamGroup``) around the module's forward and backward (the hooks of
``state.FSDPState``), and swaps the module's class for ``FSDP<Cls>`` so that it gains the
``module.FSDPModule`` methods. Every argument check happens before anything changes, and
depends only on what all ranks share, so bad input raises the same error on every rank
and leaves the module untouched.
"""
from __future__ import annotations

import weakref
from functools import cache
from typing import Callable, Iterable

import torch
from mpi4py import MPI
from torch import nn

from ..tensor.dtensor import DTensor
from ..mesh import DeviceMesh, init_device_mesh
from ..mesh.foreign import require_mesh
from ..runtime import caches
from ..runtime.agreement import attempt, raise_agreed
from ..mesh.relations import joint_mesh
from ..tensor.placements import Shard, shard_dim
from .group import ParamGroup
from .mesh_groups import ParamGroups
from .module import FSDPModule
from .param import FSDPParam, MeshInfo
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, check_offload_policy
from .spmd import DataParallelMeshDims, SpmdLayout
from .state import FSDPState, state_of

# Parameters that a fully_shard call replaced by its sharded DTensors: another module that
# still refers to one (a tie across groups) would otherwise be sharded as a separate copy.
# (Keyed by id: a WeakSet would compare tensors with ``==``.)
_REPLACED: dict[int, weakref.ref] = {}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over the data-parallel ``mesh`` (FSDP2 semantics).

    ``module``: a module, or a list of modules sharded as ONE group (one all-gather, one
    reduce-scatter), as torch 2.13 does: gathered on the first forward of any of them,
    resharded after the last of them in that forward (or at the root's end, if some did not
    run); torchtitan shards ``[model.norm, model.output]`` this way. Returns it as given.
    ``dp_mesh_dims``: ``mesh`` is then the full SPMD mesh, the parameters DTensors on it
    replicated over the named data-parallel dims (``fsdp.spmd``).

    ``mesh``: 1-D (FSDP; default: all ranks) or 2-D ``(replicate, shard)`` (HSDP). A
    sub-mesh whose parent's one remaining dim holds the parameters' tensor-parallel
    DTensors gives FSDP x TP (``mesh2d["dp"]`` beside ``mesh2d["tp"]``) or HSDP x TP
    (``mesh3d["dp_replicate", "dp_shard"]`` beside ``mesh3d["tp"]``). Apply to sub-modules
    first, then to the root.
    ``shard_placement_fn(param)``: the ``Shard(dim)`` FSDP shards ``param`` on (of its TP
    block under FSDP x TP), or ``None`` for the default, ``Shard(0)``. Where TP shards
    that dim too the sharded parameter carries ``_StridedShard(dim, sf=<TP shards>)`` on
    the data-parallel dim, as torch's FSDP2 gives it. That placement cannot describe
    every uneven split over 3+ data-parallel ranks: there the default is the first dim
    TP leaves whole (a TP parameter with none, a ColwiseParallel bias, stays replicated
    over ``mesh``: used as is, its gradient all-reduced) and asking for the TP-sharded
    dim raises ``ValueError``. It may also return torch 2.13's
    ``ShardPlacementResult(placement, mesh_info)``: that parameter is sharded over
    ``mesh_info.mesh`` (1-D, or 2-D HSDP) with ``placement`` (torchtitan's routed experts
    over ``efsdp`` beside ``ep``); each mesh is its own group (own all-gather and
    reduce-scatter), all driven together as the module's group (``fsdp.mesh_groups``); a
    ``mesh_info`` with ``dp_mesh_dims`` shards over those dims of its ``spmd_mesh``
    (torchtitan's ``full_dtensor`` experts).
    ``reshard_after_forward``: ``None`` (the default, as torch's) is ``True`` (the root
    keeps its parameters while gradients are on either way); ``True`` frees the gathered parameters after forward (backward
    gathers them again), ``False`` keeps them; an int ``k`` (a divisor of the shard group
    size) keeps each rank's ``1/k`` of them, so that backward gathers over ``k`` ranks
    only (``1`` is ``False``, the group size is ``True``, as in torch). With ``True`` or an
    int the module holds the sharded parameters between forward and backward.
    ``offload_policy``: ``CPUOffloadPolicy()`` keeps the sharded state in host memory (see
    ``policies.CPUOffloadPolicy``; on a CPU mesh it changes nothing).
    ``ignored_params``: parameters FSDP leaves as they are: not sharded, not gathered,
    their gradients not reduced (as torch's): e.g. experts that ``ExpertParallel``
    already split over the ranks.
    Returns ``module``, whose class is now an ``FSDPModule`` subclass.
    """
    modules = _modules(module)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if reshard_after_forward is None:
        reshard_after_forward = True
    if not isinstance(reshard_after_forward, int):
        raise TypeError(f"reshard_after_forward must be a bool or an int, got {reshard_after_forward!r}")
    managed = _managed_params(modules, _ignored_ids(ignored_params))
    mesh = _default_mesh(_device_type(managed)) if mesh is None else require_mesh(mesh, "fully_shard")
    spmd = None
    if dp_mesh_dims is not None:
        spmd = SpmdLayout(mesh, dp_mesh_dims)
        mesh = spmd.dp_mesh
    _check_mesh(mesh, spmd is not None)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable, got {shard_placement_fn!r}")
    parts = []  # one ParamGroup per data-parallel mesh, in the order the parameters name them
    for group_mesh, members, choices, spmd in _mesh_groups(managed, mesh, shard_placement_fn, spmd):
        if spmd is not None:
            for users, param in members:
                spmd.check(param, f"{type(users[0][0]).__name__}.{users[0][1]}")
        group_raf = _post_forward_size(reshard_after_forward, group_mesh)
        check_offload_policy(offload_policy, {p.device for _, p in members}, group_mesh)
        _check_params(members, group_mesh, mp_policy, offload_policy, spmd)
        parts.append((group_mesh, members, choices, group_raf, spmd))
    shared_elsewhere = _shared_with_other_groups(managed)
    classes = [_fsdp_class(type(m)) for m in modules]  # (before any change: a class that cannot be subclassed raises here)
    groups = []
    for group_mesh, members, choices, group_raf, spmd in parts:
        info = MeshInfo(group_mesh)
        dims = [_shard_dim(param, None if choice is None else (lambda _, c=choice: c), info, spmd)
                for (_, param), choice in zip(members, choices)]
        params, error = attempt(lambda: [FSDPParam(users, param, info, mp_policy, dim, spmd)
                                         for (users, param), dim in zip(members, dims)])
        if any(hasattr(_data(param), "fsdp_pre_all_gather") for _, param in members):
            raise_agreed(group_mesh.comm, error)  # a subclass's own split / copy may fail on some ranks only
        elif error is not None:
            raise error
        if params:
            groups.append(ParamGroup(params, info, mp_policy, group_raf, offload_policy))
    group = None if not groups else groups[0] if len(groups) == 1 else ParamGroups(groups)
    for _, param in managed:
        _REPLACED[id(param)] = weakref.ref(param, lambda _, key=id(param): _REPLACED.pop(key, None))
    state = FSDPState(modules, group, mp_policy)
    state.shared_elsewhere = shared_elsewhere
    for m, cls in zip(modules, classes):
        m._fsdp_state = state
        m.__class__ = cls
    return module


fully_shard.state = state_of  # torch's way to reach a module's FSDP state (None if it has none)


def _mesh_groups(managed: list, mesh: DeviceMesh, fn: Callable | None, spmd: SpmdLayout | None) -> list:
    """``managed`` split by the data-parallel mesh each parameter is sharded over, as
    ``(mesh, members, placements, layout)``: ``mesh`` (with the call's ``dp_mesh_dims``
    layout ``spmd``), or that of a ``ShardPlacementResult(placement, mesh_info)`` that ``fn``
    returned for it (torch 2.13's per-parameter mesh: torchtitan's routed experts over
    ``efsdp``): ``mesh_info.mesh``, or with ``mesh_info.dp_mesh_dims`` the data-parallel
    dims of its ``spmd_mesh``. Placements are ``fn``'s ``Shard`` or ``None``. The call's
    own group is kept when empty. The same on every rank: ``fn`` sees each rank's
    parameters of the same global metadata."""
    found: dict[int, tuple[DeviceMesh, list, list, SpmdLayout | None]] = {id(mesh): (mesh, [], [], spmd)}
    for users, param in managed:
        choice = fn(param) if fn is not None else None
        key = id(mesh)
        if choice is not None and not isinstance(choice, Shard) and hasattr(choice, "mesh_info"):
            info = choice.mesh_info
            key = id(info)
            if key not in found:
                found[key] = _info_group(info)
            choice = choice.placement
        group = found[key]
        group[1].append((users, param))
        group[2].append(choice)
    return [g for key, g in found.items() if g[1] or key == id(mesh)]


def _info_group(info) -> tuple[DeviceMesh, list, list, SpmdLayout | None]:
    """The (mesh, [], [], layout) of a torch ``FSDPMeshInfo``: a 1-D FSDP or 2-D
    ``(replicate, shard)`` HSDP mesh, or the data-parallel dims of a full SPMD mesh."""
    dims = getattr(info, "dp_mesh_dims", None)
    if dims is not None:
        layout = SpmdLayout(require_mesh(info.spmd_mesh, "fully_shard's shard_placement_fn (mesh_info.spmd_mesh)"),
                            DataParallelMeshDims(shard=dims.shard, replicate=dims.replicate))
        _check_mesh(layout.dp_mesh, True)
        return layout.dp_mesh, [], [], layout
    target = require_mesh(info.mesh, "fully_shard's shard_placement_fn (mesh_info.mesh)")
    layout = (getattr(info, "replicate_mesh_dim", None), info.shard_mesh_dim)
    if layout != ((None, 0) if target.ndim == 1 else (0, 1)):
        raise NotImplementedError(f"fully_shard: a per-parameter mesh must be 1-D (shard dim 0) or 2-D "
                                  f"(replicate dim 0, shard dim 1), got {target!r} with {layout}")
    _check_mesh(target, False)
    return target, [], [], None


def _check_mesh(mesh: DeviceMesh, spmd: bool) -> None:
    """torch's checks of ``fully_shard``'s mesh, with its exception types: 1-D or 2-D, a
    2-D (HSDP) mesh with dim names (``dp_mesh_dims``: ``mesh`` is its data-parallel mesh)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard needs a DeviceMesh, got {mesh!r}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None and not spmd:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")


def _modules(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """``fully_shard``'s module argument as a list of distinct modules not yet sharded."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard needs at least one module, got an empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list")
    return modules


@cache  # not cleared: one FSDP class per module class, as torch makes it
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


# kept when another mesh is freed: a freed default mesh is seen on use and built again
_DEFAULT_MESHES = caches.cache("fsdp.default_meshes", maxsize=None, holds_meshes=False)


def _default_mesh(device_type: str) -> DeviceMesh:
    """The 1-D world mesh ``fully_shard`` uses without one: built once per device type, and
    again after the user freed it (all ranks free it alike, so all rebuild it alike)."""
    mesh = _DEFAULT_MESHES.get(device_type)
    if mesh is None or mesh._freed:
        mesh = _DEFAULT_MESHES[device_type] = init_device_mesh(device_type, (MPI.COMM_WORLD.size,))
    return mesh


def _ignored_ids(ignored_params: Iterable[nn.Parameter] | None) -> set[int]:
    """The ids of ``fully_shard``'s ``ignored_params`` (a set of parameters, or None)."""
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
            isinstance(p, nn.Parameter) for p in ignored_params):
        raise TypeError(f"ignored_params must be a set of nn.Parameters, got {ignored_params!r}"[:200])
    return {id(p) for p in ignored_params}


def _managed_params(modules: list[nn.Module], ignored: set[int]) -> list[tuple[list[tuple[nn.Module, str]], nn.Parameter]]:
    """Each parameter the ``modules`` own, with every (module, name) that refers to it; the
    sub-trees of ``fully_shard``-ed descendants and the ``ignored`` ids are left out."""
    found: dict[int, tuple[list[tuple[nn.Module, str]], nn.Parameter]] = {}
    stack = list(reversed(modules))
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:  # (a module reached from two of the list)
            continue
        seen.add(id(m))
        for name, param in m._parameters.items():
            if param is not None and id(param) not in ignored:
                found.setdefault(id(param), ([], param))[0].append((m, name))
        stack.extend(c for c in reversed(list(m._modules.values())) if c is not None and not isinstance(c, FSDPModule))
    return list(found.values())


def _device_type(managed: Iterable) -> str:
    for _, param in managed:
        if param.device.type == "cuda":
            return "cuda"
    return "cpu"


def _post_forward_size(value: bool | int, mesh: DeviceMesh) -> bool | int:
    """``reshard_after_forward`` as a bool, or the int size of the subgroup to keep the
    parameters over after forward (``1`` is ``False``, the shard group size ``True``)."""
    if isinstance(value, bool):
        return value
    size = mesh.size(mesh.ndim - 1)
    if not 1 <= value <= size or size % value:
        raise ValueError(f"reshard_after_forward as an int must divide the shard group size {size}, got {value}")
    return False if value == 1 else True if value == size else value


def _check_params(managed: list, mesh: DeviceMesh, mp: MixedPrecisionPolicy, offload: OffloadPolicy,
                  spmd: SpmdLayout | None = None) -> None:
    """Raise before anything changes if the parameters cannot be sharded together on ``mesh``."""
    params = [param for _, param in managed]
    devices = {p.device for p in params if p.device.type != "meta"}  # meta ones wait for a deferred init, as torch
    if len(devices) > 1:
        raise ValueError(f"fully_shard needs all parameters on one device, got {sorted(map(str, devices))}")
    served = (mesh.device_type,) + (("cpu",) if isinstance(offload, CPUOffloadPolicy) else ())
    if devices and next(iter(devices)).type not in served:
        raise ValueError(f"parameters on {next(iter(devices))} cannot be sharded on a {mesh.device_type!r} mesh")
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    if len(meshes) > 1:
        raise ValueError(f"fully_shard needs all DTensor parameters on one mesh, got {sorted(map(repr, meshes))}")
    for users, p in managed:
        if p.ndim == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {users[0][1]} to a 1D tensor with "
                             "numel equal to 1.")
        if not p.is_contiguous():
            raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: {p.shape=} "
                                      f"{p.stride()=} ({type(users[0][0]).__name__}.{users[0][1]}: e.g. a channels_last "
                                      "weight; make it contiguous first)")
    tp_mesh = next(iter(meshes)) if meshes else None
    if tp_mesh is not None and spmd is None:  # (dp_mesh_dims: SpmdLayout.check did it)
        _check_tp(params, mesh, tp_mesh)
    trainable = {p.dtype for p in params if p.requires_grad}
    if len(trainable) > 1 and mp.reduce_dtype is None and mp.param_dtype is None:
        raise ValueError(f"trainable parameters of one group must share a dtype, got {sorted(map(str, trainable))}")


def _shared_with_other_groups(managed: list) -> list[tuple[nn.Module, str]]:
    """The (module, name) of each parameter that an earlier ``fully_shard`` call already
    sharded for another module: tied weights split over two groups would come apart. As
    torch, the first forward raises (``FSDPState._lazy_init``), naming it from the root."""
    return [users[0] for users, param in managed
            if (ref := _REPLACED.get(id(param))) is not None and ref() is param]


def _shard_dim(param: nn.Parameter, fn: Callable[[nn.Parameter], Shard | None] | None, info: MeshInfo,
               spmd: SpmdLayout | None) -> int | None:
    """The dim FSDP shards ``param`` on (``None``: replicated), from global metadata only:
    ``shard_placement_fn``'s, else 0 as in torch, also where TP shards dim 0 already
    (``_StridedShard`` over the data-parallel dim) unless that layout cannot describe
    the rows exactly (uneven), then the first dim TP leaves whole."""
    tp_spec = None
    if isinstance(param, DTensor):
        tp_spec = spmd.tp_view(param._spec) if spmd is not None else param._spec
    tp_dims = {shard_dim(pl) for pl in tp_spec.placements} - {None} if tp_spec is not None else set()
    data = _data(param)
    extension = hasattr(data, "fsdp_pre_all_gather")

    def fits(d: int) -> bool:  # FSDP may shard dim d with a placement that describes its rows
        # (not an all-gather extension's subclass on a strided layout: untested, refused as before)
        return d not in tp_dims or (not extension and info.layout_exact(tp_spec, d, tp_spec.shape[d]))
    choice = fn(param) if fn is not None else None
    if choice is None:
        dim = next((d for d in range(param.ndim) if fits(d)), None)
    elif type(choice) is not Shard:
        raise TypeError(f"shard_placement_fn must return a Shard or None, got {choice!r}")
    else:
        dim = choice.dim + param.ndim if choice.dim < 0 else choice.dim
        if not 0 <= dim < param.ndim:
            raise AssertionError(f"Shard dim {dim} is invalid for {param.ndim}D tensor: {param.shape} "
                                 f"(shard_placement_fn returned {choice})")
        if not fits(dim):
            why = ("FSDP's all-gather extension on a strided layout is not supported" if extension else
                   "the strided placement FSDP would give it cannot describe those rows (uneven)")
            raise ValueError(
                f"shard_placement_fn returned {choice} for a parameter tensor parallelism already shards on "
                f"dim {dim} ({list(param.placements)}, shape {tuple(param.shape)}): {why}; pick a dim TP leaves "
                f"whole (or None for the default)"
            )
    if extension != hasattr(data, "fsdp_post_all_gather"):
        raise TypeError(f"a {type(data).__name__} parameter defines only one of fsdp_pre_all_gather and "
                        "fsdp_post_all_gather: FSDP's all-gather extension needs both")
    if not extension and type(data).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise TypeError(f"fully_shard cannot shard a {type(data).__name__} parameter: a tensor subclass needs "
                        "fsdp_pre_all_gather and fsdp_post_all_gather (FSDP2's all-gather extension)")
    if extension and dim != 0:
        raise ValueError(f"a parameter with fsdp_pre_all_gather can only be sharded on dim 0, not {dim}")
    return dim


def _data(param: nn.Parameter) -> torch.Tensor:
    """What FSDP shards: the parameter, or its TP block."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _check_tp(params: list, mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
    """FSDP x TP: ``mesh`` (1-D FSDP or 2-D HSDP) and the 1-D ``tp_mesh`` must compose into
    one mesh (``mesh.relations.joint_mesh``): every data-parallel group meets every TP group
    once, as for ``mesh3d["dp_replicate", "dp_shard"]`` and ``mesh3d["tp"]``,
    ``mesh3d["dp", "cp"]._flatten("dp_cp")`` and ``mesh3d["tp"]``, or slices of two
    ``_unflatten``s of one world mesh (torchtitan); and the TP placements must not be
    Partial. Plain parameters beside them are sharded over ``mesh`` alone. Decided from the
    meshes' rank grids, alike on every rank; collective over the joint mesh's ranks the
    first time (its communicator is made here)."""
    if tp_mesh.ndim != 1 or joint_mesh(mesh, tp_mesh) is None:
        raise ValueError(
            "parameters that are DTensors need fully_shard's mesh and theirs to compose into one mesh, each "
            "data-parallel group meeting each TP group once (e.g. mesh['dp'] and mesh['tp'], "
            "mesh['dp', 'cp']._flatten('dp_cp') and mesh['tp'], or slices of two _unflatten()s of one mesh), "
            f"got {mesh!r} and {tp_mesh!r}"
        )
    for p in params:
        if isinstance(p, DTensor) and any(pl.is_partial() for pl in p.placements):
            raise ValueError(f"fully_shard cannot shard a parameter with a Partial TP placement: {list(p.placements)}")
