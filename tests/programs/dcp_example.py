"""Distributed checkpointing as in PyTorch's tutorial "Getting Started with Distributed
Checkpoint" (a torch-only program): an FSDP2 model and its optimizer wrapped in a
`Stateful` whose state_dict comes from `get_state_dict`, `dcp.save` after training,
then a fresh model and optimizer restored by `dcp.load` and trained on. Rank 0 prints
the losses before and after the restore (they continue as if never interrupted).
Usage: dcp_example.py CHECKPOINT_DIR [--backend gloo]"""
import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard


class AppState(Stateful):
    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def build(seed):
    torch.manual_seed(seed)
    model = fully_shard(ToyModel())
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train(model, optimizer, steps, first):
    for step in range(first, first + steps):
        torch.manual_seed(step)
        batch = torch.rand(12, 16).chunk(dist.get_world_size())[dist.get_rank()]
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"LOSS {step} {total.item():.8f}", flush=True)


def main(args):
    dist.init_process_group(args.backend)
    model, optimizer = build(0)
    train(model, optimizer, 3, 0)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=args.checkpoint_dir)
    model, optimizer = build(1)  # other weights: the load must replace them
    state = {"app": AppState(model, optimizer)}
    dcp.load(state_dict=state, checkpoint_id=args.checkpoint_dir)
    train(model, optimizer, 3, 3)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("--backend", default="gloo")
    main(parser.parse_args())
