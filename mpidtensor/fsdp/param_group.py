"""The parameters of one ``fully_shard`` call, communicated together.

Buffers (all sizes from global shapes, so every rank agrees):

* ``shard_flat``: this rank's shards of the plain parameters back to back, each padded
  to ``ceil(dim0 / world)`` rows and 16-byte aligned. The sharded DTensors' local
  tensors are views into it, so without a dtype cast it *is* the all-gather's send
  buffer (no copy). With ``param_dtype`` or an all-gather extension, a send buffer is
  packed instead.
* the all-gather output (one ``Iallgather``: every rank's send buffer in rank order),
  copied once into ``unsharded_flat``, where each unsharded parameter is a view of
  ``world * padded rows``. Resharding frees that storage (``resize_(0)``); the next
  all-gather refills the same tensors, so autograd's saved references stay valid.
* gradients: packed into one buffer in ``reduce_dtype`` with the same padded layout,
  one ``Ireduce_scatter`` (then an all-reduce over the replicate dim for HSDP) and a
  division by the data-parallel size; the sharded ``.grad``s are views of the result.
"""
from __future__ import annotations

from math import prod

import torch

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
        self.direct = all(not p.extension and p.param_dtype == p.orig_dtype for p in params)
        world = info.shard_size
        shard_total = unsharded_total = 0
        for p in params:
            p.shard_offset, p.unsharded_offset = shard_total, unsharded_total
            if not p.extension:
                shard_total += _align(p.pad_rows * p.row_numel * p.orig_dtype.itemsize)
                unsharded_total += _align(world * p.pad_rows * p.row_numel * p.param_dtype.itemsize)
        self.unsharded_nbytes = unsharded_total
        self.device = params[0].initial_local.device
        self.shard_flat = torch.zeros(shard_total, dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for p in params:
                local = p.initial_local if p.extension else self._slot(p).copy_(p.initial_local)
                p.make_sharded(local)
                p.initial_local = None
        self.unsharded_flat: torch.Tensor | None = None
        self.is_unsharded = False
        self._pieces: list[list[tuple[torch.dtype, tuple[int, ...], int, int]]] | None = None
        self._gather_nbytes = 0
        self._gather: Handle | None = None
        self._meta: dict[int, object] = {}
        self._pending: tuple[Handle, list[FSDPParam], list[int]] | None = None

    # --- sharded storage -----------------------------------------------------------------------
    def _slot(self, p: FSDPParam) -> torch.Tensor:
        """``p``'s local shard inside ``shard_flat``."""
        nbytes = p.local_rows * p.row_numel * p.orig_dtype.itemsize
        flat = self.shard_flat[p.shard_offset:p.shard_offset + nbytes]
        return flat.view(p.orig_dtype).view(p.local_rows, *p.rest)

    def sync(self) -> None:
        """Make every sharded parameter a view into ``shard_flat`` again, after
        ``load_state_dict(assign=True)``, ``to_empty`` or a moved module replaced it."""
        for p in self.params:
            current = p.current()
            if current is not p.sharded and current is not p.unsharded:
                p.adopt(current)
        plain = [p for p in self.params if not p.extension]
        if not plain:
            return
        device = plain[0].sharded._local_tensor.device
        if device != self.shard_flat.device:
            self.device = device
            self.shard_flat = torch.zeros(self.shard_flat.numel(), dtype=torch.uint8, device=device)
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
        for i, p in enumerate(self.params):
            if p.extension:
                inputs[i], self._meta[i] = p.pre_all_gather(self.info.mesh, self.mp)
        if self._pieces is None:
            self._make_layout(inputs)
        if self.direct:
            send = self.shard_flat
        else:
            send = torch.zeros(self._gather_nbytes, dtype=torch.uint8, device=self.device)
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    tensors = inputs[i] if p.extension else (p.sharded._local_tensor,)
                    for t, (dtype, rest, offset, _) in zip(tensors, self._pieces[i]):
                        nbytes = p.local_rows * prod(rest) * dtype.itemsize
                        send[offset:offset + nbytes].view(dtype).view(p.local_rows, *rest).copy_(t)
        self._gather = iall_gather(send, self.info.shard_comm)

    def _make_layout(self, inputs: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Per parameter, its pieces of one rank's all-gather input: (dtype, trailing shape,
        byte offset, padded bytes). Extension inputs' trailing shapes come from global shapes."""
        pieces, offset = [], 0
        for i, p in enumerate(self.params):
            kinds = [(t.dtype, tuple(t.shape[1:])) for t in inputs[i]] if p.extension else [(p.param_dtype, p.rest)]
            own = []
            for dtype, rest in kinds:
                nbytes = _align(p.pad_rows * prod(rest) * dtype.itemsize)
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
        world = self.info.shard_size
        rows_of_ranks = out.view(world, self._gather_nbytes)
        if self.unsharded_flat is None:
            self.unsharded_flat = torch.empty(self.unsharded_nbytes, dtype=torch.uint8, device=self.device)
        elif self.unsharded_flat.untyped_storage().nbytes() == 0:
            self.unsharded_flat.untyped_storage().resize_(self.unsharded_nbytes)
        existing = [p.unsharded for p in self.params if p.unsharded is not None]
        versions = [t._version for t in existing]
        with torch.no_grad():
            for i, p in enumerate(self.params):
                gathered = [rows_of_ranks[:, off:off + n].view(dtype)[:, :p.pad_rows * prod(rest)]
                            for dtype, rest, off, n in self._pieces[i]]
                if p.extension:
                    self._post_all_gather(i, p, gathered)
                    continue
                dst = self._unsharded_view(p)
                dst.copy_(gathered[0])
                if p.unsharded is None:
                    p.unsharded = p.wrap_unsharded(dst.view(world * p.pad_rows, *p.rest)[:p.rows])
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
        """``p``'s padded unsharded rows in ``unsharded_flat``, one row per rank's piece."""
        world = self.info.shard_size
        nbytes = world * p.pad_rows * p.row_numel * p.param_dtype.itemsize
        flat = self.unsharded_flat[p.unsharded_offset:p.unsharded_offset + nbytes]
        return flat.view(p.param_dtype).view(world, p.pad_rows * p.row_numel)

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
        world = self.info.shard_size
        sizes = [p.pad_rows * p.row_numel for p in params]
        send = torch.empty(world * sum(sizes), dtype=self.reduce_dtype, device=grads[0].device)
        per_rank = send.view(world, sum(sizes))
        offset = 0
        with torch.no_grad():
            for p, g, n in zip(params, grads, sizes):
                dst = per_rank[:, offset:offset + n].view(world, p.pad_rows, p.row_numel)
                _pack_rows(dst, g.reshape(p.rows, p.row_numel))
                offset += n
        self._pending = (ireduce_scatter(send, self.info.shard_comm, "sum"), params, sizes)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter (and HSDP's all-reduce); add the averaged shards to
        the sharded parameters' ``.grad``."""
        if self._pending is None:
            return
        handle, params, sizes = self._pending
        self._pending = None
        out = handle.wait()
        if self.info.replicate_comm is not None:
            iall_reduce(out, self.info.replicate_comm, "sum", inplace=True).wait()
        out /= self.info.dp_size
        offset = 0
        for p, n in zip(params, sizes):
            local = out[offset:offset + p.local_rows * p.row_numel].view(p.local_rows, *p.rest).to(p.orig_dtype)
            offset += n
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


def _pack_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` (rows, row) into ``dst`` (world, pad, row) in row order, zeroing the padding."""
    world, pad, _ = dst.shape
    if pad == 0:
        return
    full, rem = divmod(src.size(0), pad)
    if full:
        dst[:full].copy_(src[:full * pad].view(full, pad, -1))
    if full < world:
        dst[full, :rem].copy_(src[full * pad:])
        dst[full, rem:].zero_()
        dst[full + 1:].zero_()
