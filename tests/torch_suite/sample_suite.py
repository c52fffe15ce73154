"""A torch-style test file for the runner's own test (tests/test_torch_suite.py): one test
that passes, one that fails on one rank only (the others then block in ``destroy_pg``'s
barrier), one that hangs on one rank, one after the hang, one that checks torch's helpers see
the test file's DTensor, and a class that simulates ranks (not a multi-rank test)."""
import time

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor import common_dtensor
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase,
    LocalDTensorTestBase,
    with_comms,
)


class SampleTest(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_a_passes(self):
        mesh = self.build_device_mesh()
        x = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        self.assertEqual(x.to_local(), torch.arange(6.0)[3 * self.rank:3 * self.rank + 3])
        self.assertEqual(x.redistribute(mesh, [Replicate()]).to_local(), torch.arange(6.0))

    @with_comms
    def test_b_fails_on_one_rank(self):
        self.assertEqual(self.rank, 0)

    def test_c_hangs_on_one_rank(self):
        if self.rank == 1:
            time.sleep(3600)

    @with_comms
    def test_d_runs_after_the_hang(self):
        mesh = self.build_device_mesh()
        self.assertEqual(distribute_tensor(torch.ones(4), mesh, [Shard(0)]).full_tensor(), torch.ones(4))

    @with_comms
    def test_e_helpers_see_the_same_dtensor(self):
        self.assertIs(common_dtensor.DTensor, DTensor)
        self.assertIsInstance(common_dtensor.distribute_tensor(torch.ones(2), self.build_device_mesh(),
                                                               [Replicate()]), DTensor)


class SimulatedTest(LocalDTensorTestBase):
    def test_simulated(self):
        pass


if __name__ == "__main__":
    run_tests()
