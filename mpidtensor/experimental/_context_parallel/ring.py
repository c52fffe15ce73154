"""Ring attention: ``scaled_dot_product_attention`` over a sequence sharded across the
ranks of an MPI communicator, forward and backward.

Each rank keeps its query block; the key/value blocks visit every rank, either passed
around the ring (``rotate_method="alltoall"``: ``cp - 1`` neighbour exchanges, each
started before the computation on the block in hand, tested between pieces of it and
waited for after it) or
gathered at once (``"allgather"``). Partial outputs merge by their log-sum-exp. The
backward visits the blocks again with the global output and log-sum-exp: query gradients
accumulate locally, key/value gradients travel with their blocks back to their owners
(one ``Reduce_scatter`` for ``"allgather"``). See ``layout`` for the sequence layouts and
the causal schedule, ``blocks`` for the kernels, ``exchange`` for the messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.autograd.function import once_differentiable

from . import exchange
from .blocks import (Backend, accumulation_dtype, block_backward, block_forward, choose_backend, mask_dtype,
                     merge)
from .layout import DTYPES, Layout, Plan, agree, block_mask

ROTATE_METHODS = ("alltoall", "allgather")
_KV_TAG, _GRAD_TAG = 7181, 7182  # point-to-point tags of key/value blocks and of their gradients
# A block is computed in up to this many pieces (head ranges) while an exchange is in flight,
# MPI being tested between them: MPICH moves a message only inside MPI calls (measured: a
# 64 KiB-16 MiB exchange whose partner computes for 1 s waits ~1 s; one test by the partner
# early on completes it up to 4 MiB).
PROGRESS_PIECES = 4


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, comm: MPI.Intracomm,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False, load_balanced: bool = True,
                   rotate_method: str = "alltoall") -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's query block on the whole sequence,
    whose key/value blocks are spread over the ranks of ``comm`` (rank order = sequence order).

    ``query``/``key``/``value`` are [B, H, S_local, D] (fewer key/value heads with
    ``enable_gqa``). ``load_balanced``: rank r holds chunks r and 2 * cp - 1 - r of 2 * cp
    equal chunks (the same even length on every rank); otherwise the r-th contiguous run,
    of any length (the ranks agree on the lengths with one small ``Allgather``).
    ``is_causal`` is causal over global positions (query and key/value blocks of one
    length). ``attn_mask`` (bool or additive, no gradient) broadcasts to
    [B, H, S_local, S_global]: this rank's queries, all keys in natural order.
    Dropout is not supported. Collective over ``comm``: errors are raised on every rank.
    """
    _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, rotate_method)
    if comm.size == 1:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    layout = agree(comm, query, key, value, attn_mask, balanced=load_balanced, causal=is_causal,
                   enable_gqa=enable_gqa)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    sample_mask = None if attn_mask is None else attn_mask[..., :key.shape[2]]
    backend = choose_backend(query, key, value, sample_mask, is_causal, scale, enable_gqa)
    ring = _Ring(comm, layout, backend, scale, rotate_method)
    return _RingAttention.apply(query, key, value, attn_mask, ring)


def ring_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, comm: MPI.Intracomm,
                 is_causal: bool, scale: float | None, load_balanced: bool,
                 rotate_method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of :func:`ring_attention` outside autograd (no mask, no dropout): the
    output and the global log-sum-exp ``[B, H, S_local]``, which :func:`ring_backward`
    takes back. For a caller that owns the autograd graph (the DTensor dispatcher of
    ``_enable_context_parallel_dispatcher``, below the aten op and its backward)."""
    ring = _ring(comm, query, key, value, is_causal, scale, load_balanced, rotate_method)
    return _forward(ring, query, key, value, None)


def ring_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, *, comm: MPI.Intracomm, is_causal: bool,
                  scale: float | None, load_balanced: bool,
                  rotate_method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients wrt this rank's query, key and value blocks, from :func:`ring_forward`'s
    output and log-sum-exp."""
    ring = _ring(comm, query, key, value, is_causal, scale, load_balanced, rotate_method)
    return _backward(ring, grad_out, query, key, value, out, lse, None)


def _ring(comm, query, key, value, is_causal, scale, load_balanced, rotate_method) -> _Ring:
    """The agreed layout and the kernel of one call (one small ``Allgather``)."""
    _check_arguments(query, key, value, None, 0.0, is_causal, rotate_method)
    enable_gqa = query.shape[1] != key.shape[1]
    layout = agree(comm, query, key, value, None, balanced=load_balanced, causal=is_causal, enable_gqa=enable_gqa)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = choose_backend(query, key, value, None, is_causal, scale, enable_gqa)
    return _Ring(comm, layout, backend, scale, rotate_method)


def _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, rotate_method) -> None:
    """Checks on facts every rank shares (flags, ranks of tensors, dtypes)."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p}: dropout is not supported under context parallelism")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True cannot be used together")
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method must be one of {ROTATE_METHODS}, got {rotate_method!r}")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError("ring attention takes [batch, heads, sequence, head dim] query, key and value, got "
                         f"{query.ndim}-D, {key.ndim}-D and {value.ndim}-D")
    if query.dtype not in DTYPES:
        raise TypeError(f"ring attention takes floating point tensors, got {query.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")


@dataclass(frozen=True)
class _Ring:
    """Everything one call needs besides its tensors."""

    comm: MPI.Intracomm
    layout: Layout
    backend: Backend
    scale: float
    rotate_method: str

    def kv_shapes(self, key: torch.Tensor, value: torch.Tensor, source: int) -> list[tuple[int, ...]]:
        """Shapes of rank ``source``'s key and value blocks."""
        length = self.layout.kv_lens[source]
        return [(*key.shape[:2], length, key.shape[3]), (*value.shape[:2], length, value.shape[3])]

    def kv_numels(self, key: torch.Tensor, value: torch.Tensor) -> list[int]:
        """Elements of each rank's packed key/value block."""
        return [sum(prod(s) for s in self.kv_shapes(key, value, r)) for r in range(self.layout.cp)]

    def kv_blocks(self, key: torch.Tensor, value: torch.Tensor) -> Iterator[_Block]:
        """Every rank's key/value block, this rank's first.

        Ring rotation: the exchange bringing the next block starts before a block is yielded
        (as its ``pending``, for the caller to test during its computation) and is waited for
        when the caller asks for the next block."""
        rank, cp = self.layout.rank, self.layout.cp
        numels = self.kv_numels(key, value)
        if self.rotate_method == "allgather":
            flats = exchange.gather(exchange.pack([key, value]), numels, self.comm)
            for step in range(cp):
                source = (rank - step) % cp
                yield _Block(source, *exchange.unpack(flats[source], self.kv_shapes(key, value, source), key), None)
            return
        flat = exchange.pack([key, value])
        for step in range(cp):
            source = (rank - step) % cp
            pending = exchange.shift(flat, numels[(source - 1) % cp], self.comm, _KV_TAG,
                                     f"key/value block, ring step {step + 1} of {cp - 1}") if step < cp - 1 else None
            if step == 0:
                yield _Block(source, key, value, pending)
            else:
                yield _Block(source, *exchange.unpack(flat, self.kv_shapes(key, value, source), key), pending)
            if pending is not None:
                flat = pending.wait()


class _Block(NamedTuple):
    """One rank's key/value block and the exchange in flight while it is computed on."""

    source: int
    key: torch.Tensor
    value: torch.Tensor
    pending: exchange.Shift | None


class _RingAttention(torch.autograd.Function):
    """Differentiable wrt query, key and value; the mask is a constant."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, ring: _Ring):
        out, lse = _forward(ring, query, key, value, attn_mask)
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        ctx.ring = ring
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        grad_query, grad_key, grad_value = _backward(ctx.ring, grad_out, query, key, value, out, lse, attn_mask)
        return grad_query, grad_key, grad_value, None, None


def _forward(ring: _Ring, query, key, value, attn_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (as plain sdpa lays it out) and the finite global log-sum-exp of each row."""
    layout, dtype = ring.layout, accumulation_dtype(query.dtype)
    batch, heads, length, _ = query.shape
    out = torch.zeros((batch, heads, length, value.shape[3]), dtype=dtype, device=query.device)
    lse = torch.full((batch, heads, length), float("-inf"), dtype=dtype, device=query.device)
    for block in ring.kv_blocks(key, value):
        plan = layout.plan(block.source)
        if plan is None:
            continue
        mask = block_mask(attn_mask, layout, block.source, plan, mask_dtype(ring.backend, query.dtype))
        for piece in _pieces(query, key, plan, [block.pending]):
            heads, rows, kv_heads = piece.q_heads, piece.q_rows, piece.kv_heads
            block_out, block_lse = block_forward(
                ring.backend, query[:, heads, rows], block.key[:, kv_heads, plan.kv_rows],
                block.value[:, kv_heads, plan.kv_rows], piece.mask(mask), plan.causal, ring.scale)
            merge(out[:, heads, rows], lse[:, heads, rows], block_out, block_lse)
            _test(block.pending)
    result = _output_like(query, out.shape, ring.backend).copy_(out)
    return result, lse.masked_fill_(torch.isneginf(lse), 0.0)


def _backward(ring: _Ring, grad_out, query, key, value, out, lse, attn_mask):
    """Gradients wrt this rank's query, key and value blocks (their dtypes and layouts)."""
    layout, dtype = ring.layout, accumulation_dtype(query.dtype)
    rank, cp = layout.rank, layout.cp
    numels = ring.kv_numels(key, value)
    offsets = [sum(numels[:r]) for r in range(cp)]
    ring_mode = ring.rotate_method == "alltoall"
    grad_query = torch.zeros(query.shape, dtype=dtype, device=query.device)
    # all blocks' key/value gradients back to back ("allgather"), or the travelling one's
    grads_all = None if ring_mode else torch.zeros(sum(numels), dtype=dtype, device=query.device)
    like = grad_query  # the accumulation dtype on the compute device
    travelling = None  # the key/value gradients of the previous step's block, on their way
    for step, block in enumerate(ring.kv_blocks(key, value)):
        plan = layout.plan(block.source)
        pieces = []  # (key/value heads, key grad, value grad) of each piece of this block
        if plan is not None:
            mask = block_mask(attn_mask, layout, block.source, plan, mask_dtype(ring.backend, query.dtype))
            for piece in _pieces(query, key, plan, [block.pending, travelling]):
                heads, rows, kv_heads = piece.q_heads, piece.q_rows, piece.kv_heads
                grads = block_backward(
                    ring.backend, grad_out[:, heads, rows], query[:, heads, rows],
                    block.key[:, kv_heads, plan.kv_rows], block.value[:, kv_heads, plan.kv_rows],
                    out[:, heads, rows], lse[:, heads, rows].contiguous(), piece.mask(mask), plan.causal, ring.scale)
                grad_query[:, heads, rows].add_(grads[0])
                pieces.append((kv_heads, grads[1], grads[2]))
                _test(block.pending, travelling)
        if not ring_mode:
            accumulator = grads_all[offsets[block.source]:offsets[block.source] + numels[block.source]]
        elif step == 0:
            accumulator = torch.zeros(numels[block.source], dtype=dtype, device=query.device)
        else:
            accumulator = exchange.unpack(travelling.wait(), [(numels[block.source],)], like)[0]
        grad_key, grad_value = exchange.unpack(accumulator, ring.kv_shapes(key, value, block.source), like)
        for kv_heads, key_grad, value_grad in pieces:
            grad_key[:, kv_heads, plan.kv_rows].add_(key_grad)
            grad_value[:, kv_heads, plan.kv_rows].add_(value_grad)
        if ring_mode:
            travelling = exchange.shift(accumulator, numels[(block.source - 1) % cp], ring.comm, _GRAD_TAG,
                                         f"key/value gradients, ring step {step + 1} of {cp}")
    own = travelling.wait() if ring_mode else exchange.reduce_scatter(grads_all, numels, ring.comm)
    grad_key, grad_value = exchange.unpack(own, ring.kv_shapes(key, value, rank), like)
    return (torch.empty_like(query).copy_(grad_query), torch.empty_like(key).copy_(grad_key),
            torch.empty_like(value).copy_(grad_value))


class _Piece(NamedTuple):
    """Part of a planned block: query heads and rows, and the key/value heads they use."""

    q_heads: slice
    q_rows: slice  # local query rows
    kv_heads: slice
    mask_rows: slice  # the same rows in the block's mask (which starts at the plan's first row)

    def mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """This piece of a block mask (heads that broadcast stay whole)."""
        if mask is None:
            return None
        return (mask if mask.shape[1] == 1 else mask[:, self.q_heads])[:, :, self.mask_rows]


def _pieces(query: torch.Tensor, key: torch.Tensor, plan: Plan, shifts: list[exchange.Shift | None]) -> list[_Piece]:
    """The pieces to compute a planned block in: up to ``PROGRESS_PIECES`` while an exchange
    is in flight (MPI is tested between them), else one. Pieces are head ranges where there
    are enough key/value heads, else query row ranges (not on a causal block: its mask is
    aligned to the block's first row)."""
    kv_heads, start, stop = key.shape[1], plan.q_rows.start, plan.q_rows.stop
    groups = query.shape[1] // kv_heads
    count = PROGRESS_PIECES if any(s is not None for s in shifts) else 1
    every_row, mask_rows = slice(start, stop), slice(0, stop - start)
    if kv_heads >= count or plan.causal:
        count = min(count, kv_heads)
        bounds = [kv_heads * i // count for i in range(count + 1)]
        return [_Piece(slice(low * groups, high * groups), every_row, slice(low, high), mask_rows)
                for low, high in zip(bounds, bounds[1:])]
    bounds = [(stop - start) * i // count for i in range(count + 1)]
    return [_Piece(slice(0, query.shape[1]), slice(start + low, start + high), slice(0, kv_heads), slice(low, high))
            for low, high in zip(bounds, bounds[1:]) if high > low]


def _test(*shifts: exchange.Shift | None) -> None:
    """Let MPI progress the exchanges in flight."""
    for pending in shifts:
        if pending is not None:
            pending.test()


def _output_like(query: torch.Tensor, shape: torch.Size, backend: Backend) -> torch.Tensor:
    """An empty output laid out as plain sdpa lays out its result for ``backend``: the
    query's dim order (CPU flash), batch-sequence-heads (CUDA kernels) or contiguous (math)."""
    if backend == "math":
        return torch.empty(shape, dtype=query.dtype, device=query.device)
    if backend == "cpu_flash":  # flash needs the value head dim to be the query's: shapes agree
        return torch.empty_like(query)
    batch, heads, length, dim = shape
    return torch.empty((batch, length, heads, dim), dtype=query.dtype, device=query.device).transpose(1, 2)

