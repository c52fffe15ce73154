"""Where one FSDP group's tensors lie in its flat buffers, and the copies in and out of them.

All sizes and offsets come from global shapes, so every rank agrees on them.

* ``shard_flat``: this rank's shards of the plain parameters back to back, each
  contiguous in its local shape, padded to ``ceil(rows / world)`` along its shard dim
  (``rows``: that dim's size) and 16-byte aligned (``place``). The sharded DTensors' local
  tensors are views into it (``shard_slot``), so without a dtype cast it *is* the
  all-gather's send buffer (no copy). With ``param_dtype`` or an all-gather extension, a
  send buffer is packed instead (``pack_send``).
* One rank's all-gather input is a list of ``Piece``s per gathered parameter
  (``gather_pieces``): a plain parameter's padded shard, or each of an extension's
  ``fsdp_pre_all_gather`` inputs, gathered along dim 0 (padded to the shard's padded rows
  when the parameter is unevenly sharded; an evenly sharded one's inputs may have any
  dim-0 size, the same on all ranks, as torchao's NF4 weight's flat data).
* ``unsharded_flat``, where each unsharded parameter is a contiguous view
  (``unsharded_view``). The all-gather's (world, bytes) rows are copied into it: for plain
  parameters split evenly along dim 0 one ``split_with_sizes_copy`` for the whole group
  (``split_sizes``), otherwise one ``_foreach_copy_`` of strided views (``FromRanks``: per
  parameter its full pieces and the one short piece, ``chunk_layout``). An extension's
  gathered rows (padding dropped) go into its persistent outputs (``unpack_pieces``).
* ``reshard_after_forward=k``: each rank keeps its ``world / k`` rows of the all-gather
  buffer, rebuilt from the unsharded parameters (``keep_rows``).
* gradients: packed into one buffer of (world, padded shard) rows with the same layout
  (``pack_ranks``: one ``torch.cat`` when every gradient splits evenly along dim 0) for
  the reduce-scatter.
"""
from __future__ import annotations

import functools
from itertools import accumulate, repeat
from math import prod
from operator import attrgetter
from typing import Iterable, NamedTuple

import torch

from ..runtime import caches
from ..tensor.layout import chunk_span
from .param import FSDPParam

ALIGN = 16  # bytes: every segment may be viewed as any dtype
_pre_of, _dtype_of, _shard_numel_of = attrgetter("pre"), attrgetter("dtype"), attrgetter("shard_numel")
_reshape, _ONE = torch.Tensor.reshape, {1}


def align(nbytes: int) -> int:
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


# --- the parameters' flat buffers -------------------------------------------------------------
def place(gathered: list[FSDPParam]) -> tuple[int, int]:
    """Give each plain parameter of ``gathered`` its byte offsets in ``shard_flat`` and
    ``unsharded_flat``; return the two buffers' sizes in bytes. (An extension parameter
    keeps its own shard and outputs: it takes no bytes in either.)"""
    shard_total = unsharded_total = 0
    for p in gathered:
        p.shard_offset, p.unsharded_offset = shard_total, unsharded_total
        if not p.extension:
            shard_total += align(p.shard_numel * p.orig_dtype.itemsize)
            unsharded_total += align(p.numel * p.param_dtype.itemsize)
    return shard_total, unsharded_total


def shard_slot(shard_flat: torch.Tensor, p: FSDPParam) -> torch.Tensor:
    """``p``'s local shard inside ``shard_flat``."""
    nbytes = p.local_numel * p.orig_dtype.itemsize
    return shard_flat[p.shard_offset:p.shard_offset + nbytes].view(p.orig_dtype).view(p.local_shape)


def unsharded_view(unsharded_flat: torch.Tensor, p: FSDPParam) -> torch.Tensor:
    """``p``'s unsharded tensor in ``unsharded_flat``, seen as (pre, rows, post)."""
    nbytes = p.numel * p.param_dtype.itemsize
    flat = unsharded_flat[p.unsharded_offset:p.unsharded_offset + nbytes]
    return flat.view(p.param_dtype).view(p.pre, p.rows, p.post)


# --- the all-gather input ---------------------------------------------------------------------
def gather_pieces(gathered: list[FSDPParam], inputs: dict[int, tuple[torch.Tensor, ...]],
                  rows: dict[int, list[tuple[int, int]]]) -> tuple[list[list[Piece]], int]:
    """Per gathered parameter, its pieces of one rank's all-gather input, and the input's
    size in bytes. ``inputs``/``rows``: the extension parameters' (by index in
    ``gathered``) ``fsdp_pre_all_gather`` inputs and, per input, (gathered rows, rows per rank)
    agreed from every rank's shapes."""
    pieces, offset = [], 0
    for i, p in enumerate(gathered):
        if p.extension:
            kinds = [(t.dtype, tuple(t.shape[1:]), *r) for t, r in zip(inputs[i], rows[i])]
        else:
            kinds = [(p.param_dtype, None, p.rows, p.pad_rows)]
        own = []
        for dtype, rest, gathered_rows, pad in kinds:
            numel = p.shard_numel if rest is None else pad * prod(rest)
            nbytes = align(numel * dtype.itemsize)
            own.append(Piece(dtype, rest, offset, nbytes, gathered_rows, pad))
            offset += nbytes
        pieces.append(own)
    return pieces, offset


def split_sizes(gathered: list[FSDPParam], pieces: list[list[Piece]], world: int) -> list[int] | None:
    """The byte widths for one ``split_with_sizes_copy`` of the gathered (world, bytes) rows
    into the unsharded parameters, if every parameter is plain, split evenly along dim 0
    and has no alignment gap (column block i is then parameter i, seen as (world, piece));
    else ``None``."""
    if all(not p.extension and p.pre == 1 and p.rows == p.pad_rows * world
           and own[0].nbytes == p.shard_numel * p.param_dtype.itemsize for p, own in zip(gathered, pieces)):
        return [own[0].nbytes for own in pieces]
    return None


def placed_pieces(gathered: list[FSDPParam],
                  world: int) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]] | None:
    """Where the all-gather of plain parameters sharded along dim 0 in their own dtype moves
    bytes without a copy out (``comm.placed``): this rank's (offset, length) byte pieces of
    ``shard_flat`` (each shard's rows, padding left out) and, per source rank, the pieces
    of ``unsharded_flat`` its rows fill (``torch.chunk``'s split, so uneven and empty shards
    fit); ``None`` for any other group. From global shapes only: every rank agrees."""
    if any(p.extension or p.pre != 1 or p.param_dtype != p.orig_dtype for p in gathered):
        return None
    send = [(p.shard_offset, p.local_numel * p.orig_dtype.itemsize) for p in gathered]
    recv = []
    for source in range(world):
        pieces = []
        for p in gathered:
            row_bytes = p.post * p.orig_dtype.itemsize
            first, count = chunk_span(p.rows, world, source)
            pieces.append((p.unsharded_offset + first * row_bytes, count * row_bytes))
        recv.append(pieces)
    return send, recv


def split_views(unsharded_flat: torch.Tensor, gathered: list[FSDPParam], sizes: list[int],
                world: int) -> list[torch.Tensor]:
    """The unsharded parameters as (world, piece) byte views of ``unsharded_flat``, the
    outputs of the ``split_sizes`` copy."""
    return [unsharded_flat[p.unsharded_offset:p.unsharded_offset + world * n].view(world, n)
            for p, n in zip(gathered, sizes)]


def pack_send(send: torch.Tensor, gathered: list[FSDPParam], pieces: list[list[Piece]],
              inputs: dict[int, tuple[torch.Tensor, ...]]) -> None:
    """Fill the all-gather's send buffer: each plain shard cast to ``param_dtype``, each
    extension input, at its piece's offset."""
    for i, p in enumerate(gathered):
        if p.extension:
            for t, piece in zip(inputs[i], pieces[i]):
                nbytes = t.numel() * piece.dtype.itemsize
                send[piece.offset:piece.offset + nbytes].view(piece.dtype).view(t.shape).copy_(t)
        else:
            offset, nbytes = pieces[i][0].offset, p.local_numel * p.param_dtype.itemsize
            send[offset:offset + nbytes].view(p.param_dtype).view(p.local_shape).copy_(p.sharded._local_tensor)


class FromRanks:
    """The copy of the plain parameters' gathered chunks (padding dropped) into
    ``unsharded_flat`` as one ``_foreach_copy_`` of strided views (``chunk_layout``): the
    views into ``unsharded_flat`` made once (a view follows its storage through the
    resizes), those of the all-gather buffer (a new one every time) from kept strides."""

    def __init__(self, unsharded_flat: torch.Tensor, gathered: list[FSDPParam], pieces: list[list[Piece]],
                 nbytes: int) -> None:
        self.unsharded_flat = unsharded_flat
        dsts: dict[torch.dtype, list[torch.Tensor]] = {}
        places: dict[torch.dtype, list[tuple[tuple, tuple, int]]] = {}  # per dtype: (size, stride, offset)
        for i, p in enumerate(gathered):
            if p.extension:
                continue
            dtype, n = p.param_dtype, p.param_dtype.itemsize
            whole = unsharded_flat.view(dtype)
            at, col = whole.storage_offset() + p.unsharded_offset // n, pieces[i][0].offset // n
            for size, stride, offset, rank_stride, rank_offset in chunk_layout((p.pre, p.rows, p.post), p.pad_rows,
                                                                               nbytes // n):
                dsts.setdefault(dtype, []).append(whole.as_strided(size, stride, at + offset))
                places.setdefault(dtype, []).append((size, rank_stride, col + rank_offset))
        self.dsts = [t for ts in dsts.values() for t in ts]  # in the order of ``places``' dtypes
        self.places = [(dtype, *zip(*where)) for dtype, where in places.items()]  # (dtype, sizes, strides, offsets)

    def copy(self, rows_of_ranks: torch.Tensor) -> None:
        """Copy from the all-gather's (world, bytes) rows (one view per chunk: a step makes dozens)."""
        srcs = []
        for dtype, sizes, strides, offsets in self.places:  # (C-level maps: no Python call per view)
            ranks = rows_of_ranks.view(dtype)
            srcs += map(ranks.as_strided, sizes, strides, map(ranks.storage_offset().__add__, offsets))
        if self.dsts:
            torch._foreach_copy_(self.dsts, srcs)


def unpack_pieces(outputs: tuple[torch.Tensor, ...], pieces: list[Piece], rows_of_ranks: torch.Tensor) -> None:
    """Copy an extension parameter's gathered pieces (padding dropped) into its outputs."""
    for out, piece in zip(outputs, pieces):
        parts, places = chunk_views((1, piece.rows, prod(piece.rest)), piece.pad, out,
                                    rows_of_ranks.view(piece.dtype), piece.offset // piece.dtype.itemsize)
        if parts:
            torch._foreach_copy_(parts, places)


def keep_rows(kept: torch.Tensor, gathered: list[FSDPParam], pieces: list[list[Piece]],
              unsharded_flat: torch.Tensor, first: int) -> None:
    """Fill ``kept`` (n, input bytes) with the all-gather input rows of ranks ``first`` to
    ``first + n - 1``, rebuilt from the unsharded parameters (and extensions' outputs)."""
    for i, p in enumerate(gathered):
        if p.extension:
            sources = [(out.view(1, piece.rows, prod(piece.rest)), piece) for out, piece in zip(p.outputs, pieces[i])]
        else:
            sources = [(unsharded_view(unsharded_flat, p), pieces[i][0])]
        for src, piece in sources:
            _rank_rows(kept[:, piece.offset:piece.offset + piece.nbytes].view(piece.dtype), src, piece.pad, first)


# --- the gradients' reduce-scatter input ------------------------------------------------------
def cat_rows(per_rank: torch.Tensor, tensors: Iterable[torch.Tensor], shapes: Iterable[tuple[int, int]]) -> bool:
    """:func:`pack_ranks`' common case: gradients split evenly along dim 0, each seen as its
    ``shapes`` entry (world, piece), packed by one ``torch.cat`` along dim 1 into ``per_rank``
    where all are in its dtype; False, with nothing written, where one is not. (C-level maps:
    no Python call per gradient; ``collectives.GroupScatter`` calls it with shapes decided once.)"""
    tensors = list(tensors)
    if set(map(_dtype_of, tensors)) != {per_rank.dtype}:
        return False
    torch.cat(list(map(_reshape, tensors, shapes)), dim=1, out=per_rank)
    return True


def pack_ranks(per_rank: torch.Tensor, grads: list[tuple[FSDPParam, torch.Tensor]]) -> None:
    """Lay ``grads`` out for the reduce-scatter: row ``r`` of ``per_rank`` (world, total) holds
    rank r's padded piece of each gradient, back to back, zero-padded. Gradients split evenly
    along dim 0 are the common case: each is then its ranks' pieces already, seen as (world,
    piece), and one ``torch.cat`` along dim 1 packs them all; otherwise one ``_foreach_copy_``
    of every gradient's chunks (``chunk_layout``) and one ``_foreach_zero_`` of the padding."""
    world = per_rank.size(0)
    if all([p.rows == p.pad_rows * world for p, _ in grads]):  # (lists, not generators: one call, not one per item)
        params, tensors = zip(*grads)
        if set(map(_pre_of, params)) == _ONE and cat_rows(per_rank, tensors,
                                                          zip(repeat(world), map(_shard_numel_of, params))):
            return
        # sharded on a later dim (FSDP x TP's dim-1 shards) or cast: gradient i seen as (pre, world, pad, post)
        # is its ranks' pieces; one _foreach_copy_ into the rows, two views per gradient
        row, at = per_rank.stride(0), per_rank.storage_offset()
        cols = list(accumulate([p.shard_numel for p, _ in grads], initial=at))
        dsts = [per_rank.as_strided((p.pre, world, p.pad_rows, p.post), (p.pad_rows * p.post, row, p.post, 1), col)
                for (p, _), col in zip(grads, cols)]
        torch._foreach_copy_(dsts, [g.reshape(p.pre, world, p.pad_rows, p.post) for p, g in grads])
        return
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    pads: list[torch.Tensor] = []
    col = 0
    for p, g in grads:
        parts, places = chunk_views((p.pre, p.rows, p.post), p.pad_rows, g.contiguous(), per_rank, col)
        srcs += parts
        dsts += places
        pads += _padding(p, per_rank, col)
        col += p.shard_numel
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    if pads:
        torch._foreach_zero_(pads)


# --- rank chunks --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def chunk_layout(shape: tuple[int, int, int], pad: int, row: int) -> tuple[tuple, ...]:
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


caches.on_clear("fsdp.chunk_layouts", chunk_layout.cache_clear, holds_meshes=False)


def chunk_views(shape: tuple[int, int, int], pad: int, whole: torch.Tensor, ranks: torch.Tensor,
                col: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ``chunk_layout`` view pairs of contiguous ``whole`` (seen as ``shape``) and of
    its chunks in ``ranks`` (world, row) from column ``col``, to copy with one ``_foreach_copy_``."""
    at, base = whole.storage_offset(), ranks.storage_offset() + col
    parts, places = [], []
    for size, stride, offset, rank_stride, rank_offset in chunk_layout(shape, pad, ranks.stride(0)):
        parts.append(whole.as_strided(size, stride, at + offset))
        places.append(ranks.as_strided(size, rank_stride, base + rank_offset))
    return parts, places


def _padding(p: FSDPParam, ranks: torch.Tensor, col: int) -> list[torch.Tensor]:
    """The padding of ``p``'s chunks in ``ranks`` (``chunk_layout``): the short chunk's
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
    """Rows ``first, first + 1, ...`` of ``chunk_layout``'s layout (one per row of ``dst``),
    built from ``src`` (pre, rows, post): those ranks' chunks, zero-padded."""
    pre, rows, post = src.shape
    for i in range(dst.size(0)):
        lo, hi = min((first + i) * pad, rows), min((first + i + 1) * pad, rows)
        n = pre * (hi - lo) * post
        dst[i, :n].view(pre, hi - lo, post).copy_(src[:, lo:hi])
        dst[i, n:].zero_()
