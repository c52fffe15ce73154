"""The parameters of one ``fully_shard`` call, communicated together.

Buffers (all sizes from global shapes, so every rank agrees):

* ``shard_flat``: this rank's shards of the plain parameters back to back, each
  contiguous in its local shape, padded to ``ceil(rows / world)`` along its shard dim
  (``rows``: that dim's size) and 16-byte aligned. The sharded DTensors' local
  tensors are views into it, so without a dtype cast it *is* the all-gather's send
  buffer (no copy). With ``param_dtype`` or an all-gather extension, a send buffer is
  packed instead.
* ``unsharded_flat``, where each unsharded parameter is a contiguous view, built once.
  One ``Iallgather`` of every rank's send buffer, in rank order, into a pooled buffer
  (``mesh.pool``), copied into it: for plain parameters split evenly along dim 0 one
  ``split_with_sizes_copy`` for the whole group, otherwise one ``_foreach_copy_`` of strided
  views (per parameter its full pieces and the one short piece). A group of one such
  parameter on the host is gathered straight into it (the ranks' shards back to back are
  the parameter).
  Contiguous ``Iallgather`` rather than an ``Ialltoallw`` whose datatypes place each rank's
  rows (no copy out): the derived-datatype transfer took 2-3x as long on ranks that share
  cores (docs/performance.md, "FSDP step"). Resharding frees that storage (``resize_(0)``);
  the next all-gather refills the same tensors, so autograd's saved references stay valid.
* gradients: packed into one buffer in ``reduce_dtype`` with the same padded layout (one
  ``torch.cat`` when every gradient splits evenly along dim 0), one reduce-scatter
  (blocking unless MPI progress is on, see ``comms.start_reduce_scatter``; then an
  all-reduce over the replicate dim for HSDP) and a division by the data-parallel size
  (or ``set_gradient_divide_factor``'s, split as ``comms.divide_factors`` says around the
  all-reduce hook); the sharded ``.grad``s are made from the result.
  Replicated parameters (TP-sharded on every dim) are left out of both buffers: their
  gradients are packed into one buffer and all-reduced over the data-parallel mesh.

* all-gather extensions (``fsdp_pre_all_gather``): each input is gathered along dim 0,
  padded in the send buffer to the shard's padded rows when the parameter is unevenly
  sharded (an evenly sharded one's inputs may have any dim-0 size, the same on all ranks,
  as torchao's NF4 weight's flat data); the gathered rows (padding dropped) are copied into
  the parameter's *persistent* outputs, freed on reshard and refilled by every
  all-gather, because a subclass may build its unsharded tensor on them and ignore
  ``out=`` afterwards (torchao's INT8 weight does, as torch's FSDP2 allows).
* ``reshard_after_forward=k``: after forward each rank keeps its ``world / k`` rows of the
  all-gather buffer (rebuilt from the unsharded parameters), and backward's all-gather
  runs over its subgroup of ``k`` ranks only.
* ``CPUOffloadPolicy`` on a non-CPU mesh: ``shard_flat`` and the ``.grad`` shards on the
  host, copied to the device for the all-gather and back after the reduce-scatter.

``shard_flat`` and ``unsharded_flat`` are registered with ``mesh.accounting`` (and every
resize reported), so ``memory_allocated()`` shows sharded + currently gathered bytes.
"""
from __future__ import annotations

import functools
from math import prod
from typing import Callable, NamedTuple

import torch
from mpi4py import MPI
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..dtensor import DTensor
from ..mesh import accounting
from ..mesh.agreement import attempt, portable, raise_first
from ..mesh.nonblocking import Handle, iall_gather, iall_reduce
from ..mesh.pool import advise_huge_pages, tracked_empty
from ..mesh.prepared import Prepared
from . import comms
from .float8 import whole_weight_scales
from .mixed_precision import MixedPrecisionPolicy
from .offload import OffloadPolicy, compute_device, host_device, pinned
from .param import FSDPParam, MeshInfo

ALIGN = 16  # bytes: every segment may be viewed as any dtype


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Piece(NamedTuple):
    """One tensor of a rank's all-gather input: a plain parameter's padded shard, or one of
    an extension's ``fsdp_pre_all_gather`` inputs (gathered along dim 0)."""

    dtype: torch.dtype
    rest: tuple[int, ...] | None  # trailing shape (None: a plain parameter's shard)
    offset: int  # byte offset in the input
    nbytes: int  # padded and aligned
    rows: int  # dim-0 size gathered (padding dropped)
    pad: int  # dim-0 rows per rank in the input


class ParamGroup:
    """Flat buffers, all-gather, reshard and gradient reduce-scatter of one group."""

    def __init__(self, params: list[FSDPParam], info: MeshInfo, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int, offload: OffloadPolicy = OffloadPolicy()) -> None:
        self.params = params
        self.info = info
        self.mp = mp
        # int: after forward keep the parameters gathered over a subgroup of that many ranks
        self.post_forward_comm = info.subgroup(reshard_after_forward) if type(reshard_after_forward) is int else None
        self.reshard_after_forward = bool(reshard_after_forward)
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        # settings of FSDPModule's set_* methods (torch's defaults)
        self.requires_all_reduce = True
        self.unshard_in_backward = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.custom_all_gather = self.custom_reduce_scatter = None
        trainable = [p for p in params if p.requires_grad]
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype or (trainable[0].orig_dtype if trainable else None)
        self.gathered = [p for p in params if not p.replicated]
        self._plain = [p for p in self.gathered if not p.extension]
        self._extensions = [(i, p) for i, p in enumerate(self.gathered) if p.extension]
        self._replicated = [p for p in params if p.replicated]
        self._users = [(module, name, p) for p in params for module, name in p.users]
        self.direct = all(not p.extension and p.param_dtype == p.orig_dtype for p in self.gathered)
        shard_total = unsharded_total = 0
        for p in self.gathered:
            p.shard_offset, p.unsharded_offset = shard_total, unsharded_total
            if not p.extension:
                shard_total += _align(p.shard_numel * p.orig_dtype.itemsize)
                unsharded_total += _align(p.numel * p.param_dtype.itemsize)
        self.unsharded_nbytes = unsharded_total
        # one parameter, even dim-0 shards: a plain Iallgather lays it out (2x faster than
        # Ialltoallw at 4 MiB with one rank per core; docs/performance.md "FSDP step")
        only = self.gathered[0] if len(self.gathered) == 1 else None
        self._rank_major = only is not None and only.pre == 1 and only.rows % info.shard_size == 0
        built_on = params[0].initial_local.device
        self.offload_to = host_device(offload, info.mesh, built_on)  # where sharded state lives, if moved
        self.device = compute_device(info.mesh) if self.offload_to else built_on  # gathered params, gradients
        self.shard_flat = accounting.track_buffer(pinned(offload, torch.zeros(
            shard_total, dtype=torch.uint8, device=self.offload_to or self.device)))
        with torch.no_grad():
            for p in params:
                if p.extension or p.replicated:
                    local = p.initial_local if self.offload_to is None else p.initial_local.to(self.offload_to)
                else:
                    local = self._slot(p).copy_(p.initial_local)
                p.make_sharded(local)
                p.initial_local = None
        self.unsharded_flat: torch.Tensor | None = None
        self.is_unsharded = False
        self._pieces: list[list[Piece]] | None = None
        self._input_kinds: dict[int, list[tuple[torch.dtype, tuple[int, ...]]]] = {}  # first extension inputs
        self._gather_nbytes = 0
        self._gather: Handle | None = None
        self._gather_placed = False  # the running all-gather writes into unsharded_flat itself
        self._split_sizes: list[int] | None = None  # see _make_layout
        self._split_views: tuple[torch.Tensor | None, list[torch.Tensor]] = (None, [])
        self._from_ranks_views: tuple[torch.Tensor | None, list[torch.Tensor], list[tuple]] = (None, [], [])
        self._meta: dict[int, object] = {}
        self._pending: tuple[Handle | None, list[FSDPParam], Handle | None, list[FSDPParam]] | None = None
        self._scatters: dict[tuple[int, torch.dtype], Prepared] = {}  # see comms.start_reduce_scatter
        self._partial: torch.Tensor | None = None  # HSDP: reduce-scattered, not yet all-reduced (summed)
        self._kept: torch.Tensor | None = None  # reshard_after_forward=int: this rank's rows of a gather
        self._kept_meta: dict[int, object] = {}

    # --- sharded storage -----------------------------------------------------------------------
    def _slot(self, p: FSDPParam) -> torch.Tensor:
        """``p``'s local shard inside ``shard_flat``."""
        nbytes = p.local_numel * p.orig_dtype.itemsize
        flat = self.shard_flat[p.shard_offset:p.shard_offset + nbytes]
        return flat.view(p.orig_dtype).view(p.local_shape)

    def sync(self) -> None:
        """Make every sharded parameter a view into ``shard_flat`` again, after
        ``load_state_dict(assign=True)``, ``to_empty`` or a moved module replaced it."""
        for p in self.params:
            module, name = p.users[0]
            current = module._parameters[name]
            if current is not p.sharded and current is not p.unsharded:
                p.adopt(current)
        plain = self._plain
        if not plain:
            return
        device = plain[0].sharded._local_tensor.device
        if device != self.shard_flat.device:
            if self.offload_to is None:
                self.device = device
            self.shard_flat = accounting.track_buffer(torch.zeros(self.shard_flat.numel(), dtype=torch.uint8, device=device))
            self.unsharded_flat = None
            for p in self.params:
                p.forget_gathered()
        base = self.shard_flat.data_ptr()
        moved = [p for p in plain if p.sharded._local_tensor.data_ptr() != base + p.shard_offset]
        if moved:  # (the common case: nothing moved, no view built)
            with torch.no_grad():
                for p in moved:
                    slot = self._slot(p)
                    slot.copy_(p.sharded._local_tensor)
                    p.sharded._local_tensor = slot

    # --- all-gather ------------------------------------------------------------------------------
    def start_unshard(self) -> None:
        """Issue this group's all-gather (non-blocking); ``finish_unshard`` completes it."""
        if self.is_unsharded or self._gather is not None:
            return
        if self._kept is not None:  # gather the rows kept after forward over the subgroup
            kept, self._kept = self._kept, None
            self._meta = dict(self._kept_meta)
            self._start_gather(kept, self.post_forward_comm)
            return
        self.sync()
        inputs, error = attempt(self._pre_all_gather)
        if self._pieces is None:  # the first gather: the subclasses' hooks ran alike on all ranks, or all raise
            self._make_layout(inputs, error)
        elif error is not None:
            raise error
        if not self.gathered:
            self._gather = _NO_GATHER
            return
        if self._placeable():  # the unsharded parameter is the ranks' shards back to back
            self._ensure_unsharded_storage()
            comm = self.info.shard_comm
            nbytes = self.gathered[0].local_numel * self.gathered[0].orig_dtype.itemsize
            self._gather = iall_gather(self.shard_flat[:nbytes], comm, out=self.unsharded_flat[:nbytes * comm.size])
            self._gather_placed = True
            return
        if self.direct:
            send = self.shard_flat.to(self.device, non_blocking=True)  # itself unless offloaded
        else:
            send = torch.zeros(self._gather_nbytes, dtype=torch.uint8, device=self.device)
            with torch.no_grad():
                for i, p in enumerate(self.gathered):
                    if p.extension:
                        self._check_inputs(i, p, inputs[i])
                        for t, piece in zip(inputs[i], self._pieces[i]):
                            nbytes = t.numel() * piece.dtype.itemsize
                            send[piece.offset:piece.offset + nbytes].view(piece.dtype).view(t.shape).copy_(t)
                    else:
                        offset, nbytes = self._pieces[i][0].offset, p.local_numel * p.param_dtype.itemsize
                        send[offset:offset + nbytes].view(p.param_dtype).view(p.local_shape).copy_(p.sharded._local_tensor)
        self._start_gather(send, self.info.shard_comm)

    def _placeable(self) -> bool:
        """Whether the all-gather can write straight into ``unsharded_flat``: one plain
        parameter in its own dtype, split evenly along dim 0 (its ranks' shards back to
        back), on the host, with torch's default collective."""
        return (self._rank_major and self.direct and self.custom_all_gather is None
                and self.offload_to is None and self.shard_flat.device.type == "cpu")

    def _ensure_unsharded_storage(self) -> None:
        """Allocate ``unsharded_flat`` (first gather) or give back its freed storage."""
        if self.unsharded_flat is None:
            self.unsharded_flat = tracked_empty(self.unsharded_nbytes, torch.uint8, self.device)
        elif self.unsharded_flat.untyped_storage().nbytes() == 0:
            self.unsharded_flat.untyped_storage().resize_(self.unsharded_nbytes)  # new memory: advise it again
            accounting.track_resize(advise_huge_pages(self.unsharded_flat))

    def _free_unsharded_storage(self) -> None:
        if self.unsharded_flat is not None and self.unsharded_flat.untyped_storage().nbytes():
            self.unsharded_flat.untyped_storage().resize_(0)
            accounting.track_resize(self.unsharded_flat)

    def _start_gather(self, send: torch.Tensor, comm: MPI.Comm) -> None:
        """Start gathering ``send`` over ``comm`` into a buffer of every shard rank's rows."""
        nbytes = self._gather_nbytes * self.info.shard_size
        out = comms.allocate(self.custom_all_gather, (nbytes,), torch.uint8, self.device, reusable=True)
        self._gather = comms.start_all_gather(self.custom_all_gather, send, comm, out)

    def _pre_all_gather(self) -> dict[int, tuple[torch.Tensor, ...]]:
        """The extension parameters' all-gather inputs (their metadata kept for the post hook)."""
        inputs = {}
        if not self._extensions:
            return inputs
        with whole_weight_scales([p.sharded._local_tensor for _, p in self._extensions], self.info.shard_comm):
            for i, p in self._extensions:
                inputs[i], self._meta[i] = p.pre_all_gather(self.info.mesh, self.mp)
        return inputs

    def _make_layout(self, inputs: dict[int, tuple[torch.Tensor, ...]] | None, error: Exception | None) -> None:
        """Per gathered parameter, its pieces of one rank's all-gather input (``Piece``); a
        plain parameter's one piece is its padded shard. Extension inputs are laid out from
        every rank's input shapes (``_input_rows``: one small collective, first all-gather only),
        which also carries ``error``, a rank's failure to make its inputs."""
        rows = self._input_rows(inputs, error) if self._extensions else {}
        self._input_kinds = {i: [(t.dtype, tuple(t.shape)) for t in inputs[i]] for i, _ in self._extensions}
        pieces, offset = [], 0
        for i, p in enumerate(self.gathered):
            if p.extension:
                kinds = [(t.dtype, tuple(t.shape[1:]), *r) for t, r in zip(inputs[i], rows[i])]
            else:
                kinds = [(p.param_dtype, None, p.rows, p.pad_rows)]
            own = []
            for dtype, rest, gathered, pad in kinds:
                numel = p.shard_numel if rest is None else pad * prod(rest)
                nbytes = _align(numel * dtype.itemsize)
                own.append(Piece(dtype, rest, offset, nbytes, gathered, pad))
                offset += nbytes
            pieces.append(own)
        self._pieces, self._gather_nbytes = pieces, offset
        # plain parameters split evenly along dim 0 with no alignment gap between their pieces:
        # column block i of the gathered (world, bytes) rows is parameter i, seen as (world, piece)
        world = self.info.shard_size
        if all(not p.extension and p.pre == 1 and p.rows == p.pad_rows * world
               and own[0].nbytes == p.shard_numel * p.param_dtype.itemsize for p, own in zip(self.gathered, pieces)):
            self._split_sizes = [own[0].nbytes for own in pieces]

    def _split_outputs(self) -> list[torch.Tensor]:
        """The unsharded parameters as (world, piece) byte views of ``unsharded_flat``, made
        once per buffer (a view follows its storage through the resizes)."""
        flat, views = self._split_views
        if flat is not self.unsharded_flat:
            world = self.info.shard_size
            views = [self.unsharded_flat[p.unsharded_offset:p.unsharded_offset + world * n].view(world, n)
                     for p, n in zip(self.gathered, self._split_sizes)]
            self._split_views = (self.unsharded_flat, views)
        return views

    def _input_rows(self, inputs: dict[int, tuple[torch.Tensor, ...]] | None,
                    error: Exception | None) -> dict[int, list[tuple[int, int]]]:
        """Per extension parameter and all-gather input, (gathered rows on dim 0, rows per
        rank in the send buffer), from every shard rank's input shapes (one ``allgather``),
        so that all ranks lay out, or refuse (``FSDPParam.input_rows``, a rank's ``error``), alike."""
        mine = portable(error) if error is not None else {i: [tuple(t.shape) for t in inputs[i]]
                                                          for i, _ in self._extensions}
        every = self.info.shard_comm.allgather(mine)
        raise_first([e for e in every if isinstance(e, BaseException)])
        return {i: p.input_rows([shapes[i] for shapes in every]) for i, p in self._extensions}

    def _check_inputs(self, i: int, p: FSDPParam, inputs: tuple[torch.Tensor, ...]) -> None:
        """Each all-gather keeps the count, dtypes and shapes of the first."""
        kinds = [(t.dtype, tuple(t.shape)) for t in inputs]
        first = self._input_kinds[i]
        if kinds != first:
            raise ValueError(f"fsdp_pre_all_gather of {p.users[0][1]!r} returned inputs {kinds}, "
                             f"unlike the first all-gather's {first}")

    def finish_unshard(self) -> None:
        """Wait for the all-gather and put the unsharded parameters on the modules."""
        if self.is_unsharded:
            return
        self.start_unshard()
        out = self._gather.wait()
        self._gather = None
        placed, self._gather_placed = self._gather_placed, False
        self._ensure_unsharded_storage()
        existing = [p.unsharded for p in self.params if p.unsharded is not None]
        versions = [t._version for t in existing]
        with torch.no_grad():
            if not placed and out is not None:  # (placed: the all-gather wrote the parameters in place)
                rows_of_ranks = out.view(self.info.shard_size, self._gather_nbytes)
                if self._split_sizes is not None:  # every parameter in one copy
                    torch.split_with_sizes_copy(rows_of_ranks, self._split_sizes, dim=1, out=self._split_outputs())
                else:
                    self._copy_from_ranks(rows_of_ranks)
                for i, p in self._extensions:
                    self._post_all_gather(i, p, rows_of_ranks)
            if placed or out is not None:
                for p in self._plain:
                    if p.unsharded is None:
                        p.unsharded = p.wrap_unsharded(self._unsharded_view(p).view(p.shape))
            for p in self._replicated:
                self._unshard_replica(p)
        torch._C._autograd._unsafe_set_version_counter(existing, versions)
        self.is_unsharded = True
        self._install(unsharded=True)

    def _install(self, unsharded: bool) -> None:
        """Put every parameter's unsharded (else sharded) form on its user modules."""
        for module, name, p in self._users:
            module._parameters[name] = p.unsharded if unsharded else p.sharded

    def _copy_from_ranks(self, rows_of_ranks: torch.Tensor) -> None:
        """Copy the plain parameters' gathered chunks (padding dropped) into ``unsharded_flat``
        with one ``_foreach_copy_`` of strided views (``_chunk_layout``): those into
        ``unsharded_flat`` made once per buffer (a view follows its storage through the
        resizes), those of the all-gather buffer (a new one every time) from kept strides."""
        flat, dsts, places = self._from_ranks_views
        if flat is not self.unsharded_flat:
            dsts, places = [], []
            for i, p in enumerate(self.gathered):
                if p.extension:
                    continue
                dtype, n = p.param_dtype, p.param_dtype.itemsize
                whole = self.unsharded_flat.view(dtype)
                at, col = whole.storage_offset() + p.unsharded_offset // n, self._pieces[i][0].offset // n
                for size, stride, offset, rank_stride, rank_offset in _chunk_layout(
                        (p.pre, p.rows, p.post), p.pad_rows, self._gather_nbytes // n):
                    dsts.append(whole.as_strided(size, stride, at + offset))
                    places.append((dtype, size, rank_stride, col + rank_offset))
            self._from_ranks_views = (self.unsharded_flat, dsts, places)
        typed: dict[torch.dtype, torch.Tensor] = {}
        srcs = []
        for dtype, size, stride, offset in places:
            ranks = typed.get(dtype)
            if ranks is None:
                ranks = typed[dtype] = rows_of_ranks.view(dtype)
            srcs.append(ranks.as_strided(size, stride, ranks.storage_offset() + offset))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _post_all_gather(self, i: int, p: FSDPParam, rows_of_ranks: torch.Tensor) -> None:
        """Copy an extension parameter's gathered pieces (padding dropped) into its
        persistent outputs and let the subclass build (or refresh) its unsharded tensor."""
        kinds = [(piece.dtype, (piece.rows, *piece.rest), self.device) for piece in self._pieces[i]]
        for out, piece in zip(p.gather_outputs(kinds), self._pieces[i]):
            parts, places = _chunk_views((1, piece.rows, prod(piece.rest)), piece.pad, out,
                                         rows_of_ranks.view(piece.dtype), piece.offset // piece.dtype.itemsize)
            if parts:
                torch._foreach_copy_(parts, places)
        self._kept_meta[i] = self._meta.pop(i)
        p.post_all_gather(self._kept_meta[i])

    def _unsharded_view(self, p: FSDPParam) -> torch.Tensor:
        """``p``'s unsharded tensor in ``unsharded_flat``, seen as (pre, rows, post)."""
        nbytes = p.numel * p.param_dtype.itemsize
        flat = self.unsharded_flat[p.unsharded_offset:p.unsharded_offset + nbytes]
        return flat.view(p.param_dtype).view(p.pre, p.rows, p.post)

    def _unshard_replica(self, p: FSDPParam) -> None:
        """A replicated parameter's unsharded form: its local block itself (a copy in
        ``param_dtype``, or on the compute device when offloaded), rebuilt only when the
        local block was replaced."""
        local = p.sharded._local_tensor
        if p.unsharded is None or p.replica_src is not local:
            p.replica_src = local
            p.unsharded = p.wrap_unsharded(local.to(device=self.device, dtype=p.param_dtype))
        elif local.dtype != p.param_dtype or local.device != self.device:  # a copy: refresh it
            p.unsharded._local_tensor.copy_(local)  # (replicated parameters are TP DTensors)

    def reshard_post_forward(self) -> None:
        """Reshard after forward: fully, or (``reshard_after_forward=k``) keeping this rank's
        ``world / k`` rows of the all-gather so that backward gathers over the k ranks of
        its subgroup only; the kept rows are rebuilt from the unsharded parameters."""
        if self.post_forward_comm is None or not self.is_unsharded or not self.gathered:
            self.reshard()
            return
        k, world = self.post_forward_comm.size, self.info.shard_size
        first = self.post_forward_comm.rank * (world // k)
        kept = tracked_empty((world // k, self._gather_nbytes), torch.uint8, self.device)
        with torch.no_grad():
            for i, p in enumerate(self.gathered):
                if p.extension:
                    sources = [(out.view(1, piece.rows, prod(piece.rest)), piece)
                               for out, piece in zip(p.outputs, self._pieces[i])]
                else:
                    sources = [(self._unsharded_view(p), self._pieces[i][0])]
                for src, piece in sources:
                    _rank_rows(kept[:, piece.offset:piece.offset + piece.nbytes].view(piece.dtype), src, piece.pad,
                               first)
        self.reshard()
        self._kept = kept.view(-1)

    def reshard(self) -> None:
        """Put the sharded parameters back and free the unsharded storage."""
        self._kept = None
        if self._gather is not None:  # a prefetch nobody used
            self._gather.wait()
            self._gather, self._gather_placed = None, False
            self._meta.clear()
            if not self.is_unsharded:
                self._free_unsharded_storage()
        if not self.is_unsharded:
            return
        self._install(unsharded=False)
        for _, p in self._extensions:
            p.free_gathered()
        self._free_unsharded_storage()
        self.is_unsharded = False

    # --- gradients -------------------------------------------------------------------------------
    def post_backward(self) -> None:
        """Start reduce-scattering the unsharded gradients (or keep them while gradient
        sync is off); reshard if ``reshard_after_backward``."""
        params, grads = [], []
        for p in self.params:
            unsharded = p.unsharded
            g = unsharded.grad if unsharded is not None and p.requires_grad else None
            if g is None:
                continue
            params.append(p)
            unsharded.grad = None
            if isinstance(g, DTensor):
                if g._spec.placements != p.tp_spec.placements:
                    g = g.redistribute(p.tp_spec.mesh, p.tp_spec.placements)
                g = g._local_tensor
            if type(g) is not torch.Tensor:
                g = _plain_grad(g, p)
            if p.grad_acc is not None:
                g, p.grad_acc = g + p.grad_acc, None
            grads.append(g)
        # HSDP without the all-reduce: replicated parameters' gradients wait unreduced
        skip_all_reduce = not self.requires_all_reduce and self.info.replicate_comm is not None
        hold = not self.requires_gradient_sync or skip_all_reduce
        if hold:
            for p, g in zip(params, grads):
                if p.replicated or not self.requires_gradient_sync:
                    p.grad_acc = g
        if self.requires_gradient_sync and params:
            self.finish_reduce()  # a reduction left running (set_is_last_backward(False)) ends first
            self._start_reduce([(p, g) for p, g in zip(params, grads) if not (p.replicated and hold)])
        if self.reshard_after_backward:
            self.reshard()

    def _start_reduce(self, params: list[tuple[FSDPParam, torch.Tensor]]) -> None:
        """One reduce-scatter for the sharded parameters' gradients, one all-reduce for
        the replicated ones'."""
        world = self.info.shard_size
        sharded, replicated = params, []
        if self._replicated:
            sharded = [(p, g) for p, g in params if not p.replicated]
            replicated = [(p, g) for p, g in params if p.replicated]
        pre, _, _ = self._factors()
        scatter = reduce = None
        with torch.no_grad():
            if sharded:
                total = sum(p.shard_numel for p, _ in sharded)
                device = sharded[0][1].device
                send = comms.allocate(self.custom_reduce_scatter, (world * total,), self.reduce_dtype, device,
                                      reusable=True)
                _pack_ranks(send.view(world, total), sharded)
                comms.divide(send, pre)
                scatter = comms.start_reduce_scatter(self.custom_reduce_scatter, send, self.info.shard_comm,
                                                     self._scatters)
            if replicated:
                flat = torch.cat([g.reshape(-1).to(self.reduce_dtype) for _, g in replicated])
                comms.divide(flat, pre)
                reduce = iall_reduce(flat, self.info.mesh.comm_for(tuple(range(self.info.mesh.ndim))), "sum", inplace=True)
        self._pending = (scatter, [p for p, _ in sharded], reduce, [p for p, _ in replicated])

    def _factors(self) -> tuple[float | None, float | None, float | None]:
        return comms.divide_factors(self.info.dp_size, self.gradient_divide_factor, self.reduce_dtype,
                                    self.force_sum_reduction)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and (HSDP) the all-reduce over the replicate dim,
        scale, run the all-reduce hook, and add the shards to the parameters' ``.grad``.
        Under HSDP with ``requires_all_reduce`` off, the reduce-scattered sum is kept
        (summed over backwards) and all-reduced by the next backward that has it on."""
        if self._pending is None:
            return
        scatter, sharded, reduce, replicated = self._pending
        self._pending = None
        _, with_comm, post = self._factors()
        outputs: list[tuple[torch.Tensor, list[FSDPParam], list[int]]] = []
        if scatter is not None:
            out = scatter.wait()
            if self.info.replicate_comm is not None and not self.requires_all_reduce:
                self._partial = out if self._partial is None else self._partial.add_(out)
            else:
                if self._partial is not None:
                    out, self._partial = out.add_(self._partial), None
                if self.info.replicate_comm is not None:
                    iall_reduce(out, self.info.replicate_comm, "sum", inplace=True).wait()
                outputs.append((out, sharded, [p.shard_numel for p in sharded]))
        if reduce is not None:
            outputs.append((reduce.wait(), replicated, [p.numel for p in replicated]))
        for flat, params, sizes in outputs:
            comms.divide(flat, with_comm)
            if self.all_reduce_hook is not None:
                self.all_reduce_hook(flat)
            comms.divide(flat, post)
            to_device = self.offload_to or flat.device
            flat = flat.contiguous()  # (a custom collective's output may be strided)
            at = flat.storage_offset()
            for p, size in zip(params, sizes):
                local = flat.as_strided(p.local_shape, p.local_stride, at)
                at += size
                if local.dtype != p.orig_dtype or local.device != to_device:
                    local = local.to(device=to_device, dtype=p.orig_dtype)
                if p.sharded.grad is None:
                    p.sharded.grad = DTensor(local, p.spec, requires_grad=False)
                else:
                    p.sharded.grad._local_tensor.add_(local)

    def reset(self) -> None:
        """Back to the state between iterations, after an exception: finish and drop any
        collective in flight, drop held gradients (no_sync and HSDP partial sums), reshard."""
        if self._pending is not None:
            for handle in (self._pending[0], self._pending[2]):
                if handle is not None:
                    handle.wait()
            self._pending = None
        self._partial = None
        for p in self.params:
            p.grad_acc = None
            if p.unsharded is not None:
                p.unsharded.grad = None
        self.reshard()

    @property
    def reducing(self) -> bool:
        """A reduce-scatter has started and ``finish_reduce`` has not run yet."""
        return self._pending is not None

    @property
    def has_pending_grads(self) -> bool:
        """Some unsharded gradients arrived that ``post_backward`` has not taken yet."""
        return any(p.unsharded is not None and p.unsharded.grad is not None for p in self.params)


def _plain_grad(grad: torch.Tensor, p: FSDPParam) -> torch.Tensor:
    """``grad``, not a plain tensor, as one: a gradient that came back as a tensor subclass
    (a quantized weight's autograd may return its own type) is dequantized, or unwrapped
    if it is a plain tensor underneath; the reduce-scatter packs plain values."""
    if hasattr(grad, "dequantize"):
        return grad.dequantize()
    if not is_traceable_wrapper_subclass(grad):
        return grad.as_subclass(torch.Tensor)
    raise TypeError(f"the gradient of {p.users[0][1]!r} is a {type(grad).__name__} without dequantize(): "
                    "FSDP cannot reduce-scatter it; return a plain gradient from the subclass's backward")


class _NoGather:
    """The all-gather of a group with nothing to gather (only replicated parameters)."""

    @staticmethod
    def wait() -> None:
        return None


_NO_GATHER = _NoGather()


def _pack_ranks(per_rank: torch.Tensor, grads: list[tuple[FSDPParam, torch.Tensor]]) -> None:
    """Lay ``grads`` out for the reduce-scatter: row ``r`` of ``per_rank`` (world, total) holds
    rank r's padded piece of each gradient, back to back, zero-padded. Gradients split evenly
    along dim 0 are the common case: each is then its ranks' pieces already, seen as (world,
    piece), and one ``torch.cat`` along dim 1 packs them all; otherwise one ``_foreach_copy_``
    of every gradient's chunks (``_chunk_layout``) and one ``_foreach_zero_`` of the padding."""
    world = per_rank.size(0)
    if all(p.pre == 1 and p.rows == p.pad_rows * world and g.dtype == per_rank.dtype for p, g in grads):
        torch.cat([g.reshape(world, p.shard_numel) for p, g in grads], dim=1, out=per_rank)
        return
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    pads: list[torch.Tensor] = []
    col = 0
    for p, g in grads:
        parts, places = _chunk_views((p.pre, p.rows, p.post), p.pad_rows, g.contiguous(), per_rank, col)
        srcs += parts
        dsts += places
        pads += _padding(p, per_rank, col)
        col += p.shard_numel
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    if pads:
        torch._foreach_zero_(pads)


@functools.lru_cache(maxsize=None)
def _chunk_layout(shape: tuple[int, int, int], pad: int, row: int) -> tuple[tuple, ...]:
    """How a (pre, rows, post) tensor, contiguous, maps onto its rank chunks in rows of
    ``row`` elements: row ``r`` holds rank r's chunk of dim 1 (``pad`` rows, the last one
    short) as a contiguous (pre, its rows, post) block. Per matching pair of strided views
    (two at most: the full chunks together, then the one short chunk): (size, stride and
    offset in the tensor, stride and offset from the piece's first column). Cached: it
    depends on global shapes only."""
    pre, rows, post = shape
    if pad == 0:
        return ()
    full, rem = divmod(rows, pad)
    pairs = []
    if full:
        pairs.append(((pre, full, pad, post), (rows * post, pad * post, post, 1), 0, (pad * post, row, post, 1), 0))
    if rem:
        pairs.append(((pre, rem, post), (rows * post, post, 1), full * pad * post, (rem * post, post, 1), full * row))
    return tuple(pairs)


def _chunk_views(shape: tuple[int, int, int], pad: int, whole: torch.Tensor, ranks: torch.Tensor,
                 col: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ``_chunk_layout`` view pairs of contiguous ``whole`` (seen as ``shape``) and of
    its chunks in ``ranks`` (world, row) from column ``col``, to copy with one ``_foreach_copy_``."""
    at, base = whole.storage_offset(), ranks.storage_offset() + col
    parts, places = [], []
    for size, stride, offset, rank_stride, rank_offset in _chunk_layout(shape, pad, ranks.stride(0)):
        parts.append(whole.as_strided(size, stride, at + offset))
        places.append(ranks.as_strided(size, rank_stride, base + rank_offset))
    return parts, places


def _padding(p: FSDPParam, ranks: torch.Tensor, col: int) -> list[torch.Tensor]:
    """The padding of ``p``'s chunks in ``ranks`` (``_chunk_layout``): the short chunk's
    tail and the rows of ranks past the last chunk."""
    world, row = ranks.size(0), ranks.stride(0)
    full, rem = divmod(p.rows, p.pad_rows) if p.pad_rows else (world, 0)
    if full == world:
        return []
    base, used = ranks.storage_offset() + col + full * row, p.pre * rem * p.post
    pads = []
    if used < p.shard_numel:
        pads.append(ranks.as_strided((p.shard_numel - used,), (1,), base + used))
    if full + 1 < world:
        pads.append(ranks.as_strided((world - full - 1, p.shard_numel), (row, 1), base + row))
    return pads


def _rank_rows(dst: torch.Tensor, src: torch.Tensor, pad: int, first: int) -> None:
    """Rows ``first, first + 1, ...`` of ``_chunk_layout``'s layout (one per row of ``dst``),
    built from ``src`` (pre, rows, post): those ranks' chunks, zero-padded."""
    pre, rows, post = src.shape
    for i in range(dst.size(0)):
        lo, hi = min((first + i) * pad, rows), min((first + i + 1) * pad, rows)
        n = pre * (hi - lo) * post
        dst[i, :n].view(pre, hi - lo, post).copy_(src[:, lo:hi])
        dst[i, n:].zero_()
