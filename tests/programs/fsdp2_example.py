"""FSDP2 training as in pytorch/examples' distributed/FSDP2 (a torch-only program):
`init_process_group` with the backend named on the command line, LOCAL_RANK from the
launcher, a small transformer built on the meta device, `fully_shard` per block and at
the root, `to_empty` + `reset_parameters` (or, with --cpu-init, built on the CPU), Adam, `clip_grad_norm_`; at the end the full
model state dict by `get_model_state_dict(full_state_dict=True, cpu_offload=True)`.
Rank 0 prints each loss and the checksum of the full state dict.
Usage: fsdp2_example.py [--backend gloo] [--device cpu] [--mixed-precision] [--cpu-init] [--iters N]"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))

    def reset_parameters(self):
        for m in (self.norm1, self.norm2, self.qkv, self.proj, self.up, self.down):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, vocab, dim, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))

    def reset_parameters(self):
        self.embed.reset_parameters()
        self.norm.reset_parameters()
        self.out.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:{local_rank}")
    dist.init_process_group(backend=args.backend)
    torch.manual_seed(0)
    vocab, batch, seq = 64, 12, 16  # the global batch, split among the ranks
    with torch.device("cpu" if args.cpu_init else "meta"):
        model = Transformer(vocab, 32, 4, 3)
    kwargs = {}
    if args.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    assert isinstance(model, FSDPModule)
    if not args.cpu_init:
        model.to_empty(device=device)
        torch.manual_seed(0)
        model.reset_parameters()
    for param in model.parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    dist.barrier()
    for step in range(args.iters):
        torch.manual_seed(100 + step)
        tokens = torch.randint(0, vocab, (batch, seq), device=device)
        mine = tokens.chunk(dist.get_world_size())[dist.get_rank()]
        logits = model(mine)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mine.roll(-1, 1).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        if dist.get_rank() == 0:
            print(f"LOSS {step} {total.item() / dist.get_world_size():.8f}", flush=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        print(f"CHECKSUM {sum(t.double().abs().sum().item() for t in full.values()):.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--cpu-init", action="store_true", help="build the model on the CPU, not the meta device")
    parser.add_argument("--iters", type=int, default=4)
    main(parser.parse_args())
