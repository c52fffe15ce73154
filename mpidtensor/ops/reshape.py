"""``view`` / ``_unsafe_view`` (and so ``reshape``, ``flatten``, ``unflatten``): a shard of
the leading dim of a merged or split group of dims stays when the pieces align with the
output's chunks; other shards move (all-to-all or all-gather) first.

``_StridedShard`` as torch 2.13 gives it, with no communication: merging dims where the
shard is on a later dim of the group (a sequence-sharded ``(B, S, D)`` activation flattened
to ``(B * S, D)``) gives ``_StridedShard(merged, split_factor=<elements of the dims
before it>)``, and splitting such a dim back where those dims reappear gives the ``Shard``
of the dim after them (torchtitan's MoE router under TP: ``Shard(1)`` in, ``Shard(1)``
out). Both need the sharded dim to split evenly over its mesh dim and no other mesh dim
sharding the group but earlier ones evenly sharding its leading dim (the batch over data
parallelism, torchtitan's ``full_dtensor``); otherwise the shard moves as before.
"""
from __future__ import annotations

from math import prod
from typing import Sequence

import torch

from ..tensor.layout import local_span
from ..tensor.placements import Placement, Replicate, Shard, _StridedShard, shard_dim
from .registry import OpCall, Sharding, register, takes_strided
from .views import _coords_of, _local_shape, _longest_prefix, _relocate, _renumber, _sharders, _without

aten = torch.ops.aten


def _groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair the dims of a view into minimal groups of equal element count, size-1 dims
    left out: (input dims, output dims) of each group. Needs a non-empty tensor."""
    ins = [d for d, n in enumerate(in_shape) if n != 1]
    outs = [d for d, n in enumerate(out_shape) if n != 1]
    groups, i, o = [], 0, 0
    while i < len(ins):
        gi, go = [ins[i]], [outs[o]]
        n_in, n_out = in_shape[ins[i]], out_shape[outs[o]]
        i, o = i + 1, o + 1
        while n_in != n_out:
            if n_in < n_out:
                gi.append(ins[i])
                n_in *= in_shape[ins[i]]
                i += 1
            else:
                go.append(outs[o])
                n_out *= out_shape[outs[o]]
                o += 1
        groups.append((gi, go))
    return groups


def _view_fits(in_shape, out_shape, group, placements, mesh_shape) -> bool:
    """Whether a group's input shards become the chunks of its leading output dim.

    Only the group's leading input dim may be sharded; then each rank holds a
    contiguous run of the group's elements, which must be exactly the run of its
    chunk of the leading output dim (same mesh dims, same nesting)."""
    dims_in, dims_out = group
    lead_in, lead_out = dims_in[0], dims_out[0]
    if any(Shard(d) in placements for d in dims_in[1:]):
        return False
    sharders = _sharders(placements, lead_in)
    if not sharders:
        return True
    run_in = prod(in_shape[d] for d in dims_in[1:])
    run_out = prod(out_shape[d] for d in dims_out[1:])
    out_placements = [Shard(lead_out) if m in sharders else Replicate() for m in range(len(placements))]
    for coord in _coords_of(mesh_shape, sharders):
        off_in, n_in = local_span(in_shape[lead_in], lead_in, placements, mesh_shape, coord)
        off_out, n_out = local_span(out_shape[lead_out], lead_out, out_placements, mesh_shape, coord)
        if n_in * run_in != n_out * run_out or (n_in and off_in * run_in != off_out * run_out):
            return False
    return True


def _unit_dims(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """The size-1 input dims paired, in order, with the size-1 output dims. A shard of a
    size-1 dim is the whole tensor on the first rank and nothing elsewhere, and so is a shard
    of any size-1 output dim: the shard stays, with no collective (as torch's)."""
    ones_in = [d for d, n in enumerate(in_shape) if n == 1]
    return dict(zip(ones_in, [d for d, n in enumerate(out_shape) if n == 1]))


@takes_strided
@register(aten.view.default, aten._unsafe_view.default)
def view_rule(call: OpCall) -> Sharding:
    """The placements that keep the view local (module docstring); the size argument
    becomes this rank's local output shape."""
    spec = call.tensor_specs[0]
    mesh, in_shape = spec.mesh, spec.shape
    out_shape = call.out_metas()[0].shape
    # a _StridedShard this rule does not carry over is gathered first (as other rules see it)
    plain = [Replicate() if type(p) is _StridedShard else p for p in spec.placements]
    if in_shape.numel() == 0:
        placements = [Replicate() if shard_dim(p) is not None else p for p in plain]
        out = tuple(placements)
    else:
        groups = _groups(in_shape, out_shape)
        strided, leads = _strided_moves(spec.placements, groups, in_shape, out_shape, mesh.shape)
        shown = [Replicate() if m in strided else p for m, p in enumerate(plain)]
        placements, out = _plain_view(in_shape, out_shape, groups, shown, mesh.shape)
        touched = {d for m in strided for g in groups if shard_dim(spec.placements[m]) in g[0] for d in g[0]}
        if any(placements[k] != spec.placements[k] for k in leads) or any(
                shard_dim(p) in touched for m, p in enumerate(placements) if m not in strided and m not in leads):
            strided = {}  # a shard they count on moved, or another moved onto their dims: the plain rule alone
            placements, out = _plain_view(in_shape, out_shape, groups, plain, mesh.shape)
        for m, moved in strided.items():
            placements[m], out[m] = spec.placements[m], moved
        out = tuple(out)
    size = _local_shape(out_shape, out, mesh)
    op = call.func._op  # the overload's C++ entry: one Python frame less per call
    return Sharding([tuple(placements)], [out], local=lambda a, k: op(a[0], size))


def _plain_view(in_shape, out_shape, groups, placements: list[Placement],
                mesh_shape) -> tuple[list[Placement], list[Placement]]:
    """(input, output) placements for ``Shard``/``Replicate``/``Partial`` inputs: a shard
    stays where it leads its group and its pieces are the output's chunks, else it moves."""
    by_lead = {g[0][0]: g for g in groups}
    units = _unit_dims(in_shape, out_shape)
    bad = [m for m, p in enumerate(placements)
           if isinstance(p, Shard) and p.dim not in by_lead and p.dim not in units]
    placements = [Replicate() if m in bad else p for m, p in enumerate(placements)]
    for lead, group in by_lead.items():
        sharders = _sharders(placements, lead)
        keep = _longest_prefix(
            sharders,
            lambda kept: _view_fits(in_shape, out_shape, group, _without(placements, lead, kept), mesh_shape),
        )
        bad += sharders[keep:]

    def valid(trial: list[Placement]) -> bool:
        return all(_view_fits(in_shape, out_shape, g, trial, mesh_shape) for g in groups)

    placements = _relocate(in_shape, mesh_shape, placements, sorted(bad), list(by_lead), valid)
    return placements, list(_renumber(placements, {**units, **{lead: g[1][0] for lead, g in by_lead.items()}}))


def _strided_moves(placements: Sequence[Placement], groups, in_shape: Sequence[int], out_shape: Sequence[int],
                   mesh_shape: Sequence[int]) -> tuple[dict[int, Placement], set[int]]:
    """The mesh dims whose shard the view carries as torch does, each with its output
    placement, and the earlier mesh dims whose ``Shard`` of the group's leading dim they
    count on: a ``Shard`` of a later dim of a merged group becomes a ``_StridedShard`` of the
    merged dim (split factor: the elements of the dims before it in a rank's block); a
    ``_StridedShard`` of a dim that is only renumbered stays one; one of a dim split where
    its pieces are a block of the leading output dims becomes the ``Shard`` of the next.
    Each needs its dim split evenly, and no other mesh dim sharding the group but earlier
    ones that evenly shard its leading dim (batch over data parallelism)."""
    moves: dict[int, Placement] = {}
    leads: set[int] = set()
    for m, p in enumerate(placements):
        d = shard_dim(p)
        group = next((g for g in groups if d in g[0]), None)
        if group is None:
            continue
        (dims_in, dims_out), n = group, mesh_shape[m]
        lead = dims_in[0]
        others = [k for k, q in enumerate(placements) if k != m and shard_dim(q) in dims_in]
        if d == lead and type(p) is Shard or any(k > m or placements[k] != Shard(lead) for k in others):
            continue
        outer = prod(mesh_shape[k] for k in others)  # the leading dim's split before mesh dim m
        if in_shape[lead] % outer:
            continue
        if type(p) is Shard and len(dims_out) == 1 and in_shape[d] % n == 0:
            moves[m] = _StridedShard(dims_out[0], split_factor=in_shape[lead] // outer * prod(in_shape[lead + 1:d]))
        elif type(p) is _StridedShard and len(dims_in) == 1 and len(dims_out) == 1:
            moves[m] = _StridedShard(dims_out[0], split_factor=p.split_factor)
        elif type(p) is _StridedShard and len(dims_in) == 1 and out_shape[dims_out[0]] % outer == 0:
            for j in range(1, len(dims_out)):
                block = out_shape[dims_out[0]] // outer * prod(out_shape[dims_out[0] + 1:dims_out[j]])
                if block == p.split_factor and out_shape[dims_out[j]] % n == 0:
                    moves[m] = Shard(dims_out[j])
                    break
        if m in moves:
            leads.update(others)
    return moves, leads
