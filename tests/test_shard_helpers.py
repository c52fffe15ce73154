"""torch's ``Shard`` helpers by torch's names (issue 38: transformers tries
``local_shard_size_and_offset``, then ``_local_shard_size_and_offset``, then
``_local_shard_size_on_dim``; torch's tests call ``_split_tensor`` and
``_select_split_tensor``), and torch's reduce-op spelling ``Partial("prod")``: equal to
torch's own results over even, uneven and empty chunks. Local: no communication."""
from __future__ import annotations

import itertools

import pytest
import torch
from mpi4py import MPI
from torch.distributed.tensor import Shard as TorchShard

from helpers import assert_all_ranks
from mpidtensor import Partial, Shard
from mpidtensor.compat import importer

WORLD = MPI.COMM_WORLD


@pytest.fixture
def switched_names():
    """``compute_local_shape_and_global_offset`` as user code imports it under the switch."""
    importer.install()
    try:
        space = {"__name__": "user_program"}
        exec("from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as f", space)
    finally:
        importer.uninstall()
    return space["f"]


def _chunk_cases():
    return [(size, n, r) for size, n in itertools.product(range(0, 11), range(1, 6)) for r in range(n)]


def test_local_shard_size_and_offset_as_torch():
    wrong = []
    for size, n, r in _chunk_cases():
        want = TorchShard.local_shard_size_and_offset(size, n, r)
        got = {"static": Shard.local_shard_size_and_offset(size, n, r),
               "method": Shard(0)._local_shard_size_and_offset(size, n, r)}
        wrong += [f"{k}{(size, n, r)}: {v} != {tuple(want)}" for k, v in got.items() if tuple(v) != tuple(want)]
        # torch <= 2.7's _local_shard_size_on_dim (gone from 2.13): the same size and offset (an empty
        # piece past the end at offset `size`), the offset -1 unless asked for
        for return_offset in (False, True):
            old = Shard._local_shard_size_on_dim(size, n, r, return_offset=return_offset)
            if tuple(old) != (want[0], want[1] if return_offset else -1):
                wrong.append(f"_local_shard_size_on_dim{(size, n, r, return_offset)}: {old}")
    assert_all_ranks(not wrong, "; ".join(wrong[:10]))


def test_split_tensor_as_torch():
    wrong = []
    for shape, dim in [((7, 3), 0), ((2, 5), 1), ((1, 4), 0), ((0, 2), 0), ((4, 4, 3), 2)]:
        x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        for n, padding, contiguous in itertools.product(range(1, 6), (True, False), (True, False)):
            got = Shard(dim)._split_tensor(x, n, with_padding=padding, contiguous=contiguous)
            want = TorchShard(dim)._split_tensor(x, n, with_padding=padding, contiguous=contiguous)
            same = got[1] == want[1] and len(got[0]) == len(want[0]) and all(
                a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b) for a, b in zip(*(got[0], want[0])))
            for index in range(n):
                for clone in (True, False):
                    a = Shard(dim)._select_split_tensor(x, n, index, with_padding=padding, clone=clone)
                    b = TorchShard(dim)._select_split_tensor(x, n, index, with_padding=padding, clone=clone)
                    same = same and a.shape == b.shape and torch.equal(a, b)
            if not same:
                wrong.append(f"shape {shape} dim {dim} n {n} padding {padding} contiguous {contiguous}")
    assert_all_ranks(not wrong, "; ".join(wrong[:10]))


def test_partial_prod_is_product():
    p = Partial("prod")
    ok = p == Partial("product") and p.reduce_op == "product" and p.is_partial("prod") and hash(p) == hash(Partial("product"))
    assert_all_ranks(ok, repr(p))


def test_compute_local_shape_and_global_offset_as_torch(switched_names):
    """torch's ``_utils.compute_local_shape_and_global_offset`` as user code gets it under
    the switch, given mpidtensor's mesh and placements: torch's answer for torch's
    placements at the same coordinate (torch's own function, computed from the shape alone)."""
    from torch.distributed.tensor import _utils as torch_utils
    from torch.distributed.tensor.placement_types import Replicate as TR, _StridedShard as TSS

    import mpidtensor
    from mpidtensor import Replicate, _StridedShard

    ours = switched_names
    world = mpidtensor.init_device_mesh("cpu", (WORLD.size,))
    wrong = [] if ours.__module__ == "mpidtensor.compat.torch_utils" else [f"user code got {ours.__module__}'s"]
    cases = [((7, 5), [Shard(0)], [TorchShard(0)]), ((3, 5), [Shard(1)], [TorchShard(1)]),
             ((2,), [Shard(0)], [TorchShard(0)]), ((4, 4), [Replicate()], [TR()]),
             ((9, 2), [_StridedShard(0, split_factor=2)], [TSS(0, split_factor=2)])]
    for shape, mine, theirs in cases:
        got = ours(shape, world, mine)
        want = torch_utils._compute_local_shape_and_global_offset(shape, world.shape, lambda d: world._coord[d],
                                                                   theirs, False)
        if tuple(got[0]) != tuple(want[0]) or tuple(got[1]) != tuple(want[1]):
            wrong.append(f"{shape} {mine}: {got} != torch's {want}")
    assert_all_ranks(not wrong, "; ".join(wrong))
