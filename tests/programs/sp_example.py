"""Sequence parallelism as in pytorch/examples' sequence_parallel_example (a torch-only
program): the MLP's input and output sharded on the sequence dim (dim 0 here), Colwise
with `input_layouts=Shard(0)` and Rowwise with `output_layouts=Shard(0)`; rank 0 prints
each loss. Usage: sp_example.py [--device cpu] [--iters N]"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--iters", type=int, default=10)
args = parser.parse_args()

mesh = init_device_mesh(device_type=args.device, mesh_shape=(int(os.environ["WORLD_SIZE"]),))
torch.manual_seed(0)
model = parallelize_module(
    module=ToyModel().to(args.device), device_mesh=mesh,
    parallelize_plan={"in_proj": ColwiseParallel(input_layouts=Shard(0)),
                      "out_proj": RowwiseParallel(output_layouts=Shard(0))})
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
for i in range(args.iters):
    torch.manual_seed(i)
    inp = torch.rand(12, 10, device=args.device)  # the global batch: each rank feeds its rows
    local = inp.chunk(mesh.size())[mesh.get_local_rank()]
    out = model(local)
    loss = out.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        print(f"LOSS {i} {total.item():.8f}", flush=True)
