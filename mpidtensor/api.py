"""``distribute_tensor``: turn a global tensor into a DTensor."""
from __future__ import annotations

from typing import Sequence

import torch

from ._layout import chunk_sizes, contiguous_strides, local_span
from . import validate
from .dtensor import DTensor
from .mesh import DeviceMesh, collectives
from .placements import Partial, Placement, Replicate, Shard, normalize_placements
from .redistribute import ToPartial
from .spec import DTensorSpec


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute ``tensor`` over ``device_mesh`` with ``placements`` (default: replicated).

    Every rank passes a tensor of the same shape and dtype (checked: a mismatch raises
    ``ValueError`` on every rank). With ``src_data_rank=r`` the data of rank ``r`` is
    sent out (scatter for shards, broadcast for replicas, one collective per mesh dim)
    and the others' values are ignored; with ``None`` every rank already holds the data
    and keeps its own block, moving no data. ``Partial`` placements put the value on
    coordinate 0 of that mesh dim (the others hold the reduction's identity).
    The result is a leaf that requires grad if ``tensor`` does.
    """
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor expects a plain torch.Tensor, got a DTensor")
    placements = [Replicate()] * device_mesh.ndim if placements is None else placements
    placements = normalize_placements(placements, device_mesh.ndim, tensor.ndim)
    validate.check_same_tensor_meta(tensor, device_mesh, "distribute_tensor")
    data = tensor.detach()
    if device_mesh.device_type == "cuda" and not data.is_cuda:
        data = data.to(torch.cuda.current_device())
    mesh_shape, coord = device_mesh.shape, device_mesh._coord
    if src_data_rank is None:
        local = data
        for d in range(data.ndim):
            offset, size = local_span(data.shape[d], d, placements, mesh_shape, coord)
            local = local.narrow(d, offset, size)
        local = local.clone(memory_format=torch.contiguous_format)
    else:
        local = _send_from(data, device_mesh, placements, src_data_rank)
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            local = ToPartial(p.reduce_op, coord[m] == 0).run(local, device_mesh)
    spec = DTensorSpec(device_mesh, placements, tensor.shape, contiguous_strides(tensor.shape), tensor.dtype)
    return DTensor(local.requires_grad_(False), spec, requires_grad=tensor.requires_grad)


def _send_from(data: torch.Tensor, mesh: DeviceMesh, placements, src_rank: int) -> torch.Tensor:
    """Each rank's block of ``src_rank``'s ``data``: one scatter or broadcast per mesh dim.

    Mesh dims go outer to inner, the root of each sub-communicator at the source's
    coordinate; after dim k every rank that agrees with the source on the dims after k
    holds source data, so after the last dim every rank does.
    """
    flat = mesh.mesh.flatten().tolist()
    if src_rank not in flat:
        raise ValueError(f"src_data_rank {src_rank} is not a rank of {mesh}")
    src = [int(c) for c in torch.nonzero(mesh.mesh == src_rank)[0]]
    local = data
    for m, p in enumerate(placements):
        comm = mesh.comm_for((m,))
        if isinstance(p, Shard):
            local = collectives.scatter(
                local, comm, src[m], dim=p.dim, sizes=chunk_sizes(local.shape[p.dim], mesh.shape[m])
            )
        else:
            local = collectives.broadcast(local, comm, src[m])
    return local


def distribute_module(
    module: torch.nn.Module,
    device_mesh: DeviceMesh,
    partition_fn=None,
    input_fn=None,
    output_fn=None,
) -> torch.nn.Module:
    """Turn ``module``'s parameters and buffers into DTensors (as ``torch.distributed.tensor``).

    ``partition_fn(name, submodule, device_mesh)`` distributes one submodule's
    parameters in place; by default every parameter and buffer not yet a DTensor is
    replicated. ``input_fn(module, inputs, device_mesh)`` and
    ``output_fn(module, outputs, device_mesh)`` become forward pre/post hooks.
    """
    replicate = [Replicate()] * device_mesh.ndim

    def replicate_rest(submodule: torch.nn.Module) -> None:
        for key, param in list(submodule._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                dist = distribute_tensor(param.data, device_mesh, replicate)
                submodule.register_parameter(key, torch.nn.Parameter(dist, requires_grad=param.requires_grad))
        for key, buf in list(submodule._buffers.items()):
            if buf is not None and not isinstance(buf, DTensor):
                submodule._buffers[key] = distribute_tensor(buf, device_mesh, replicate)

    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        replicate_rest(submodule)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module
