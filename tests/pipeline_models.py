"""Shared builders for the pipelining tests: a model cut into stages, its training in one
process (the reference), and the same training through a schedule."""
from __future__ import annotations

import copy

import torch
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks

WORLD = MPI.COMM_WORLD
WIDTH = 6


def make_model(num_stages: int, layers_per_stage: int = 2, seed: int = 7) -> nn.Sequential:
    """A stack of Linear + Tanh blocks, ``layers_per_stage`` Linears per stage."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(num_stages * layers_per_stage):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def stage_module(model: nn.Sequential, stage: int, num_stages: int) -> nn.Sequential:
    """Stage ``stage``'s part of ``model``, as a copy."""
    per = len(model) // num_stages
    return copy.deepcopy(model[stage * per:(stage + 1) * per])


def batch(n_mb: int, rows_per_mb: int = 2, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = n_mb * rows_per_mb
    return torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def reference(model: nn.Module, n_mb: int, steps: int = 3, lr: float = 0.1):
    """Losses (per step, per micro-batch), the last step's gradients and the parameters
    after ``steps`` SGD steps, trained in one process with the batch cut as the schedule
    cuts it (mean loss: gradients divided by the micro-batch count)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(n_mb, seed=11 + step)
        opt.zero_grad()
        per = [loss_fn(model(xm), ym) for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb))]
        (sum(per) / n_mb).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(torch.stack([p.detach() for p in per]))
    return losses, grads, dict(model.named_parameters())


def train(schedule, stages: list, n_mb: int, steps: int = 3, lr: float = 0.1):
    """The same training through ``schedule``: losses on the last stage's rank (else None),
    and this rank's stages."""
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    losses = []
    first = any(st.is_first for st in stages)
    last = any(st.is_last for st in stages)
    for step in range(steps):
        x, y = batch(n_mb, seed=11 + step)
        opt.zero_grad()
        got: list = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=got if last else None)
        opt.step()
        losses.append(torch.stack([g.detach() for g in got]) if last else None)
    return losses


def check_against_reference(model: nn.Module, stages: list, losses: list, n_mb: int, num_stages: int) -> None:
    """Collective: losses, last gradients and parameters of this rank's stages match the
    one-process reference."""
    ref_losses, ref_grads, ref_params = reference(model, n_mb)
    problems = []
    if losses[0] is not None:
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                problems.append(f"losses of step {step}: {got.tolist()} != {want.tolist()}")
    for st in stages:
        for full, p in st.submod.named_parameters():  # a Sequential's slice keeps the model's names
            if not torch.allclose(p.grad, ref_grads[full], rtol=1e-5, atol=1e-6):
                problems.append(f"gradient of {full} (stage {st.stage_index})")
            if not torch.allclose(p.detach(), ref_params[full].detach(), rtol=1e-5, atol=1e-6):
                problems.append(f"parameter {full} (stage {st.stage_index})")
    assert_all_ranks(not problems, "; ".join(problems))
