"""``distribute_tensor``: turn a global tensor into a DTensor."""
from __future__ import annotations

import inspect
import warnings
from typing import Sequence

import torch

from .layout import chunk_sizes, contiguous_strides, dim_runs, split_order, split_runs
from . import validate
from .dtensor import DTensor
from ..mesh import DeviceMesh
from ..mesh.foreign import refuse_torch_dtensor, require_mesh
from ..comm import collectives
from .placements import Partial, Placement, Replicate, Shard, normalize_placements, shard_dim
from .redistribute import Take, ToPartial
from .spec import DTensorSpec


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute ``tensor`` over ``device_mesh`` (default: the mesh of the innermost
    ``with mesh:``) with ``placements`` (default: replicated).

    Every rank passes a tensor of the same shape and dtype (checked: a mismatch raises
    ``ValueError`` on every rank). ``src_data_rank=r`` is a group rank on EACH mesh dim,
    as in torch: the data of the rank at coordinate ``(r, ..., r)`` is sent out (scatter
    for shards, broadcast for replicas, one collective per mesh dim) and the others'
    values are ignored, so every sub-mesh has its own source; with ``None`` every rank
    already holds the data and keeps its own block, moving no data (so does a meta
    tensor: its result is a meta DTensor, as torch's). ``Partial``
    placements put the value on coordinate 0 of that mesh dim (the others hold the
    reduction's identity). The result is a leaf that requires grad if ``tensor`` does.
    """
    refuse_torch_dtensor(tensor, "distribute_tensor")
    if not tensor.is_leaf:  # torch's order of checks: this one first
        raise RuntimeError("`distribute_tensor` should be used to distribute leaf tensors! but found non-leaf tensor!")
    device_mesh = require_mesh(device_mesh, "distribute_tensor")
    placements = [Replicate()] * device_mesh.ndim if placements is None else placements
    if not isinstance(placements, Placement) and len(placements) != device_mesh.ndim:
        raise ValueError(f"`placements` must have the same length as `device_mesh.ndim`! Found placements length: "
                         f"{len(placements)}, and device_mesh.ndim: {device_mesh.ndim}: give one placement per mesh "
                         f"dimension")
    placements = normalize_placements(placements, device_mesh.ndim, tensor.ndim)
    if isinstance(tensor, DTensor):
        return _already_distributed(tensor, device_mesh, placements)
    check_src_data_rank(src_data_rank, device_mesh)
    spec = DTensorSpec(device_mesh, placements, tensor.shape, contiguous_strides(tensor.shape), tensor.dtype)
    if device_mesh._coord is None:  # outside a sub-mesh: an empty local tensor, no collective (as torch)
        return DTensor(tensor.new_empty(0), spec, requires_grad=tensor.requires_grad)
    validate.check_same_tensor_meta(tensor, device_mesh, "distribute_tensor")
    data = tensor.detach()
    if device_mesh.device_type == "cuda" and not data.is_cuda:
        data = data.to(torch.cuda.current_device())
    mesh_shape, coord = device_mesh.shape, device_mesh._coord
    if src_data_rank is None or data.is_meta:  # a meta tensor (a model built on meta) has no data to send
        local = data
        for d in range(data.ndim):
            runs = dim_runs(data.shape[d], d, placements, mesh_shape, coord)
            if len(runs) == 1:
                local = local.narrow(d, *runs[0])
            elif runs != ((0, data.shape[d]),):  # none (an empty block) or a _StridedShard's several
                local = Take(d, runs).run(local, device_mesh)
        local = local.clone(memory_format=torch.contiguous_format)
    else:
        local = _send_from(data, device_mesh, placements, src_data_rank)
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            local = ToPartial(p.reduce_op, coord[m] == 0).run(local, device_mesh)
    return DTensor(local.requires_grad_(False), spec, requires_grad=tensor.requires_grad)


def _already_distributed(tensor: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """torch's answer for a DTensor given to ``distribute_tensor``: itself when it is already
    laid out so, else a ``ValueError`` (decided from specs every rank shares)."""
    if tensor.device_mesh != mesh:
        raise ValueError(f"Cannot distribute a DTensor with device mesh {tensor.device_mesh} to a different device "
                         f"mesh {mesh}.")
    if tensor.placements != placements:
        raise ValueError(f"Cannot distribute a DTensor with placements {tensor.placements} to a different "
                         f"placements {placements}. do you want to call `redistribute` instead?")
    return tensor


def check_src_data_rank(src_data_rank: int | None, mesh: DeviceMesh) -> None:
    """``src_data_rank`` is ``None`` or a group rank valid on every mesh dim. Decided from
    the mesh shape alone, so a bad value raises on every rank alike."""
    if src_data_rank is None:
        return
    if not isinstance(src_data_rank, int) or isinstance(src_data_rank, bool):
        raise TypeError(f"src_data_rank must be an int or None, got {src_data_rank!r}")
    if not 0 <= src_data_rank < min(mesh.shape):
        raise ValueError(
            f"src_data_rank {src_data_rank} is a group rank on each mesh dim and must be in "
            f"[0, {min(mesh.shape)}) for a mesh of shape {mesh.shape}"
        )


def _send_from(data: torch.Tensor, mesh: DeviceMesh, placements, src: int) -> torch.Tensor:
    """Each rank's block of the data at mesh coordinate ``(src, ..., src)``: one scatter
    or broadcast per mesh dim, rooted at group rank ``src`` of each dim's communicator.

    Mesh dims go outer to inner; after dim k every rank whose coordinates after k are all
    ``src`` holds source data, so after the last dim every rank does.
    """
    local = data
    for m, p in enumerate(placements):
        comm = mesh.comm_for((m,))
        if isinstance(p, Shard):
            local = collectives.scatter(
                local, comm, src, dim=p.dim, sizes=chunk_sizes(local.shape[p.dim], mesh.shape[m])
            )
        elif shard_dim(p) is not None:  # a _StridedShard: its pieces listed rank after rank, scattered
            length, parts = local.shape[p.dim], mesh.shape[m]
            sizes, order = split_order(p, length, parts)
            if order is not None:
                runs = tuple(run for r in range(parts) for run in split_runs(p, length, parts, r))
                local = Take(p.dim, runs).run(local, mesh)
            local = collectives.scatter(local, comm, src, dim=p.dim, sizes=sizes)
        else:
            local = collectives.broadcast(local, comm, src)
    return local


def _shard_tensor(full_tensor: torch.Tensor, placements: Sequence[Placement],
                  device_mesh: DeviceMesh | None = None) -> DTensor:
    """torch's private ``_api._shard_tensor``: every rank holds the same ``full_tensor`` and
    keeps its own shard, with no communication (``distribute_tensor(src_data_rank=None)``)."""
    return distribute_tensor(full_tensor, device_mesh, placements, src_data_rank=None)


def distribute_module(
    module: torch.nn.Module,
    device_mesh: DeviceMesh,
    partition_fn=None,
    input_fn=None,
    output_fn=None,
    *,
    src_data_rank: int | None = 0,
) -> torch.nn.Module:
    """Turn ``module``'s parameters and buffers into DTensors (as ``torch.distributed.tensor``).

    ``partition_fn(name, submodule, device_mesh)`` distributes one submodule's
    parameters in place; every parameter and buffer it leaves a plain tensor is
    replicated from ``src_data_rank`` (see :func:`distribute_tensor`; a keyword torch's
    ``distribute_module`` lacks, default as torch). ``input_fn(module, inputs, device_mesh)``
    and ``output_fn(module, outputs, device_mesh)`` become forward pre/post hooks.
    """
    device_mesh = require_mesh(device_mesh, "distribute_module")
    check_src_data_rank(src_data_rank, device_mesh)
    replicate = [Replicate()] * device_mesh.ndim

    def replicate_rest(submodule: torch.nn.Module) -> None:
        for key, param in list(submodule._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                dist = distribute_tensor(param.data, device_mesh, replicate, src_data_rank=src_data_rank)
                submodule.register_parameter(key, torch.nn.Parameter(dist, requires_grad=param.requires_grad))
        for key, buf in list(submodule._buffers.items()):
            if buf is not None and not isinstance(buf, DTensor):
                submodule._buffers[key] = distribute_tensor(buf, device_mesh, replicate, src_data_rank=src_data_rank)

    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        replicate_rest(submodule)
    if input_fn is not None:
        if _hook_arity(input_fn, "input_fn") == 2:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(inputs, device_mesh))
        else:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        if _hook_arity(output_fn, "output_fn") == 2:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(outputs, device_mesh))
        else:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module


def _hook_arity(fn, name: str) -> int:
    """How many arguments ``input_fn``/``output_fn`` takes: 3 (``module, args, device_mesh``),
    or torch's deprecated 2 (``args, device_mesh``, with torch's ``FutureWarning``); else a
    ``ValueError`` as torch raises."""
    count = len(inspect.signature(fn).parameters)
    if count == 2:
        kind = "inputs" if name == "input_fn" else "outputs"
        warnings.warn(f"Deprecating {name} that takes two arguments ({kind}, device_mesh), please use {name} that "
                      f"takes in (module, {kind}, device_mesh) instead!", FutureWarning, stacklevel=3)
    elif count != 3:
        raise ValueError(f"{name} should take in 3 arguments, but got {count} arguments!")
    return count
