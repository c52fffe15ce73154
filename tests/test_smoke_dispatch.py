import torch
from op_check import check_op
from helpers import global_tensor
from mpidtensor import Replicate, Shard, Partial


def test_add_mul_shard(mesh1d):
    a = global_tensor((5, 7))
    b = global_tensor((5, 7), seed=2)
    for pa in ([Shard(0)], [Shard(1)], [Replicate()]):
        for pb in ([Shard(0)], [Shard(1)], [Replicate()], None):
            check_op(lambda x, y: (x + y) * y, [a, b], [pa, pb], mesh1d)
