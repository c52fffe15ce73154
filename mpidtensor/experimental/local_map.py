"""``local_map``: run a function written for plain tensors on the local shards of DTensors.

The DTensor arguments (matched against ``in_placements``, redistributed to them when
``redistribute_inputs``) are handed to ``func`` as their local tensors, and ``func``'s
tensor outputs are wrapped back as DTensors with ``out_placements``. Gradients flow:
the inputs leave through ``to_local`` (``in_grad_placements`` says the layout of their
gradients) and the outputs come back through ``from_local``.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from ..tensor.dtensor import DTensor
from ..mesh import DeviceMesh
from ..tensor.placements import Placement, normalize_placements

__all__ = ["local_map"]

PlacementType = Sequence[Placement] | None


def local_map(
    func: Callable | None = None,
    out_placements: PlacementType | tuple[PlacementType, ...] = None,
    in_placements: tuple[PlacementType, ...] | None = None,
    in_grad_placements: tuple[PlacementType, ...] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Callable:
    """``func`` made to take and return DTensors (a decorator when ``func`` is omitted).

    ``in_placements``/``in_grad_placements``: one entry per flattened positional argument
    (``None`` for non-tensors). ``out_placements``: placements of a single output, or a
    tuple of one entry per flattened output (``None`` for non-tensors). Without DTensor
    arguments ``func`` runs as it is. The mesh is ``device_mesh`` or the first DTensor's.
    """
    if func is None:
        return functools.partial(
            local_map, out_placements=out_placements, in_placements=in_placements,
            in_grad_placements=in_grad_placements, device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        flat, tree = pytree.tree_flatten(args)
        _check_length("in_placements", in_placements, len(flat))
        _check_length("in_grad_placements", in_grad_placements, len(flat))
        mesh = device_mesh
        local = []
        for i, arg in enumerate(flat):
            want = None if in_placements is None else in_placements[i]
            if not isinstance(arg, DTensor):
                if want is not None and not isinstance(arg, torch.Tensor):
                    raise ValueError(f"local_map: argument {i} is not a tensor; its in_placements entry must be "
                                     f"None, got {want}")
                local.append(arg)
                continue
            mesh = arg.device_mesh if mesh is None else mesh
            if in_placements is not None:
                arg = _matched(arg, want, i, redistribute_inputs)
            grad = None if in_grad_placements is None else in_grad_placements[i]
            if in_grad_placements is not None and grad is None:
                raise ValueError(f"local_map: argument {i} is a DTensor; its in_grad_placements entry is None")
            local.append(arg.to_local(grad_placements=grad))
        out = func(*pytree.tree_unflatten(local, tree), **kwargs)
        if mesh is None:  # no DTensor argument: plain tensors in, plain tensors out
            return out
        return _wrap_outputs(out, out_placements, mesh)

    return wrapped


def _check_length(name: str, placements, count: int) -> None:
    if placements is not None and len(placements) != count:
        raise ValueError(f"local_map: {name} has {len(placements)} entries for {count} flattened arguments")


def _matched(arg: DTensor, want: PlacementType, index: int, redistribute: bool) -> DTensor:
    """``arg`` with the placements ``want`` (redistributed if allowed)."""
    if want is None:
        raise ValueError(f"local_map: argument {index} is a DTensor; its in_placements entry is None")
    want = normalize_placements(want, arg.device_mesh.ndim, arg.ndim)
    if arg.placements == want:
        return arg
    if not redistribute:
        raise ValueError(f"local_map: argument {index} has placements {list(arg.placements)}, in_placements asks "
                         f"for {list(want)}; pass redistribute_inputs=True to redistribute it")
    return arg.redistribute(arg.device_mesh, want)


def _wrap_outputs(out, out_placements, mesh: DeviceMesh):
    flat, tree = pytree.tree_flatten(out)
    single = not isinstance(out_placements, tuple) or all(isinstance(p, Placement) for p in out_placements)
    specs = (out_placements,) if single else out_placements  # a tuple of Placements is one output's
    if len(specs) != len(flat):
        raise ValueError(f"local_map: out_placements has {len(specs)} entries for {len(flat)} flattened outputs")
    wrapped = []
    for i, (value, placements) in enumerate(zip(flat, specs)):
        if isinstance(value, DTensor):
            raise TypeError(f"local_map: output {i} of the function is a DTensor; it must return local tensors")
        if isinstance(value, torch.Tensor):
            if placements is None:
                raise ValueError(f"local_map: output {i} is a tensor; its out_placements entry is None")
            value = DTensor.from_local(value, mesh, placements)
        elif placements is not None:
            raise ValueError(f"local_map: output {i} is not a tensor; its out_placements entry must be None")
        wrapped.append(value)
    return pytree.tree_unflatten(wrapped, tree)
