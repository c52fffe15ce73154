"""DTensors crossing pipeline stages, as torch 2.13's stages pass them.

A stage output that is a DTensor travels as its local tensor. What the next stage needs
to rebuild it (placements, global shape and stride, and which mesh) travels once, with
the shapes the first step finds (:mod:`.meta`). The mesh is named by what every rank
shares: its dim names and its rank grid, every copy of it among the ranks
(``mesh.grids``). The receiving rank then finds its own copy: with a world mesh
``("pp", "tp")``, stage 0's ``mesh["tp"]`` over ranks 0, 1 arrives on stage 1 as its own
``mesh["tp"]`` over ranks 2, 3. It looks among the meshes of the stage's own parameters
and buffers, the meshes of its ``input_args``, ``get_mesh(dim_names, None)`` if given
(torch's callback: torch passes its mesh layout second, which has no meaning here, and
callbacks written for torch accept None), and every mesh the program built or derived.
Sender and receiver must hold the same place in their copies (the same local shard): the
pipeline group pairs ranks of equal coordinates, as a pipeline dim of one world mesh does.
A mesh that cannot be found, a ``get_mesh`` that raises or answers wrongly on any rank,
or a pairing of other coordinates, raises ``ValueError`` on every rank at the first step:
the stage's ranks agree (:mod:`..runtime.agreement`) over the copy the search finds. The
search is local, so a stage's ranks must hold alike what it looks among (they do when
they run one program): a mesh built on some of a stage's ranks only is not agreed on,
and the others would wait in the agreement.

Gradients go back the same way. An input's gradient is first redistributed to the
input's own placements (a ``Partial`` gradient is summed over the mesh then), so what is
sent is the local tensor of the gradient of what was received; the upstream stage
rebuilds it on its output's mesh and placements.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import torch
from ..mesh.device_mesh import DeviceMesh
from ..mesh.relations import find_copy
from ..runtime.agreement import attempt, exchange
from ..tensor.dtensor import DTensor


class DistMeta(NamedTuple):
    """What rebuilds a DTensor from its local tensor on another stage."""

    mesh: tuple  # DeviceMesh._copies_key()
    coordinate: tuple[int, ...]  # the sender's place in its copy of the mesh
    placements: tuple
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]

    def text(self) -> str:
        names = self.mesh[1]
        where = f"mesh {tuple(names)}" if names else f"a mesh of shape {self.mesh[2][1:]}"
        return f"DTensor {tuple(self.shape)} {list(self.placements)} on {where}"


def dist_meta(t: DTensor) -> DistMeta:
    mesh = t.device_mesh
    return DistMeta(mesh._copies_key(), tuple(mesh.get_coordinate()), tuple(t.placements), tuple(t.shape),
                    tuple(t.stride()))


def local_of(t: torch.Tensor) -> torch.Tensor:
    """What travels for ``t``: its local tensor if a DTensor, detached."""
    return t._local_tensor.detach() if isinstance(t, DTensor) else t.detach()


def rebuild(local: torch.Tensor, dist: DistMeta | None, mesh: DeviceMesh | None) -> torch.Tensor:
    """The tensor a stage receives: ``local`` itself, or the DTensor it is the shard of."""
    if dist is None:
        return local
    return DTensor.from_local(local, mesh, dist.placements, shape=dist.shape, stride=dist.stride, run_check=False)


def grad_to_send(grad: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """The local tensor of ``grad`` (the gradient of the received input ``received``) in
    ``received``'s placements: what the upstream stage rebuilds on its output's."""
    if isinstance(received, DTensor):
        if not isinstance(grad, DTensor):
            raise TypeError(f"the gradient of a DTensor input is a {type(grad).__name__}")
        if tuple(grad.placements) != tuple(received.placements):
            grad = grad.redistribute(received.device_mesh, received.placements)
    return local_of(grad)


def grad_received(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """A received gradient of ``output`` as autograd needs it: on its mesh and placements
    if ``output`` is a DTensor."""
    if isinstance(output, DTensor) and not isinstance(grad, DTensor):
        return DTensor.from_local(grad, output.device_mesh, output.placements, shape=output.shape,
                                  stride=output.stride(), run_check=False)
    return grad


def meshes_of(tensors: Iterable[Any]) -> list[DeviceMesh]:
    """The distinct meshes of the DTensors among ``tensors``."""
    found: dict[int, DeviceMesh] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            found.setdefault(id(t.device_mesh), t.device_mesh)
    return list(found.values())


def meshes_for(stage_index: int, metas: list, first: list[DeviceMesh],
               get_mesh: Callable[..., Any] | None) -> list[DeviceMesh | None]:
    """This rank's copy of the mesh of each DTensor in ``metas`` (None for plain tensors);
    ``ValueError`` on every rank of the stage naming the mesh when there is none, when
    ``get_mesh`` fails or returns another mesh, or when the coordinates differ.

    The stage's ranks agree on each verdict over the copy of the mesh that the search
    finds (the same communicator on each of them, whatever ``get_mesh`` does on one),
    so a callback that fails on one rank raises on all of them rather than leaving the
    others waiting."""
    meshes: list[DeviceMesh | None] = []
    for m in metas:
        if m.dist is None:
            meshes.append(None)
            continue
        mesh, error = attempt(_copy_for, stage_index, m.dist, first, get_mesh)
        home = find_copy(m.dist.mesh, first)  # searched alike on the stage's ranks: where they agree
        if home is None:  # no rank of the stage holds a copy: each raises its own verdict alike
            raise error or ValueError(_no_copy(stage_index, m.dist))
        moved = error is None and tuple(mesh.get_coordinate()) != m.dist.coordinate
        if any(exchange(home.comm, moved, error)):
            raise ValueError(f"stage {stage_index} receives a {m.dist.text()} sent from coordinate "
                             f"{m.dist.coordinate} of that mesh to a rank at another place in its copy (this one: "
                             f"{tuple(mesh.get_coordinate())}): the pipeline group must pair ranks at the same place "
                             f"in their meshes")
        meshes.append(mesh)
    return meshes


def _copy_for(stage_index: int, dist: DistMeta, first: list[DeviceMesh],
              get_mesh: Callable[..., Any] | None) -> DeviceMesh:
    """This rank's copy of ``dist``'s mesh: ``get_mesh``'s answer, checked, or the search's."""
    if get_mesh is None:
        mesh = find_copy(dist.mesh, first)
        if mesh is None:
            raise ValueError(_no_copy(stage_index, dist))
        return mesh
    try:  # torch passes its layout object second; None is what its callbacks accept
        mesh = get_mesh(dist.mesh[1], None)
    except Exception as err:  # noqa: BLE001  (agreed over the stage's ranks by the caller)
        raise ValueError(f"stage {stage_index} receives a {dist.text()} and its get_mesh raised "
                         f"{type(err).__name__}: {err}") from err
    if mesh is None:
        raise ValueError(f"stage {stage_index} receives a {dist.text()} and its get_mesh returned None for it")
    if not isinstance(mesh, DeviceMesh) or mesh._copies_key() != dist.mesh:
        raise ValueError(f"stage {stage_index} receives a {dist.text()}; get_mesh returned {mesh!r}, "
                         f"not a copy of that mesh (same dim names, over the same rank grid)")
    return mesh


def _no_copy(stage_index: int, dist: DistMeta) -> str:
    return (f"stage {stage_index} receives a {dist.text()} and this rank holds no copy of that mesh: build the "
            f"mesh it comes from on every rank (e.g. slice the world mesh) or pass PipelineStage(get_mesh=...)")
