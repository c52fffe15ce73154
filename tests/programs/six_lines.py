"""The simplest unmodified DTensor program: it imports only torch.distributed.tensor (issue 38)."""
import torch
from torch.distributed.tensor import distribute_tensor, init_device_mesh, Shard

mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
x = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
total = (x * 2).sum().full_tensor().item()
if torch.distributed.get_rank() == 0:
    print("CHECKSUM", total)
