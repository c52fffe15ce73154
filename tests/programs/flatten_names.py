"""accelerate's ParallelismConfig mesh (accelerate/parallelism_config.py, build_device_mesh):
a 4-D mesh ("dp_replicate", "dp_shard", "cp", "tp"), its data-parallel dims flattened twice
under two names, then looked up by name from the root. Prints, per rank, the ranks and
names of every mesh it looks up, and an all-reduce over each (a torch-only program: run
under the switch and on torch's gloo, the outputs must be equal).
Usage: flatten_names.py DP_REPLICATE DP_SHARD CP TP"""
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

warnings.simplefilter("ignore")  # torch: "Slicing a flattened dim from root mesh will be deprecated"
dist.init_process_group("gloo")
sizes = tuple(int(a) for a in sys.argv[1:5])
names = ("dp_replicate", "dp_shard", "cp", "tp")
mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
dp = mesh[("dp_replicate", "dp_shard")]._flatten("dp")
dp_shard_cp = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
dp_cp = mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")
again = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
lines = [f"same mesh when flattened again: {again is dp_shard_cp}",
         f"names: {dp.mesh_dim_names} {dp_shard_cp.mesh_dim_names} {dp_cp.mesh_dim_names}"]
for key in ["dp", "dp_shard_cp", "dp_cp", "tp", ("dp_replicate", "dp_shard_cp")]:
    sub = mesh[key]
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=sub.get_group(0))
    lines.append(f"{key}: ranks {sub.mesh.tolist()} names {sub.mesh_dim_names} coord {list(sub.get_coordinate())} "
                 f"sum {total.item()}")
try:
    mesh[("dp_replicate", "tp")]._flatten("dp")
    lines.append("dp for other dims: accepted")
except ValueError:
    lines.append("dp for other dims: ValueError")
try:
    mesh["no_such_dim"]
    lines.append("unknown name: accepted")
except KeyError as err:
    lines.append(f"unknown name: KeyError naming the dims: {all(n in str(err) for n in names)}")
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, lines)
if dist.get_rank() == 0:
    for rank, mine in enumerate(everyone):
        for line in mine:
            print(f"RANK {rank} {line}")
dist.destroy_process_group()
