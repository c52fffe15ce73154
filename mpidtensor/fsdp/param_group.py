"""The parameters of one ``fully_shard`` call, communicated together.

Buffers (all sizes from global shapes, so every rank agrees):

* ``shard_flat``: this rank's shards of the plain parameters back to back, each
  contiguous in its local shape, padded to ``ceil(rows / world)`` along its shard dim
  (``rows``: that dim's size) and 16-byte aligned. The sharded DTensors' local
  tensors are views into it, so without a dtype cast it *is* the all-gather's send
  buffer (no copy). With ``param_dtype`` or an all-gather extension, a send buffer is
  packed instead.
* the all-gather output (one ``Iallgather``: every rank's send buffer in rank order),
  copied once into ``unsharded_flat``, where each unsharded parameter is a contiguous
  view (for a shard dim > 0 a strided copy: at most two ``copy_`` calls, full pieces
  and the one short piece). Resharding frees that storage (``resize_(0)``); the next
  all-gather refills the same tensors, so autograd's saved references stay valid.
* gradients: packed into one buffer in ``reduce_dtype`` with the same padded layout,
  one ``Ireduce_scatter`` (then an all-reduce over the replicate dim for HSDP) and a
  division by the data-parallel size; the sharded ``.grad``s are views of the result.
  Replicated parameters (TP-sharded on every dim) are left out of both buffers: their
  gradients are packed into one buffer and all-reduced over the data-parallel mesh.

``shard_flat`` and ``unsharded_flat`` are registered with ``mesh.accounting`` (and every
resize reported), so ``memory_allocated()`` shows sharded + currently gathered bytes.
"""
from __future__ import annotations

from math import prod

import torch

from ..mesh import accounting
from ..dtensor import DTensor
from ..mesh.nonblocking import Handle, iall_gather, iall_reduce, ireduce_scatter
from .mixed_precision import MixedPrecisionPolicy
from .param import FSDPParam, MeshInfo

ALIGN = 16  # bytes: every segment may be viewed as any dtype


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class ParamGroup:
    """Flat buffers, all-gather, reshard and gradient reduce-scatter of one group."""

    def __init__(self, params: list[FSDPParam], info: MeshInfo, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool) -> None:
        self.params = params
        self.info = info
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        trainable = [p for p in params if p.requires_grad]
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype or (trainable[0].orig_dtype if trainable else None)
        self.gathered = [p for p in params if not p.replicated]
        self.direct = all(not p.extension and p.param_dtype == p.orig_dtype for p in self.gathered)
        shard_total = unsharded_total = 0
        for p in self.gathered:
            p.shard_offset, p.unsharded_offset = shard_total, unsharded_total
            if not p.extension:
                shard_total += _align(p.shard_numel * p.orig_dtype.itemsize)
                unsharded_total += _align(p.numel * p.param_dtype.itemsize)
        self.unsharded_nbytes = unsharded_total
        self.device = params[0].initial_local.device
        self.shard_flat = accounting.track_buffer(torch.zeros(shard_total, dtype=torch.uint8, device=self.device))
        with torch.no_grad():
            for p in params:
                local = p.initial_local if p.extension or p.replicated else self._slot(p).copy_(p.initial_local)
                p.make_sharded(local)
                p.initial_local = None
        self.unsharded_flat: torch.Tensor | None = None
        self.is_unsharded = False
        self._pieces: list[list[tuple[torch.dtype, tuple[int, ...], int, int]]] | None = None
        self._gather_nbytes = 0
        self._gather: Handle | None = None
        self._meta: dict[int, object] = {}
        self._pending: tuple[Handle | None, list[FSDPParam], Handle | None, list[FSDPParam]] | None = None

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
            current = p.current()
            if current is not p.sharded and current is not p.unsharded:
                p.adopt(current)
        plain = [p for p in self.gathered if not p.extension]
        if not plain:
            return
        device = plain[0].sharded._local_tensor.device
        if device != self.shard_flat.device:
            self.device = device
            self.shard_flat = accounting.track_buffer(torch.zeros(self.shard_flat.numel(), dtype=torch.uint8, device=device))
            self.unsharded_flat = None
            for p in self.params:
                p.unsharded, p.inner = None, ()
        with torch.no_grad():
            for p in plain:
                local, slot = p.sharded._local_tensor, self._slot(p)
                if local.data_ptr() != slot.data_ptr() or local.device != slot.device:
                    slot.copy_(local)
                    p.sharded._local_tensor = slot

    # --- all-gather ------------------------------------------------------------------------------
    def start_unshard(self) -> None:
        """Issue this group's all-gather (non-blocking); ``finish_unshard`` completes it."""
        if self.is_unsharded or self._gather is not None:
            return
        self.sync()
        inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        for i, p in enumerate(self.gathered):
            if p.extension:
                inputs[i], self._meta[i] = p.pre_all_gather(self.info.mesh, self.mp)
        if self._pieces is None:
            self._make_layout(inputs)
        if not self.gathered:
            self._gather = _NO_GATHER
            return
        if self.direct:
            send = self.shard_flat
        else:
            send = torch.zeros(self._gather_nbytes, dtype=torch.uint8, device=self.device)
            with torch.no_grad():
                for i, p in enumerate(self.gathered):
                    if p.extension:
                        for t, (dtype, rest, offset, _) in zip(inputs[i], self._pieces[i]):
                            nbytes = p.local_rows * prod(rest) * dtype.itemsize
                            send[offset:offset + nbytes].view(dtype).view(p.local_rows, *rest).copy_(t)
                    else:
                        offset, nbytes = self._pieces[i][0][2], p.local_numel * p.param_dtype.itemsize
                        send[offset:offset + nbytes].view(p.param_dtype).view(p.local_shape).copy_(p.sharded._local_tensor)
        out = accounting.track_buffer(torch.empty(self._gather_nbytes * self.info.shard_size, dtype=torch.uint8, device=self.device))
        self._gather = iall_gather(send, self.info.shard_comm, out=out)

    def _make_layout(self, inputs: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Per gathered parameter, its pieces of one rank's all-gather input: (dtype, trailing
        shape, byte offset, padded bytes); a plain parameter's one piece is its padded shard.
        Extension inputs' trailing shapes come from global shapes."""
        pieces, offset = [], 0
        for i, p in enumerate(self.gathered):
            kinds = [(t.dtype, tuple(t.shape[1:])) for t in inputs[i]] if p.extension else [(p.param_dtype, None)]
            own = []
            for dtype, rest in kinds:
                numel = p.shard_numel if rest is None else p.pad_rows * prod(rest)
                nbytes = _align(numel * dtype.itemsize)
                own.append((dtype, rest, offset, nbytes))
                offset += nbytes
            pieces.append(own)
        self._pieces, self._gather_nbytes = pieces, offset

    def finish_unshard(self) -> None:
        """Wait for the all-gather and put the unsharded parameters on the modules."""
        if self.is_unsharded:
            return
        self.start_unshard()
        out = self._gather.wait()
        self._gather = None
        if self.unsharded_flat is None:
            self.unsharded_flat = accounting.track_buffer(
                torch.empty(self.unsharded_nbytes, dtype=torch.uint8, device=self.device))
        elif self.unsharded_flat.untyped_storage().nbytes() == 0:
            self.unsharded_flat.untyped_storage().resize_(self.unsharded_nbytes)
            accounting.track_resize(self.unsharded_flat)
        existing = [p.unsharded for p in self.params if p.unsharded is not None]
        versions = [t._version for t in existing]
        with torch.no_grad():
            if out is not None:
                rows_of_ranks = out.view(self.info.shard_size, self._gather_nbytes)
                for i, p in enumerate(self.gathered):
                    if p.extension:
                        gathered = [rows_of_ranks[:, off:off + n].view(dtype)[:, :p.pad_rows * prod(rest)]
                                    for dtype, rest, off, n in self._pieces[i]]
                        self._post_all_gather(i, p, gathered)
                        continue
                    _, _, off, n = self._pieces[i][0]
                    dst = self._unsharded_view(p)
                    _from_ranks(dst, rows_of_ranks[:, off:off + n].view(p.param_dtype), p)
                    if p.unsharded is None:
                        p.unsharded = p.wrap_unsharded(dst.view(p.shape))
            for p in self.params:
                if p.replicated:
                    self._unshard_replica(p)
        torch._C._autograd._unsafe_set_version_counter(existing, versions)
        self.is_unsharded = True
        for p in self.params:
            p.install(p.unsharded)

    def _post_all_gather(self, i: int, p: FSDPParam, gathered: list[torch.Tensor]) -> None:
        world = self.info.shard_size
        outputs = tuple(g.reshape(world * p.pad_rows, *rest)[:p.rows]
                        for g, (_, rest, _, _) in zip(gathered, self._pieces[i]))
        for t, nbytes in zip(p.inner, p.inner_nbytes):
            if t.untyped_storage().nbytes() == 0:
                t.untyped_storage().resize_(nbytes)
        fresh = p.unsharded is None
        p.post_all_gather(outputs, self._meta.pop(i))
        if fresh:
            p.inner_nbytes = [t.untyped_storage().nbytes() for t in p.inner]

    def _unsharded_view(self, p: FSDPParam) -> torch.Tensor:
        """``p``'s unsharded tensor in ``unsharded_flat``, seen as (pre, rows, post)."""
        nbytes = p.numel * p.param_dtype.itemsize
        flat = self.unsharded_flat[p.unsharded_offset:p.unsharded_offset + nbytes]
        return flat.view(p.param_dtype).view(p.pre, p.rows, p.post)

    @staticmethod
    def _unshard_replica(p: FSDPParam) -> None:
        """A replicated parameter's unsharded form: its local block itself (a cast copy
        under ``param_dtype``), rebuilt only when the local block was replaced."""
        local = p.sharded._local_tensor
        if p.unsharded is None or p.replica_src is not local:
            p.replica_src = local
            p.unsharded = p.wrap_unsharded(local if local.dtype == p.param_dtype else local.to(p.param_dtype))
        elif local.dtype != p.param_dtype:  # replicated parameters are TP DTensors
            p.unsharded._local_tensor.copy_(local)

    def reshard(self) -> None:
        """Put the sharded parameters back and free the unsharded storage."""
        if self._gather is not None:  # a prefetch nobody used
            self._gather.wait()
            self._gather = None
            self._meta.clear()
        if not self.is_unsharded:
            return
        for p in self.params:
            p.install(p.sharded)
            for t in p.inner:
                t.untyped_storage().resize_(0)
        if self.unsharded_flat is not None:
            self.unsharded_flat.untyped_storage().resize_(0)
            accounting.track_resize(self.unsharded_flat)
        self.is_unsharded = False

    # --- gradients -------------------------------------------------------------------------------
    def post_backward(self) -> None:
        """Start reduce-scattering the unsharded gradients (or keep them while gradient
        sync is off); reshard if ``reshard_after_backward``."""
        params = [p for p in self.params if p.requires_grad and p.unsharded is not None and p.unsharded.grad is not None]
        grads = []
        for p in params:
            g = p.unsharded.grad
            p.unsharded.grad = None
            if isinstance(g, DTensor):
                if g.placements != p.tp_spec.placements:
                    g = g.redistribute(p.tp_spec.mesh, p.tp_spec.placements)
                g = g._local_tensor
            grads.append(g if p.grad_acc is None else g + p.grad_acc)
            p.grad_acc = None
        if not self.requires_gradient_sync:
            for p, g in zip(params, grads):
                p.grad_acc = g
        elif params:
            self._start_reduce(params, grads)
        if self.reshard_after_backward:
            self.reshard()

    def _start_reduce(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        """One reduce-scatter for the sharded parameters' gradients, one all-reduce for
        the replicated ones'."""
        world = self.info.shard_size
        sharded = [(p, g) for p, g in zip(params, grads) if not p.replicated]
        replicated = [(p, g) for p, g in zip(params, grads) if p.replicated]
        scatter = reduce = None
        with torch.no_grad():
            if sharded:
                total = sum(p.shard_numel for p, _ in sharded)
                send = accounting.track_buffer(torch.empty(world * total, dtype=self.reduce_dtype, device=grads[0].device))
                per_rank, offset = send.view(world, total), 0
                for p, g in sharded:
                    _to_ranks(per_rank[:, offset:offset + p.shard_numel], g.reshape(p.pre, p.rows, p.post), p)
                    offset += p.shard_numel
                scatter = ireduce_scatter(send, self.info.shard_comm, "sum")
            if replicated:
                flat = torch.cat([g.reshape(-1).to(self.reduce_dtype) for _, g in replicated])
                reduce = iall_reduce(flat, self.info.mesh.comm_for(tuple(range(self.info.mesh.ndim))), "sum", inplace=True)
        self._pending = (scatter, [p for p, _ in sharded], reduce, [p for p, _ in replicated])

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter (and HSDP's all-reduce); add the averaged shards to
        the sharded parameters' ``.grad``."""
        if self._pending is None:
            return
        scatter, sharded, reduce, replicated = self._pending
        self._pending = None
        pieces: list[tuple[FSDPParam, torch.Tensor]] = []
        if scatter is not None:
            out = scatter.wait()
            if self.info.replicate_comm is not None:
                iall_reduce(out, self.info.replicate_comm, "sum", inplace=True).wait()
            offset = 0
            for p in sharded:
                pieces.append((p, out[offset:offset + p.local_numel].view(p.local_shape)))
                offset += p.shard_numel
        if reduce is not None:
            flat = reduce.wait()
            for p, part in zip(replicated, flat.split([p.numel for p in replicated])):
                pieces.append((p, part.view(p.local_shape)))
        for p, piece in pieces:
            local = piece.div_(self.info.dp_size).to(p.orig_dtype)
            if p.sharded.grad is None:
                p.sharded.grad = DTensor(local, p.spec, requires_grad=False)
            else:
                p.sharded.grad._local_tensor.add_(local)

    @property
    def reducing(self) -> bool:
        """A reduce-scatter has started and ``finish_reduce`` has not run yet."""
        return self._pending is not None

    @property
    def has_pending_grads(self) -> bool:
        """Some unsharded gradients arrived that ``post_backward`` has not taken yet."""
        return any(p.unsharded is not None and p.unsharded.grad is not None for p in self.params)


class _NoGather:
    """The all-gather of a group with nothing to gather (only replicated parameters)."""

    @staticmethod
    def wait() -> None:
        return None


_NO_GATHER = _NoGather()


def _to_ranks(dst: torch.Tensor, src: torch.Tensor, p: FSDPParam) -> None:
    """Copy ``src`` (pre, rows, post) into ``dst`` (world, >= padded piece): row ``r`` gets
    rank r's chunk of dim 1 as a contiguous (pre, its rows, post) block, zero-padded.
    Two strided copies at most: the full chunks together, then the one short chunk."""
    world, (pre, pad, post) = dst.size(0), (p.pre, p.pad_rows, p.post)
    if pad == 0:
        return
    full, rem = divmod(p.rows, pad)
    if full:
        dst[:full, :pre * pad * post].view(full, pre, pad, post).copy_(
            src[:, :full * pad].view(pre, full, pad, post).transpose(0, 1))
    if full < world:
        n = pre * rem * post
        dst[full, :n].view(pre, rem, post).copy_(src[:, full * pad:])
        dst[full, n:].zero_()
        dst[full + 1:].zero_()


def _from_ranks(dst: torch.Tensor, src: torch.Tensor, p: FSDPParam) -> None:
    """The inverse of ``_to_ranks``: rank chunks in ``src`` rows into ``dst`` (pre, rows, post)."""
    pre, pad, post = p.pre, p.pad_rows, p.post
    if pad == 0:
        return
    full, rem = divmod(p.rows, pad)
    if full:
        dst[:, :full * pad].view(pre, full, pad, post).copy_(
            src[:full, :pre * pad * post].view(full, pre, pad, post).transpose(0, 1))
    if rem:
        dst[:, full * pad:].copy_(src[full, :pre * rem * post].view(pre, rem, post))
