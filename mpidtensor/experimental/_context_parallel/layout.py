"""Where each rank's sequence block sits in the global sequence, and which part of a
(query block, key/value block) pair a causal mask leaves to compute.

Two layouts, the same for queries and keys/values:

* balanced (head-tail): the sequence is cut into ``2 * cp`` equal chunks and rank ``r``
  holds chunk ``r`` then chunk ``2 * cp - 1 - r``; every rank holds the same even length.
* contiguous: rank ``r`` holds the ``r``-th run of the sequence; lengths may differ.

The ranks agree on every shape (and so on the layout) with one small ``Allgather``
(:func:`agree`), so that an argument error is raised on every rank before any data moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from mpi4py import MPI

from ...comm.buffers import as_buffer
from ...runtime import watchdog
from .load_balance import check_balanced_length

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# what each rank contributes to the agreement, in this order
_FACTS = ("q_len", "kv_len", "batch", "q_heads", "kv_heads", "head_dim", "key_dim", "value_dim", "dtype",
          "kv_mismatch", "mask_batch", "mask_heads", "mask_rows", "mask_columns", "mask_grad")


class Plan(NamedTuple):
    """The part of a (query block, key/value block) pair to compute: local row ranges."""

    q_rows: slice
    kv_rows: slice
    causal: bool


@dataclass(frozen=True)
class Layout:
    """The agreed sequence layout of one ring attention call over ``cp`` ranks."""

    rank: int
    cp: int
    balanced: bool
    causal: bool
    q_lens: tuple[int, ...]  # local query length of each rank
    kv_lens: tuple[int, ...]  # local key/value length of each rank

    @property
    def kv_total(self) -> int:
        return sum(self.kv_lens)

    def plan(self, source: int) -> Plan | None:
        """What this rank computes with the key/value block of rank ``source`` (None: nothing).

        Balanced causal: the own block is causal; an earlier rank's block is seen by all
        queries through its first (head) chunk only; a later rank's block is seen whole by
        the second (tail) query chunk only. Every rank does the same work.
        Contiguous causal: earlier blocks whole, the own block causal, later ones not at all.
        """
        q_len, kv_len = self.q_lens[self.rank], self.kv_lens[source]
        if not q_len or not kv_len:
            return None
        everything = Plan(slice(0, q_len), slice(0, kv_len), False)
        if not self.causal:
            return everything
        if source == self.rank:
            return everything._replace(causal=True)
        if self.balanced:
            half = kv_len // 2
            if source < self.rank:
                return everything._replace(kv_rows=slice(0, half))
            return everything._replace(q_rows=slice(half, q_len))
        return everything if source < self.rank else None

    def kv_columns(self, source: int, rows: slice) -> list[tuple[int, int]]:
        """Global key positions of local rows ``rows`` of rank ``source``'s key/value
        block, as ``[start, stop)`` runs in local order."""
        if self.balanced:
            chunk = self.kv_lens[source] // 2
            mirror = 2 * self.cp - 1 - source
            runs = [(source * chunk, (source + 1) * chunk), (mirror * chunk, (mirror + 1) * chunk)]
        else:
            start = sum(self.kv_lens[:source])
            runs = [(start, start + self.kv_lens[source])]
        picked, offset = [], 0
        for start, stop in runs:  # intersect each run with the local rows
            low, high = max(rows.start, offset), min(rows.stop, offset + stop - start)
            if low < high:
                picked.append((start + low - offset, start + high - offset))
            offset += stop - start
        return picked


def _mask_facts(attn_mask: torch.Tensor | None) -> list[int]:
    """The four dims of ``attn_mask`` padded on the left to 4-D (-1 if none, -2 if over 4-D)
    and whether it requires grad."""
    if attn_mask is None:
        return [-1, -1, -1, -1, 0]
    if attn_mask.ndim > 4:
        return [-2, -2, -2, -2, int(attn_mask.requires_grad)]
    return [*([1] * (4 - attn_mask.ndim)), *attn_mask.shape, int(attn_mask.requires_grad)]


def agree(comm: MPI.Intracomm, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None, *, balanced: bool, causal: bool, enable_gqa: bool) -> Layout:
    """The layout of this call, after one ``Allgather`` of every rank's shapes; raises the
    same ValueError on every rank when they do not fit together."""
    mine = [query.shape[2], key.shape[2], query.shape[0], query.shape[1], key.shape[1], query.shape[3],
            key.shape[3], value.shape[3], DTYPES.index(query.dtype),
            int(key.shape[:3] != value.shape[:3]), *_mask_facts(attn_mask)]
    facts = torch.tensor(mine, dtype=torch.int64)
    table = torch.empty((comm.size, len(mine)), dtype=torch.int64)
    watchdog.call("ring attention's agreement on block shapes (Allgather)", comm, comm.Allgather,
                  [as_buffer(facts), len(mine), MPI.INT64_T], [as_buffer(table), len(mine), MPI.INT64_T])
    ranks = [dict(zip(_FACTS, row)) for row in table.tolist()]
    _check(ranks, balanced=balanced, causal=causal, enable_gqa=enable_gqa, cp=comm.size)
    return Layout(comm.rank, comm.size, balanced, causal,
                  tuple(r["q_len"] for r in ranks), tuple(r["kv_len"] for r in ranks))


def _check(ranks: list[dict[str, int]], *, balanced: bool, causal: bool, enable_gqa: bool, cp: int) -> None:
    """Raise ValueError if the gathered facts (the same list on every rank) do not fit."""
    first = ranks[0]
    for name in ("batch", "q_heads", "kv_heads", "head_dim", "key_dim", "value_dim", "dtype"):
        if len({r[name] for r in ranks}) > 1:
            raise ValueError(f"ring attention: {name} differs across ranks: {[r[name] for r in ranks]}")
    if any(r["kv_mismatch"] for r in ranks):
        raise ValueError("ring attention: key and value differ in batch, heads or length on ranks "
                         f"{[rank for rank, r in enumerate(ranks) if r['kv_mismatch']]}")
    if first["head_dim"] != first["key_dim"]:
        raise ValueError(f"ring attention: query head dim {first['head_dim']} and key head dim "
                         f"{first['key_dim']} differ")
    if enable_gqa:
        if first["q_heads"] % first["kv_heads"]:
            raise ValueError(f"ring attention: {first['q_heads']} query heads are not a multiple of "
                             f"{first['kv_heads']} key/value heads")
    elif first["q_heads"] != first["kv_heads"]:
        raise ValueError(f"ring attention: {first['q_heads']} query heads and {first['kv_heads']} key/value "
                         "heads differ (pass enable_gqa=True for grouped heads)")
    q_lens, kv_lens = [r["q_len"] for r in ranks], [r["kv_len"] for r in ranks]
    if balanced:
        for lens in (q_lens, kv_lens):
            if len(set(lens)) > 1:
                raise ValueError(f"ring attention with load balancing needs the same local length on every "
                                 f"rank, got {lens}")
            check_balanced_length(sum(lens), cp)
    if causal and q_lens != kv_lens:
        raise ValueError(f"causal ring attention needs query and key/value blocks of one length on each rank, "
                         f"got {q_lens} and {kv_lens}")
    _check_mask(ranks, sum(kv_lens))


def _check_mask(ranks: list[dict[str, int]], kv_total: int) -> None:
    """The mask must broadcast to ``[batch, q_heads, local queries, all keys]`` on every rank."""
    if len({r["mask_batch"] == -1 for r in ranks}) > 1:
        raise ValueError("ring attention: attn_mask is given on some ranks only")
    bad = []
    for rank, r in enumerate(ranks):
        if r["mask_batch"] == -1:
            continue
        wanted = (r["batch"], r["q_heads"], r["q_len"], kv_total)
        got = (r["mask_batch"], r["mask_heads"], r["mask_rows"], r["mask_columns"])
        if r["mask_batch"] == -2 or any(g not in (1, w) for g, w in zip(got, wanted)):
            bad.append(f"rank {rank}: {list(got)} vs {list(wanted)}")
        elif r["mask_grad"]:
            raise ValueError("ring attention: attn_mask must not require grad (its gradient is not computed)")
    if bad:
        raise ValueError("ring attention: attn_mask must broadcast to [batch, heads, local queries, "
                         f"global keys] (keys in natural order): {'; '.join(bad)}")


def block_mask(attn_mask: torch.Tensor | None, layout: Layout, source: int, plan: Plan,
               dtype: torch.dtype) -> torch.Tensor | None:
    """The additive ``dtype`` mask of one planned block: rows ``plan.q_rows`` of this rank's
    queries, columns the global key positions of ``plan.kv_rows`` of rank ``source``'s block."""
    if attn_mask is None:
        return None
    mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    mask = mask.expand(*mask.shape[:2], layout.q_lens[layout.rank], layout.kv_total)[:, :, plan.q_rows]
    runs = layout.kv_columns(source, plan.kv_rows)
    pieces = [mask[..., start:stop] for start, stop in runs]
    mask = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)
