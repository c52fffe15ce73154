import pytest
import torch

from mpidtensor import Partial, Replicate, Shard
from mpidtensor.tensor.layout import chunk_sizes, local_shape_and_offset, nested_sizes
from mpidtensor.tensor.placements import normalize_placements


def test_equality_hash_repr():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and Shard(0) != Replicate()
    assert Replicate() == Replicate() and Partial() == Partial("sum") and Partial("max") != Partial()
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum")}) == 3
    assert [repr(p) for p in (Shard(0), Replicate(), Partial(), Partial("avg"))] == ["S(0)", "R", "P(sum)", "P(avg)"]
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicate() and Partial("min").is_partial("min") and not Partial().is_partial("max")


@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "product"])
def test_partial_ops(op):
    assert Partial(op).reduce_op == op


def test_bad_placements():
    with pytest.raises(ValueError, match="reduce_op"):
        Partial("mean")
    with pytest.raises(TypeError):
        Shard(1.5)
    with pytest.raises(ValueError, match="out of range"):
        normalize_placements([Shard(2)], 1, 2)
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        normalize_placements([Shard(0)], 2, 2)
    with pytest.raises(TypeError):
        normalize_placements(["S(0)"], 1, 2)
    assert normalize_placements([Shard(-1), Replicate()], 2, 3) == (Shard(2), Replicate())


@pytest.mark.parametrize("length", range(0, 14))
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_chunk_sizes_follow_torch_chunk(length, parts):
    pieces = [c.numel() for c in torch.arange(length).chunk(parts)] if length else []
    assert list(chunk_sizes(length, parts)) == pieces + [0] * (parts - len(pieces))


def test_nested_layout():
    # 5 rows over a 2x2 mesh, both mesh dims sharding dim 0: [3, 2] then [2, 1], [1, 1]
    assert nested_sizes(5, [2, 2]) == [2, 1, 1, 1]
    placements = (Shard(0), Shard(0))
    spans = [local_shape_and_offset((5, 3), placements, (2, 2), (i, j)) for i in range(2) for j in range(2)]
    assert spans == [((2, 3), (0, 0)), ((1, 3), (2, 0)), ((1, 3), (3, 0)), ((1, 3), (4, 0))]
