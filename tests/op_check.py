"""Checking an op on DTensors against plain torch on the full tensors.

``check_op(fn, inputs, placements, mesh)`` builds every input on every rank from
a fixed seed, distributes it with the given placements (``None``: pass the plain
tensor), runs ``fn`` on plain tensors and on DTensors, and compares
``full_tensor()`` of every output and the gradient of every floating input with
the reference. All verdicts are collective.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, distribute_tensor


def _outputs(out) -> list:
    if isinstance(out, (tuple, list)):
        return [o for item in out for o in _outputs(item)]
    return [out]


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def check_op(
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Sequence | None],
    mesh,
    *,
    grad: bool = True,
    atol: float = 1e-5,
    rtol: float = 1.3e-6,
    seed: int = 99,
) -> list:
    """Run ``fn`` both ways, compare outputs and input gradients; returns the DTensor outputs."""
    wants_grad = [grad and t.is_floating_point() for t in inputs]
    ref_in = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, wants_grad)]
    dist_in = []
    for t, p, g in zip(inputs, placements, wants_grad):
        if p is None:
            dist_in.append(t.detach().clone().requires_grad_(g))
        else:
            dist_in.append(distribute_tensor(t.detach().clone().requires_grad_(g), mesh, p))
    ref_out = _outputs(fn(*ref_in))
    dist_out = _outputs(fn(*dist_in))
    assert_all_ranks(len(ref_out) == len(dist_out), f"{len(dist_out)} outputs, expected {len(ref_out)}")
    for r, d in zip(ref_out, dist_out):
        if isinstance(r, torch.Tensor):
            assert_all_ranks(isinstance(d, DTensor), f"output is {type(d).__name__}, expected DTensor")
            assert_all_ranks(tuple(d.shape) == tuple(r.shape), f"global shape {tuple(d.shape)} != {tuple(r.shape)}")
            assert_close(d.full_tensor(), r, atol=atol, rtol=rtol)
        else:
            assert_all_ranks(d == r, f"non-tensor output {d!r} != {r!r}")
    if not any(wants_grad):
        return dist_out
    diff = [i for i, r in enumerate(ref_out) if isinstance(r, torch.Tensor) and r.requires_grad]
    if not diff:
        return dist_out
    ref_loss = sum((ref_out[i] * global_tensor(ref_out[i].shape, ref_out[i].dtype, seed + i)).sum() for i in diff)
    dist_loss = sum((_full(dist_out[i]) * global_tensor(ref_out[i].shape, ref_out[i].dtype, seed + i)).sum() for i in diff)
    ref_loss.backward()
    dist_loss.backward()
    for i, (r, d) in enumerate(zip(ref_in, dist_in)):
        if not wants_grad[i]:
            continue
        if r.grad is None:
            assert_all_ranks(d.grad is None, f"input {i} got a gradient the reference lacks")
            continue
        assert_all_ranks(d.grad is not None, f"input {i} got no gradient")
        assert_close(_full(d.grad), r.grad, atol=atol, rtol=rtol)
    return dist_out
