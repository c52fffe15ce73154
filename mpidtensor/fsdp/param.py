"""One parameter under FSDP: its layout on the data-parallel mesh and its two forms.

The *sharded* form is an ``nn.Parameter`` holding a ``DTensor`` (``Shard(d)`` over the
shard dim, ``d = 0`` unless ``shard_placement_fn`` says otherwise; ``[Replicate(), Shard(d)]``
for HSDP; ``[Shard(d), <tp placement>]`` on the parent mesh under FSDP x TP and
``[Replicate(), Shard(d), <tp placement>]`` under HSDP x TP). Its local tensor is this
rank's ``torch.chunk`` piece of dim ``d`` (of its TP block under TP). Where TP shards dim
``d`` too, FSDP's placement is torch's ``_StridedShard(d, split_factor=<TP shards>)``,
which describes those rows exactly except at some uneven lengths over 3+ data-parallel
ranks (:meth:`MeshInfo.layout_exact`); there ``d`` defaults to the first dim TP leaves
whole, and a TP parameter with no such dim (a ColwiseParallel bias) is not sharded by
FSDP: ``[Replicate(), <tp placement>]``, its unsharded form aliases the local block (no
all-gather) and its gradient is all-reduced.
The *unsharded* form is a plain ``nn.Parameter`` (or the TP ``DTensor``) that the module
uses between all-gather and reshard. Everything here is computed from global shapes, so
all ranks agree on every size and offset.
"""
from __future__ import annotations

import inspect
import itertools
from math import prod

import torch
from mpi4py import MPI
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..tensor.layout import chunk_span, compose_runs, contiguous_strides, dim_runs
from ..tensor.dtensor import DTensor
from ..mesh import DeviceMesh
from ..comm import accounting
from ..runtime import caches
from ..mesh.relations import joint_mesh
from ..tensor.placements import Placement, Replicate, Shard, _StridedShard, shard_dim
from ..tensor.spec import DTensorSpec
from .policies import MixedPrecisionPolicy
from ..runtime import watchdog
from .spmd import SpmdLayout


class MeshInfo:
    """The data-parallel mesh: which communicator shards, which (HSDP) replicates,
    and the mesh and placement prefix of the sharded DTensors."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.shard_comm = mesh.comm_for((mesh.ndim - 1,))
        self.replicate_comm = mesh.comm_for((0,)) if mesh.ndim == 2 else None
        self.shard_size = self.shard_comm.size
        self.shard_rank = self.shard_comm.rank
        self.dp_size = mesh.size()

    def subgroup(self, size: int) -> MPI.Comm:
        """The communicator over the ``size`` consecutive shard ranks that include this one
        (``reshard_after_forward=size``); made once per mesh and size, kept with the mesh's
        communicators (``mesh.free()`` frees it). Collective over the shard communicator
        (``fully_shard`` is called on every rank)."""
        key = ("fsdp_post_forward", size)
        comm = self.mesh._subcomms.get(key)
        if comm is None:
            comm = self.mesh._subcomms[key] = watchdog.call(
                "fully_shard(reshard_after_forward=int): its sub-communicator (Split)", self.shard_comm,
                self.shard_comm.Split, self.shard_rank // size, self.shard_rank)
        return comm

    def separate_comm(self) -> MPI.Comm:
        """A duplicate of the shard communicator for gradient reduce-scatters
        (``set_separate_reduce_scatter_group``): MPI matches collectives per communicator,
        so on it a reduce-scatter in flight never queues behind an all-gather. One per
        mesh, kept with its communicators; collective over the shard ranks on first use."""
        key = ("fsdp_reduce_scatter",)
        comm = self.mesh._subcomms.get(key)
        if comm is None:
            comm = self.mesh._subcomms[key] = watchdog.call("FSDP's separate reduce-scatter communicator (Dup)",
                                                             self.shard_comm, self.shard_comm.Dup)
        return comm

    def spec_for(self, tp_spec: DTensorSpec | None, dim: int | None) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """Mesh and placements of a sharded parameter (``tp_spec``: its TP layout, if any;
        ``dim``: the dim FSDP shards, ``None``: replicated over the data-parallel mesh). Where
        TP shards ``dim`` too on mesh dims after the data-parallel one, the data-parallel
        placement is ``_StridedShard(dim, split_factor=<those TP shards>)``, as torch's FSDP2
        gives it: each rank's rows are its ``torch.chunk`` piece of its TP block
        (:meth:`layout_exact` says whether the placement describes them)."""
        return self._layout(tp_spec, dim)[:2]

    def _layout(self, tp_spec: DTensorSpec | None, dim: int | None
                ) -> tuple[DeviceMesh, tuple[Placement, ...], int]:
        """``spec_for``'s mesh and placements, and the mesh dim FSDP shards on."""
        own = Replicate() if dim is None else Shard(dim)
        dp = (Replicate(), own) if self.mesh.ndim == 2 else (own,)
        if tp_spec is None:
            return self.mesh, dp, self.mesh.ndim - 1
        parent, dp_dims, tp_dims = joint_mesh(self.mesh, tp_spec.mesh)  # fully_shard checked it exists
        placements: list[Placement] = [Replicate()] * parent.ndim
        for m, p in zip(dp_dims, dp):
            placements[m] = p
        for m, p in zip(tp_dims, tp_spec.placements):
            placements[m] = p
        at = dp_dims[-1]
        if dim is not None:
            split = prod(parent.size(m) for m in tp_dims if m > at and shard_dim(placements[m]) == dim)
            if split > 1:
                placements[at] = _StridedShard(dim, split_factor=split)
        return parent, tuple(placements), at

    def layout_exact(self, tp_spec: DTensorSpec | None, dim: int, length: int) -> bool:
        """Whether :meth:`spec_for`'s placements give every rank the rows FSDP keeps on it
        (its ``torch.chunk`` piece, along ``dim`` of ``length``, of its TP block): always for
        a ``Shard``; for a ``_StridedShard`` where the block splits evenly enough (at
        uneven lengths torch's strided layout and the chunk of a chunk can differ)."""
        mesh, placements, at = self._layout(tp_spec, dim)
        if type(placements[at]) is not _StridedShard:
            return True
        return _strided_exact(length, dim, placements, tuple(mesh.shape), at)


class FSDPParam:
    """Layout and state of one managed parameter (shared parameters: several ``users``)."""

    def __init__(self, users: list[tuple[nn.Module, str]], param: nn.Parameter, info: MeshInfo,
                 mp: MixedPrecisionPolicy, dim: int | None, spmd: SpmdLayout | None = None) -> None:
        self.users = users
        self.requires_grad = param.requires_grad
        is_dtensor = isinstance(param, DTensor)
        # the unsharded form's layout (the module computes with it), and its TP part: the
        # same, except under dp_mesh_dims (its layout on the full mesh's other dims)
        self.unsharded_spec = param._spec if is_dtensor else None
        self.tp_spec = spmd.tp_view(param._spec) if spmd is not None else self.unsharded_spec
        self.dp_indices = spmd.dp_indices if spmd is not None else frozenset()
        data = param._local_tensor if is_dtensor else param.detach()
        self.shape = data.shape  # what FSDP shards: the whole tensor, or the local TP block
        self.dim = dim
        self.replicated = dim is None
        self.orig_dtype = data.dtype
        self.param_dtype = mp.param_dtype or self.orig_dtype
        d = 0 if dim is None else dim
        # the tensor seen as (pre, rows, post) around the shard dim
        self.pre, self.rows, self.post = prod(self.shape[:d]), self.shape[d], prod(self.shape[d + 1:])
        self.numel = self.pre * self.rows * self.post
        if self.replicated:
            self.pad_rows, self.offset_rows, self.local_rows = self.rows, 0, self.rows
        else:
            self.pad_rows = -(-self.rows // info.shard_size)
            self.offset_rows, self.local_rows = chunk_span(self.rows, info.shard_size, info.shard_rank)
        self.shard_numel = self.pre * self.pad_rows * self.post  # one rank's padded piece
        self.local_numel = self.pre * self.local_rows * self.post
        self.local_shape = self.shape[:d] + (self.local_rows,) + self.shape[d + 1:]
        self.local_stride = contiguous_strides(self.local_shape)
        self.extension = hasattr(data, "fsdp_pre_all_gather")
        mesh, placements = info.spec_for(self.tp_spec, dim)
        self.spec = DTensorSpec(mesh, placements, param.shape, contiguous_strides(param.shape), param.dtype)
        if self.extension:  # the shard must own its rows, or every rank keeps the whole tensor alive
            self.initial_local = _own_rows(_chunk(data.detach(), info.shard_size, info.shard_rank))
        else:
            self.initial_local = data.detach().narrow(d, self.offset_rows, self.local_rows)
        self.replica_src: torch.Tensor | None = None  # the local block a replicated unsharded form aliases
        self.sharded: nn.Parameter | None = None  # set by the group (it owns the storage)
        self.unsharded: nn.Parameter | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()  # an extension's persistent all-gather outputs
        self.inner: tuple[torch.Tensor, ...] = ()  # tensors the subclass built its unsharded form on
        self._nbytes: dict[int, int] = {}  # their storage sizes, to reallocate after a reshard
        self.shard_offset = self.unsharded_offset = 0  # byte offsets, set by the group
        self.grad_acc: torch.Tensor | None = None  # unsharded grads summed while sync is off

    def make_sharded(self, local: torch.Tensor) -> None:
        """Register the sharded DTensor parameter around ``local`` on every user module."""
        dt = DTensor(local, self.spec, requires_grad=False)
        self.sharded = nn.Parameter(dt, requires_grad=self.requires_grad)
        self.install(self.sharded)

    def install(self, param: nn.Parameter) -> None:
        for module, name in self.users:
            module._parameters[name] = param

    def adopt(self, param: nn.Parameter) -> None:
        """Take ``param`` (a replacement of the sharded parameter) as the sharded parameter."""
        if not isinstance(param, DTensor) or param._spec.placements != self.spec.placements \
                or param._spec.mesh != self.spec.mesh or tuple(param.shape) != tuple(self.spec.shape):
            raise ValueError(
                f"parameter {self.users[0][1]!r} was replaced by a tensor that is not a DTensor "
                f"with {list(self.spec.placements)} on {self.spec.mesh} and shape {tuple(self.spec.shape)}"
            )
        self.sharded = param
        self.install(param)

    def wrap_unsharded(self, tensor: torch.Tensor) -> nn.Parameter:
        """The unsharded parameter around ``tensor`` (as a DTensor if the parameter was one)."""
        if self.unsharded_spec is not None:
            tp = self.unsharded_spec
            spec = DTensorSpec(tp.mesh, tp.placements, tp.shape, tp.stride, tensor.dtype)
            tensor = DTensor(tensor, spec, requires_grad=False)
        return nn.Parameter(tensor, requires_grad=self.requires_grad)

    def plain_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad``, not a plain tensor, as one: a gradient that came back as a tensor subclass
        (a quantized weight's autograd may return its own type) is dequantized, or unwrapped
        if it is a plain tensor underneath; the reduce-scatter packs plain values."""
        if hasattr(grad, "dequantize"):
            return grad.dequantize()
        if not is_traceable_wrapper_subclass(grad):
            return grad.as_subclass(torch.Tensor)
        raise TypeError(f"the gradient of {self.users[0][1]!r} is a {type(grad).__name__} without dequantize(): "
                        "FSDP cannot reduce-scatter it; return a plain gradient from the subclass's backward")

    def local_grad(self, grad: DTensor) -> torch.Tensor:
        """The local block of an unsharded DTensor gradient in the parameter's layout. Under
        dp_mesh_dims a Partial on a data-parallel dim stays: its terms are what FSDP's
        reduce-scatter sums. A plain parameter that met DTensors (taken as ``Replicate`` there)
        gets its whole gradient, reduced from the DTensor's placements."""
        if self.unsharded_spec is None:
            return grad.full_tensor()
        target = self.unsharded_spec.placements
        if grad._spec.placements != target:
            if self.dp_indices:
                target = tuple(g if i in self.dp_indices and g.is_partial() else t
                               for i, (g, t) in enumerate(zip(grad._spec.placements, target)))
            grad = grad.redistribute(self.unsharded_spec.mesh, target)
        return grad._local_tensor

    # --- all-gather extension (tensor subclasses with fsdp_pre/post_all_gather) -----------------
    def pre_all_gather(self, mesh: DeviceMesh, mp: MixedPrecisionPolicy) -> tuple[tuple[torch.Tensor, ...], object]:
        """The subclass's all-gather inputs and its metadata (``input_rows`` says which inputs fit)."""
        local = self.sharded._local_tensor
        if len(inspect.signature(local.fsdp_pre_all_gather).parameters) == 1:
            inputs, meta = local.fsdp_pre_all_gather(mesh)
        else:
            module = self.users[0][0]
            inputs, meta = local.fsdp_pre_all_gather(mesh, self.spec.shape, self.spec.stride, module, mp)
        return tuple(inputs), meta

    def input_rows(self, shapes_of_ranks: list[list[tuple[int, ...]]]) -> list[tuple[int, int]]:
        """Per all-gather input, (rows gathered on dim 0, rows per rank in the send buffer),
        from every shard rank's input shapes (the same list on all ranks, so all raise alike).
        As torch's FSDP2 takes them: an evenly sharded parameter's inputs may have any dim-0
        size equal on all ranks (torchao's NF4 weight sends flat quantized data), gathered rank
        after rank; an unevenly sharded one's must hold the shard's rows (or the padded count)
        on dim 0, the padding dropped."""
        name, world = self.users[0][1], len(shapes_of_ranks)
        even = self.rows == self.pad_rows * world
        out = []
        for shapes in zip(*shapes_of_ranks):
            if any(len(s) == 0 or s[1:] != shapes[0][1:] for s in shapes):
                raise ValueError(f"fsdp_pre_all_gather inputs of {name!r} must have a dim 0 and the same trailing "
                                 f"shape on every rank, got {list(shapes)}")
            if even and len({s[0] for s in shapes}) == 1:
                out.append((world * shapes[0][0], shapes[0][0]))
                continue
            fits = [s[0] in (chunk_span(self.rows, world, r)[1], self.pad_rows) for r, s in enumerate(shapes)]
            if even or not all(fits):
                raise ValueError(
                    f"fsdp_pre_all_gather inputs of {name!r} differ across ranks ({list(shapes)}): an evenly "
                    "sharded parameter's must have the same shape on every rank, an unevenly sharded one's "
                    f"its shard's rows (or the padded {self.pad_rows}) on dim 0")
            out.append((self.rows, self.pad_rows))
        return out

    def gather_outputs(self, kinds: list[tuple[torch.dtype, tuple[int, ...], torch.device]]) -> tuple[torch.Tensor, ...]:
        """The persistent all-gather outputs (one per input kind: dtype, gathered shape, device),
        their storage (re)allocated after a reshard freed it, and the storage of the tensors
        the subclass built on them. They persist as torch's all-gather outputs do: a
        subclass may keep them as its unsharded data and ignore ``out=`` later (torchao's
        INT8 weight does), so every all-gather must refill these same tensors."""
        if not self.outputs:
            self.outputs = tuple(accounting.track_buffer(torch.empty(shape, dtype=dtype, device=device))
                                 for dtype, shape, device in kinds)
        for t in (*self.outputs, *self.inner):
            if t.untyped_storage().nbytes() == 0:
                t.untyped_storage().resize_(self._nbytes[id(t)])
                accounting.track_resize(t)
        return self.outputs

    def post_all_gather(self, meta: object) -> None:
        """Build the unsharded tensor from the filled ``outputs`` (first time), or let the
        subclass refresh the existing one (``out=``)."""
        local = self.sharded._local_tensor
        if self.unsharded is None:
            tensor, inner = local.fsdp_post_all_gather(self.outputs, meta, self.param_dtype)
            self.inner = tuple(inner)
            self._nbytes = {id(t): t.untyped_storage().nbytes() for t in (*self.outputs, *self.inner)}
            self.unsharded = nn.Parameter(tensor, requires_grad=self.requires_grad)
        else:
            local.fsdp_post_all_gather(self.outputs, meta, self.param_dtype, out=self.unsharded)

    def free_gathered(self) -> None:
        """Free the storage of an extension's all-gather outputs and unsharded tensors."""
        for t in (*self.outputs, *self.inner):
            if t.untyped_storage().nbytes():
                t.untyped_storage().resize_(0)
                accounting.track_resize(t)

    def forget_gathered(self) -> None:
        """Drop the unsharded form entirely (the next all-gather builds a new one)."""
        self.unsharded, self.outputs, self.inner, self._nbytes = None, (), (), {}


def _chunk(data: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of dim 0 of a subclass parameter, cut as torch's
    FSDP2 cuts it (``split``: torchao's NF4 weight slices from row 0 only); no rows past
    the last chunk."""
    pieces = torch.chunk(data, world, 0)
    return pieces[rank] if rank < len(pieces) else data.new_zeros((0, *data.shape[1:]))


def _own_rows(rows: torch.Tensor) -> torch.Tensor:
    """A subclass parameter's shard in storage of its own (a view would keep the whole
    unsharded tensor alive), made as torch's FSDP2 makes it: ``new_zeros`` then ``copy_``.
    Not ``clone``: torchao's NF4 weight clones by quantizing its dequantized value again,
    which changes it."""
    own = rows.new_zeros(rows.shape)
    if type(own) is not type(rows):
        raise TypeError(f"{type(rows).__name__}.new_zeros() returned a {type(own).__name__}: FSDP keeps each rank's "
                        "shard of a parameter with fsdp_pre_all_gather in a new tensor of its type")
    return own.copy_(rows)


# _strided_exact's arguments -> its verdict
_EXACT: dict = caches.cache("fsdp.strided_exact", maxsize=1024, holds_meshes=False)


def _strided_exact(length: int, dim: int, placements: tuple[Placement, ...], shape: tuple[int, ...], at: int) -> bool:
    """:meth:`MeshInfo.layout_exact` for a strided placement on mesh dim ``at``: every
    coordinate's rows under ``placements`` against its ``torch.chunk`` piece (over mesh dim
    ``at``) of the TP block the other mesh dims give it (cached: one verdict per layout)."""
    key = (length, dim, placements, shape, at)
    verdict = _EXACT.get(key)
    if verdict is None:
        tp_only = tuple(Replicate() if m == at else p for m, p in enumerate(placements))
        verdict = True
        for coord in itertools.product(*map(range, shape)):
            block = dim_runs(length, dim, tp_only, shape, coord)
            offset, size = chunk_span(sum(n for _, n in block), shape[at], coord[at])
            fsdp_rows = compose_runs(block, ((offset, size),) if size else ())
            if dim_runs(length, dim, placements, shape, coord) != fsdp_rows:
                verdict = False
                break
        _EXACT[key] = verdict
    return verdict
