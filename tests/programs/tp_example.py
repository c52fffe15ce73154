"""Tensor parallelism as in pytorch/examples' distributed/tensor_parallelism (a torch-only
program: torch's imports, old `_tensor` paths, WORLD_SIZE from the launcher): a two-layer
MLP, ColwiseParallel then RowwiseParallel, AdamW, 10 steps; rank 0 prints each loss.
Usage: tp_example.py [--device cpu] [--iters N]"""
import argparse
import os

import torch
import torch.nn as nn
from torch.distributed._tensor import DeviceMesh
from torch.distributed._tensor.device_mesh import init_device_mesh
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

world_size = int(os.environ["WORLD_SIZE"])
mesh = init_device_mesh(device_type=args.device, mesh_shape=(world_size,))
assert isinstance(mesh, DeviceMesh)
rank = mesh.get_rank()

torch.manual_seed(0)
model = ToyModel().to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.25, foreach=True)
model = parallelize_module(module=model, device_mesh=mesh,
                           parallelize_plan={"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
for i in range(args.iters):
    torch.manual_seed(i)
    inp = torch.rand(20, 10, device=args.device)
    loss = model(inp).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:
        print(f"LOSS {i} {loss.item():.8f}", flush=True)
