"""View and shape ops: view/reshape, transpose/permute, (un)squeeze, expand, slice,
select, split, unbind, cat/stack, repeat, and the backward ops they produce.

Views move no data, so a shard survives whenever the local pieces are exactly the
``torch.chunk`` layout of the output: a dim that is only renumbered keeps its
shard; a dim that is sliced, merged or split keeps it when every rank's piece
lands on its own chunk of the result (checked for every mesh coordinate at plan
time). Otherwise the offending mesh dims move first: to a shard of another dim
(one all-to-all) when that keeps the op local, else to ``Replicate``. Views are
linear and move elements around, so ``Partial`` inputs stay ``Partial``.
"""
from __future__ import annotations

import itertools
import warnings
from math import prod
from typing import Callable, Sequence

import torch

from ..tensor.layout import local_shape_and_offset, local_span
from ..tensor.placements import Partial, Placement, Replicate, Shard, _StridedShard
from ..runtime.effects import effect
from ..tensor.spec import DTensorSpec
from .registry import OpCall, Sharding, cheapest, register, takes_strided

aten = torch.ops.aten


# --- helpers ---------------------------------------------------------------------------------------


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _sharders(placements: Sequence[Placement], dim: int) -> list[int]:
    return [m for m, p in enumerate(placements) if p == Shard(dim)]


def _renumber(placements: Sequence[Placement], dim_map: dict[int, int]) -> tuple[Placement, ...]:
    """Shard(d) becomes Shard(dim_map[d]), _StridedShard(d) _StridedShard(dim_map[d]) (same
    split factor); other placements are kept."""
    return tuple(Shard(dim_map[p.dim]) if isinstance(p, Shard) else
                 _StridedShard(dim_map[p.dim], split_factor=p.split_factor) if type(p) is _StridedShard else p
                 for p in placements)


def _block_per_rank(shape, placements, mesh_shape, dim: int) -> float:
    """Average length along ``dim`` of one rank's block."""
    return shape[dim] / prod(mesh_shape[m] for m in _sharders(placements, dim))


def _relocate(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: list[Placement],
    bad: Sequence[int],
    targets: Sequence[int],
    valid: Callable[[list[Placement]], bool] | None = None,
) -> list[Placement]:
    """Move the shards of mesh dims ``bad`` off their tensor dim: each to ``Shard(d)``
    for the ``d`` in ``targets`` with the largest blocks that ``valid`` accepts (one
    all-to-all), else to ``Replicate`` (all-gather). Returns the new placements."""
    placements = list(placements)
    for m in bad:
        placements[m] = Replicate()
    for m in bad:
        ranked = sorted(targets, key=lambda d: -_block_per_rank(shape, placements, mesh_shape, d))
        for d in ranked:
            if _block_per_rank(shape, placements, mesh_shape, d) < mesh_shape[m]:
                break
            trial = placements[:m] + [Shard(d)] + placements[m + 1:]
            if valid is None or valid(trial):
                placements = trial
                break
    return placements


def _longest_prefix(sharders: list[int], fits: Callable[[list[int]], bool]) -> int:
    """How many of ``sharders`` (outer first) can stay: the longest prefix that ``fits``."""
    for k in range(len(sharders), 0, -1):
        if fits(sharders[:k]):
            return k
    return 0


def _without(placements: Sequence[Placement], dim: int, keep: Sequence[int]) -> list[Placement]:
    """``placements`` with the shards of ``dim`` not in ``keep`` replaced by Replicate."""
    return [Replicate() if p == Shard(dim) and m not in keep else p for m, p in enumerate(placements)]


def _local_shape(shape, placements, mesh) -> tuple[int, ...]:
    return local_shape_and_offset(shape, placements, mesh.shape, mesh._coord)[0]


# --- renumbering views: no communication ever ------------------------------------------------------


@takes_strided
@register(aten.transpose.int, aten.permute.default, aten.t.default)
def permute_rule(call: OpCall) -> Sharding:
    """Dims are reordered: a shard follows its dim."""
    spec = call.tensor_specs[0]
    ndim = spec.ndim
    args = call.bound()
    if call.func is aten.permute.default:
        order = [_norm(d, ndim) for d in args["dims"]]
    elif ndim < 2:
        order = list(range(ndim))
    else:
        d0, d1 = (0, 1) if call.func is aten.t.default else (_norm(args["dim0"], ndim), _norm(args["dim1"], ndim))
        order = list(range(ndim))
        order[d0], order[d1] = d1, d0
    dim_map = {src: dst for dst, src in enumerate(order)}
    return Sharding([None], [_renumber(spec.placements, dim_map)])


@register(aten.unsqueeze.default)
def unsqueeze_rule(call: OpCall) -> Sharding:
    spec = call.tensor_specs[0]
    dim = _norm(call.bound()["dim"], spec.ndim + 1)
    dim_map = {d: d + (d >= dim) for d in range(spec.ndim)}
    return Sharding([None], [_renumber(spec.placements, dim_map)])


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze_rule(call: OpCall) -> Sharding:
    """Only dims of global size 1 go (a local block may have size 1 elsewhere, so the
    local op names them); a shard of a squeezed dim moves to another dim first."""
    spec = call.tensor_specs[0]
    ndim, shape = spec.ndim, spec.shape
    args = call.bound()
    if "dim" not in args:
        asked = range(ndim)
    elif isinstance(args["dim"], int):
        asked = [args["dim"]]
    else:
        asked = args["dim"]
    gone = sorted({_norm(d, ndim) for d in asked if ndim and shape[_norm(d, ndim)] == 1})
    kept = [d for d in range(ndim) if d not in gone]
    bad = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in gone]
    placements = _relocate(shape, spec.mesh.shape, list(spec.placements), bad, kept)
    out = _renumber(placements, {d: i for i, d in enumerate(kept)})
    dims = tuple(gone)
    return Sharding([tuple(placements)], [out], local=lambda a, k: a[0].squeeze(dims))


# --- expand and repeat -----------------------------------------------------------------------------


@register(aten.expand.default)
def expand_rule(call: OpCall) -> Sharding:
    """Broadcast dims are replicated; the size argument becomes local (-1 on kept dims)."""
    spec = call.tensor_specs[0]
    out_shape = call.out_metas()[0].shape
    lead = len(out_shape) - spec.ndim
    grown = [d for d in range(spec.ndim) if spec.shape[d] != out_shape[lead + d]]
    kept = [d for d in range(spec.ndim) if d not in grown]
    bad = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in grown]
    placements = _relocate(spec.shape, spec.mesh.shape, list(spec.placements), bad, kept)
    out = _renumber(placements, {d: lead + d for d in range(spec.ndim)})
    size = tuple(out_shape[i] if i < lead or (i - lead) in grown else -1 for i in range(len(out_shape)))
    return Sharding([tuple(placements)], [out], local=lambda a, k: a[0].expand(size))


@register(aten.repeat.default)
def repeat_rule(call: OpCall) -> Sharding:
    """Tiling a sharded dim breaks its chunk layout: only dims repeated once keep shards."""
    spec = call.tensor_specs[0]
    repeats = list(call.bound()["repeats"])
    lead = len(repeats) - spec.ndim
    tiled = [d for d in range(spec.ndim) if repeats[lead + d] != 1]
    kept = [d for d in range(spec.ndim) if d not in tiled]
    bad = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in tiled]
    placements = _relocate(spec.shape, spec.mesh.shape, list(spec.placements), bad, kept)
    return Sharding([tuple(placements)], [_renumber(placements, {d: lead + d for d in range(spec.ndim)})])


def _coords_of(mesh_shape: Sequence[int], mesh_dims: Sequence[int]):
    """Mesh coordinates varying only ``mesh_dims`` (the others at 0)."""
    for values in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims)):
        coord = [0] * len(mesh_shape)
        for m, v in zip(mesh_dims, values):
            coord[m] = v
        yield coord


@register(aten.view.dtype)
def view_dtype_rule(call: OpCall) -> Sharding:
    """Reinterpreting bits is not linear (Partial is reduced first); a new element
    width rescales the last dim, whose shards are then gathered."""
    spec = call.tensor_specs[0]
    same_width = call.out_metas()[0].dtype.itemsize == spec.dtype.itemsize
    last = Shard(spec.ndim - 1)
    placements = tuple(
        Replicate() if isinstance(p, Partial) or (p == last and not same_width) else p for p in spec.placements
    )
    return Sharding([placements], [placements])


# --- slices: slice, select, split, unbind and their backward ops ---------------------------------


def _local_range(sel: range, off: int, size: int) -> tuple[int, int]:
    """Positions [k0, k1) of ``sel`` whose index lies in the block [off, off + size)."""
    step, n = sel.step, len(sel)
    k0 = min(max(-(-(off - sel.start) // step), 0), n)
    k1 = min(max(-(-(off + size - sel.start) // step), 0), n)
    return k0, max(k0, k1)


def _local_bounds(sel: range, off: int, size: int) -> tuple[int, int, int]:
    """(start, end, step) selecting, inside the block [off, off + size), its part of ``sel``."""
    k0, k1 = _local_range(sel, off, size)
    if k0 == k1:
        return 0, 0, sel.step
    start = sel.start + k0 * sel.step - off
    return start, start + (k1 - k0 - 1) * sel.step + 1, sel.step


def _slice_fits(length: int, dim: int, sel: range, placements, mesh_shape) -> bool:
    """Whether every rank's part of ``sel`` is its chunk of the result (length ``len(sel)``)."""
    for coord in _coords_of(mesh_shape, _sharders(placements, dim)):
        off, size = local_span(length, dim, placements, mesh_shape, coord)
        k0, k1 = _local_range(sel, off, size)
        out_off, out_size = local_span(len(sel), dim, placements, mesh_shape, coord)
        if k1 - k0 != out_size or (out_size and k0 != out_off):
            return False
    return True


def _fit_slices(spec: DTensorSpec, dim: int, length: int, sels: Sequence[range]) -> list[Placement]:
    """Placements of ``spec`` (the tensor sliced along ``dim``, or for backward ops the
    slice itself) under which every selection in ``sels`` of the ``length``-long dim
    is local: the outer shards of ``dim`` that align stay, the others move."""
    mesh_shape = spec.mesh.shape
    sharders = _sharders(spec.placements, dim)
    keep = _longest_prefix(
        sharders,
        lambda kept: all(
            _slice_fits(length, dim, s, _without(spec.placements, dim, kept), mesh_shape) for s in sels
        ),
    )
    others = [d for d in range(spec.ndim) if d != dim]
    return _relocate(spec.shape, mesh_shape, list(spec.placements), sharders[keep:], others)


def _block(length: int, dim: int, placements, mesh) -> tuple[int, int]:
    return local_span(length, dim, placements, mesh.shape, mesh._coord)


@register(aten.slice.Tensor, aten.narrow.default)
def slice_rule(call: OpCall) -> Sharding:
    """Each rank keeps the part of the slice inside its block, when that is its chunk of the result."""
    spec = call.tensor_specs[0]
    args = call.bound()
    dim = _norm(args["dim"], spec.ndim)
    length = spec.shape[dim]
    if call.func is aten.narrow.default:
        start = _norm(args["start"], length)
        sel = range(length)[start:start + args["length"]]
    else:
        sel = range(length)[args["start"]:args["end"]:args["step"]]
    placements = _fit_slices(spec, dim, length, [sel])
    start, end, step = _local_bounds(sel, *_block(length, dim, placements, spec.mesh))
    return Sharding(
        [tuple(placements)], [tuple(placements)],
        local=lambda a, k: aten.slice.Tensor(a[0], dim, start, end, step),
    )


@register(aten.split.Tensor, aten.split_with_sizes.default)
def split_rule(call: OpCall) -> Sharding:
    """Every piece is a slice; shards of the split dim stay only if all pieces align."""
    spec = call.tensor_specs[0]
    dim = _norm(call.bound()["dim"], spec.ndim)
    length = spec.shape[dim]
    sels, start = [], 0
    for piece in call.out_metas():
        sels.append(range(start, start + piece.shape[dim]))
        start += piece.shape[dim]
    placements = _fit_slices(spec, dim, length, sels)
    block = _block(length, dim, placements, spec.mesh)
    spans = [(s, e - s) for s, e, _ in (_local_bounds(sel, *block) for sel in sels)]
    return Sharding(
        [tuple(placements)], [tuple(placements)] * len(sels),
        local=lambda a, k: [a[0].narrow(dim, s, n) for s, n in spans],
    )


@register(aten.slice_backward.default)
def slice_backward_rule(call: OpCall) -> Sharding:
    """Zero-pad the gradient of a slice: the forward check read backwards (each rank's
    gradient block must be the part of the slice inside its block of the input)."""
    grad = call.tensor_specs[0]
    args = call.bound()
    sizes = list(args["input_sizes"])
    dim = _norm(args["dim"], len(sizes))
    sel = range(sizes[dim])[args["start"]:args["end"]:args["step"]]
    placements = _fit_slices(grad, dim, sizes[dim], [sel])
    start, end, step = _local_bounds(sel, *_block(sizes[dim], dim, placements, grad.mesh))
    local_sizes = _local_shape(sizes, placements, grad.mesh)
    return Sharding(
        [tuple(placements)], [tuple(placements)],
        local=lambda a, k: aten.slice_backward.default(a[0], local_sizes, dim, start, end, step),
    )


@register(aten.select.int)
def select_rule(call: OpCall) -> Sharding:
    """Selecting along a sharded dim: for floating dtypes the owner of the index keeps
    its row and the other ranks zeros, a ``Partial(sum)`` made without communication;
    other dtypes move the shard to another dim first."""
    spec = call.tensor_specs[0]
    args = call.bound()
    dim = _norm(args["dim"], spec.ndim)
    length = spec.shape[dim]
    index = _norm(args["index"], length)
    out_map = {d: d - (d > dim) for d in range(spec.ndim) if d != dim}
    sharders = _sharders(spec.placements, dim)
    if not sharders:
        return Sharding([None], [_renumber(spec.placements, out_map)])
    if not (spec.dtype.is_floating_point or spec.dtype.is_complex):
        others = [d for d in range(spec.ndim) if d != dim]
        placements = _relocate(spec.shape, spec.mesh.shape, list(spec.placements), sharders, others)
        return Sharding([tuple(placements)], [_renumber(placements, out_map)])
    out = _renumber([Partial("sum") if m in sharders else p for m, p in enumerate(spec.placements)], out_map)
    off, size = _block(length, dim, spec.placements, spec.mesh)
    if off <= index < off + size:
        return Sharding([None], [out], local=lambda a, k: a[0].select(dim, index - off))
    shape = _local_shape(call.out_metas()[0].shape, out, spec.mesh)
    return Sharding([None], [out], local=lambda a, k: a[0].new_zeros(shape))


@register(aten.select_backward.default)
def select_backward_rule(call: OpCall) -> Sharding:
    """The gradient has no ``dim`` to be sharded on: every layout is kept, no communication."""
    grad = call.tensor_specs[0]
    args = call.bound()
    sizes = list(args["input_sizes"])
    dim = _norm(args["dim"], len(sizes))
    index = _norm(args["index"], sizes[dim])
    out = _renumber(grad.placements, {d: d + (d >= dim) for d in range(grad.ndim)})
    local_sizes = _local_shape(sizes, out, grad.mesh)
    return Sharding(
        [None], [out], local=lambda a, k: aten.select_backward.default(a[0], local_sizes, dim, index)
    )


@register(aten.unbind.int)
def unbind_rule(call: OpCall) -> Sharding:
    """The other dims keep their shards. A sharded unbound dim would leave most ranks
    empty-handed: its shards move to another dim first (torch refuses that case; the value
    here is one process's, and torch's OpInfo samples unbind sharded dims)."""
    spec = call.tensor_specs[0]
    dim = _norm(call.bound()["dim"], spec.ndim)
    others = [d for d in range(spec.ndim) if d != dim]
    sharders = _sharders(spec.placements, dim)
    if not sharders:
        out = _renumber(spec.placements, {d: d - (d > dim) for d in others})
        return Sharding([None], [out] * spec.shape[dim])
    placements = _relocate(spec.shape, spec.mesh.shape, list(spec.placements), sharders, others)
    out = _renumber(placements, {d: d - (d > dim) for d in others})
    return Sharding([tuple(placements)], [out] * spec.shape[dim])


# --- diagonal and unfold: a new dim made of two old ones or of windows -----------------------------


def _moved_off(spec: DTensorSpec, dims: Sequence[int], keep_in: Sequence[int]) -> list[Placement]:
    """``spec``'s placements with the shards of ``dims`` moved to dims of ``keep_in``."""
    bad = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in dims]
    return _relocate(spec.shape, spec.mesh.shape, list(spec.placements), bad, keep_in)


@register(aten.diagonal.default)
def diagonal_rule(call: OpCall) -> Sharding:
    """The two dims of the diagonal leave (shards on them move first); the others
    keep their shards, renumbered. The diagonal is the new last dim."""
    spec = call.tensor_specs[0]
    args = call.bound()
    pair = (_norm(args["dim1"], spec.ndim), _norm(args["dim2"], spec.ndim))
    others = [d for d in range(spec.ndim) if d not in pair]
    placements = _moved_off(spec, pair, others)
    return Sharding([tuple(placements)], [_renumber(placements, {d: i for i, d in enumerate(others)})])


@register(aten.diagonal_backward.default)
def diagonal_backward_rule(call: OpCall) -> Sharding:
    """Gradient dims map back to the input's other dims; its diagonal dim is not sharded."""
    grad = call.tensor_specs[0]
    args = call.bound()
    sizes = list(args["input_sizes"])
    offset, dim1, dim2 = args["offset"], _norm(args["dim1"], len(sizes)), _norm(args["dim2"], len(sizes))
    others = [d for d in range(len(sizes)) if d not in (dim1, dim2)]
    placements = _moved_off(grad, [grad.ndim - 1], range(grad.ndim - 1))
    out = _renumber(placements, dict(enumerate(others)))
    local_sizes = _local_shape(sizes, out, grad.mesh)
    return Sharding(
        [tuple(placements)], [out],
        local=lambda a, k: aten.diagonal_backward.default(a[0], local_sizes, offset, dim1, dim2),
    )


@register(aten.unfold.default)
def unfold_rule(call: OpCall) -> Sharding:
    """Windows along ``dimension`` overlap, so that dim is not sharded; the others keep
    their shards (the window dim is appended last)."""
    spec = call.tensor_specs[0]
    dim = _norm(call.bound()["dimension"], max(spec.ndim, 1))
    placements = _moved_off(spec, [dim], [d for d in range(spec.ndim) if d != dim])
    return Sharding([tuple(placements)], [tuple(placements)])


@register(aten.unfold_backward.default)
def unfold_backward_rule(call: OpCall) -> Sharding:
    """The window count and window dims of the gradient are not sharded; the others are kept."""
    grad = call.tensor_specs[0]
    args = call.bound()
    sizes = list(args["input_sizes"])
    dim, size, step = _norm(args["dim"], max(len(sizes), 1)), args["size"], args["step"]
    window = grad.ndim - 1
    placements = _moved_off(grad, [dim, window], [d for d in range(window) if d != dim])
    local_sizes = _local_shape(sizes, placements, grad.mesh)
    return Sharding(
        [tuple(placements)], [tuple(placements)],
        local=lambda a, k: aten.unfold_backward.default(a[0], local_sizes, dim, size, step),
    )


# --- cat and stack ---------------------------------------------------------------------------------


@register(aten.cat.default, aten.stack.default)
def cat_rule(call: OpCall) -> Sharding:
    """All inputs take one layout, the cheapest to reach: per mesh dim a shard of any
    dim but the joined one, Replicate, or a Partial some input has (joining is linear)."""
    stack = call.func is aten.stack.default
    out_ndim = call.out_metas()[0].ndim
    in_ndim = out_ndim - stack
    dim = _norm(call.bound()["dim"], out_ndim)
    specs = call.tensor_specs
    # cat skips legacy empty 1-D inputs of another rank: they are only replicated
    joined = [i for i, s in enumerate(specs) if s.ndim == in_ndim]
    shape = specs[joined[0]].shape
    by_size = sorted((d for d in range(in_ndim) if stack or d != dim), key=lambda d: -shape[d])
    per_mesh_dim = []
    for m in range(call.ndim):
        current = [specs[i].placements[m] for i in joined]
        partials = sorted({p for p in current if isinstance(p, Partial)}, key=repr)
        per_mesh_dim.append([Replicate(), *(Shard(d) for d in by_size), *partials])
    replicate = (Replicate(),) * call.ndim
    candidates = (
        Sharding([layout if i in joined else replicate for i in range(len(specs))], [layout])
        for layout in itertools.product(*per_mesh_dim)
    )
    best = cheapest(call, candidates)
    layout = best.outputs[0]
    return Sharding(best.inputs, [_renumber(layout, {d: d + (stack and d >= dim) for d in range(in_ndim)})])


# --- tensor_split by a tensor of indices ------------------------------------------------------------


def _tensor_split_by_tensor(self: torch.Tensor, tensor_indices_or_sections: torch.Tensor, dim: int = 0):
    """``aten::tensor_split.tensor_indices_or_sections``. torch's own kernel runs before any
    tensor subclass is dispatched and reads the indices through their data pointer, which a
    DTensor lacks; this one reads their values (a DTensor's whole value: every rank calls
    the op, so the small gather is collective) and splits by ``tensor_split.indices`` or
    ``.sections``, as torch's does, with torch's checks and messages."""
    from ..tensor.dtensor import DTensor  # dtensor imports the rules

    split = tensor_indices_or_sections
    if split.device.type != "cpu":
        raise RuntimeError(f"tensor_split expected tensor_indices_or_sections to be on cpu, but it's on {split.device}")
    if split.dtype != torch.long:
        name = torch.empty(0, dtype=split.dtype).type().removeprefix("torch.").removesuffix("Tensor")  # c10's name
        raise RuntimeError(f"tensor_split expected tensor_indices_or_sections to have dtype of long, but got {name}")
    if split.dim() > 1:
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
                           f"one-dimensional tensor, but got a tensor with {split.dim()} dims")
    if isinstance(split, DTensor):
        split = split.full_tensor()
    if split.dim() == 0:
        return aten.tensor_split.sections(self, split.item(), dim)
    return aten.tensor_split.indices(self, split.tolist(), dim)


_LIBRARIES: list[torch.library.Library] = []  # kept alive: dropping one restores torch's kernel


@effect("aten::tensor_split kernel", "first mesh",
        "aten::tensor_split.tensor_indices_or_sections: a kernel that also takes DTensor indices "
        "replaces torch's composite one, for every tensor (the only dispatch key that runs before "
        "a tensor subclass is seen); same results and errors for plain tensors")
def _register_tensor_split() -> None:
    """Replace torch's composite kernel (for every tensor: the one dispatch key that runs
    before a subclass is seen); the warning that a kernel is overridden is expected. Done
    at the first mesh: DTensors exist only from then on."""
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        library.impl("tensor_split.tensor_indices_or_sections", _tensor_split_by_tensor, "CompositeImplicitAutograd")
    _LIBRARIES.append(library)
