"""DTensors crossing pipeline stages (``pipelining.crossing``), as torch 2.13 passes them:
each stage tensor-parallel over its copy of mesh["tp"] of a ("pp", "tp") world mesh, its
outputs a sequence-sharded activation (``Shard(1)``, 7 positions: uneven over 2 ranks,
so tensor-parallel peers send local tensors of different shapes) and a ``Partial``
summary, rebuilt as DTensors on the next stage's mesh. Losses, every gradient and the
parameters after 3 AdamW steps equal one process's, in float64."""
from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidtensor.pipelining as pp
import tier
from helpers import assert_all_ranks, assert_close, raises_everywhere
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_module, init_device_mesh
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD = MPI.COMM_WORLD
P = WORLD.size
PP, TP = (P // 2, 2) if P % 2 == 0 and P >= 4 else (P, 1)
VOCAB, DIM, HIDDEN, SEQ = 11, 8, 12, 7
MICRO, ROWS, STEPS = 4, 2, 3
TOL = dict(atol=1e-10, rtol=1e-9)
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
             "ScheduleZBVZeroBubble"]
if tier.QUICK:  # a single, and a V-shaped one with a same-rank hand-over and a split backward
    SCHEDULES = ["Schedule1F1B", "ScheduleZBVZeroBubble"]
needs_pipeline = pytest.mark.skipif(P < 2, reason="a pipeline needs two ranks")


class Stage(nn.Module):
    """Tokens (first stage) or ``(h, summary)`` in; ``(h, summary)`` (or logits, last) out:
    ``h`` the residual stream, ``summary`` its mean over the sequence."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: torch.Tensor, summary: torch.Tensor | None = None):
        if self.first:
            h = self.down(torch.tanh(self.up(self.embed(x))))
        else:
            x = x + 0.5 * summary.unsqueeze(1)
            h = x + self.down(torch.tanh(self.up(x)))
        if self.last:
            return self.head(h)
        return h, h.sum(dim=1) / SEQ


def _plan(stage: Stage) -> dict:
    seq = Replicate() if stage.first else Shard(1)
    plan = {"up": ColwiseParallel(input_layouts=seq, use_local_output=False),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    if stage.last:
        plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def _model(num_stages: int) -> nn.ModuleList:
    torch.manual_seed(5)
    return nn.ModuleList(Stage(s == 0, s == num_stages - 1) for s in range(num_stages)).double()


def _reference_forward(model: nn.ModuleList, tokens: torch.Tensor) -> torch.Tensor:
    out = model[0](tokens)
    for stage in model[1:]:
        out = stage(*out)
    return out


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _setup(schedule_name: str, **stage_kwargs):
    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    virtual = 1 if schedule_name in ("ScheduleGPipe", "Schedule1F1B") else 2
    num_stages = PP * virtual
    rank = mesh.get_local_rank("pp")
    indices = [rank, 2 * PP - 1 - rank] if schedule_name in V_SHAPED else [rank + v * PP for v in range(virtual)]
    model = _model(num_stages)
    modules = [parallelize_module(copy.deepcopy(model[i]), mesh["tp"], _plan(model[i])) for i in indices]
    stages = [pp.PipelineStage(m, i, num_stages, "cpu", group=mesh["pp"], **stage_kwargs)
              for m, i in zip(modules, indices)]
    cls = getattr(pp, schedule_name)
    schedule = cls(stages if virtual > 1 else stages[0], n_microbatches=MICRO, loss_fn=_loss)
    return mesh, model, indices, modules, stages, schedule


@needs_pipeline
@pytest.mark.parametrize("schedule_name", SCHEDULES)
def test_dtensors_cross_stages_like_one_process(schedule_name: str) -> None:
    mesh, model, indices, modules, stages, schedule = _setup(schedule_name)
    num_stages = len(model)
    first, last = 0 in indices, num_stages - 1 in indices
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-2)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (MICRO * ROWS, SEQ + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        step_losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=step_losses if last else None)
        mine = torch.stack(step_losses).mean().item() if last and mesh.get_local_rank("tp") == 0 else 0.0
        losses.append(WORLD.allreduce(mine))
        ref = _loss(_reference_forward(model, x), y)
        ref.backward()
        ref_losses.append(ref.item())
        differ = {f"{i}.{n}": (_full(p.grad) - model[i].get_parameter(n).grad).abs().max().item()
                  for i, m in zip(indices, modules) for n, p in m.named_parameters()
                  if not torch.allclose(_full(p.grad), model[i].get_parameter(n).grad, **TOL)}
        assert_all_ranks(not differ, f"gradients differ from one process: {differ}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    differ = [f"{i}.{n}" for i, m in zip(indices, modules) for n, p in m.named_parameters()
              if not torch.allclose(_full(p.detach()), model[i].get_parameter(n).detach(), **TOL)]
    assert_all_ranks(not differ, f"parameters differ from one process: {differ}")


@needs_pipeline
def test_received_dtensors_keep_their_layout() -> None:
    """What a stage receives is a DTensor on its own copy of mesh["tp"], with the sender's
    placements and global shape; its input gradient goes back in those placements."""
    mesh, model, indices, modules, stages, schedule = _setup("Schedule1F1B")
    stage = stages[0]
    tokens = torch.randint(0, VOCAB, (MICRO * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))

    def step() -> None:
        schedule.step(*((tokens[:, :-1],) if stage.is_first else ()), target=tokens[:, 1:] if stage.is_last else None)
    step()  # the first step also runs a middle stage once to find its output shapes
    seen = []
    if not stage.is_first:
        stage.submod.register_forward_pre_hook(lambda module, args: seen.append(args))
    step()
    problems = []
    for h, summary in seen:
        if not (isinstance(h, DTensor) and h.device_mesh is mesh["tp"] and h.placements == (Shard(1),)
                and h.shape == (ROWS, SEQ, DIM)):
            problems.append(f"h: {h!r}")
        if not (isinstance(summary, DTensor) and summary.placements == (Partial(),) and summary.shape == (ROWS, DIM)):
            problems.append(f"summary: {summary!r}")
    assert_all_ranks(stage.is_first or (len(seen) == MICRO and not problems), "; ".join(problems[:2]) or f"{len(seen)}")


@needs_pipeline
def test_get_mesh_that_finds_nothing() -> None:
    """A ``get_mesh`` that returns None for a received DTensor's mesh: ``ValueError`` naming
    the mesh on every rank at the first step."""
    mesh, model, indices, modules, stages, schedule = _setup("Schedule1F1B", get_mesh=lambda names, layout: None)
    stage = stages[0]
    tokens = torch.randint(0, VOCAB, (MICRO * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    raises_everywhere(ValueError, lambda: schedule.step(*((tokens[:, :-1],) if stage.is_first else ()),
                                                        target=tokens[:, 1:] if stage.is_last else None),
                      match="get_mesh returned None")


@needs_pipeline
def test_get_mesh_names_the_mesh() -> None:
    """``get_mesh(dim_names, layout)`` as torch's stages call it (the layout None here): a
    program that slices its world mesh by the names gets its own copy, and trains."""
    calls = []

    def get_mesh(names, layout):
        calls.append((names, layout))
        return world[names]
    world = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    world["tp"]  # slicing is collective: done on every rank, so the callback's slice is a lookup
    mesh, model, indices, modules, stages, schedule = _setup("Schedule1F1B", get_mesh=get_mesh)
    stage = stages[0]
    tokens = torch.randint(0, VOCAB, (MICRO * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    schedule.step(*((tokens[:, :-1],) if stage.is_first else ()), target=tokens[:, 1:] if stage.is_last else None)
    want = [] if stage.is_first else [(("tp",), None)] * 2
    assert_all_ranks(calls == want, f"get_mesh called with {calls}")


@needs_pipeline
@pytest.mark.parametrize("failure", ["raises", "returns another mesh"])
def test_get_mesh_failing_on_one_rank_raises_on_every_rank(failure: str) -> None:
    """A ``get_mesh`` that fails on the last rank only (at 4 ranks: one of the last stage's
    two tensor-parallel ranks) raises ``ValueError`` naming the stage on every rank, the
    other ranks of that stage included, instead of leaving them waiting."""
    world = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    world["tp"]

    def get_mesh(names, layout):
        if WORLD.rank != WORLD.size - 1:
            return world[names]
        if failure == "raises":
            raise KeyError(f"no mesh named {names}")
        return world

    mesh, model, indices, modules, stages, schedule = _setup("Schedule1F1B", get_mesh=get_mesh)
    stage = stages[0]
    tokens = torch.randint(0, VOCAB, (MICRO * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    match = "get_mesh raised KeyError" if failure == "raises" else "not a copy of that mesh"
    raises_everywhere(ValueError, lambda: schedule.step(*((tokens[:, :-1],) if stage.is_first else ()),
                                                        target=tokens[:, 1:] if stage.is_last else None),
                      match=match)


class Narrow(nn.Module):
    """A stage whose output is sharded by rows over ``tp``, one row per micro-batch: the
    second tensor-parallel rank sends an empty local tensor and gets an empty gradient back."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):  # the batch, on the first stage
            x = DTensor.from_local(x, self.lin.weight.device_mesh, [Replicate()], run_check=False)
        h = torch.tanh(self.lin(x.redistribute(placements=[Replicate()])))
        if self.last:
            return h.redistribute(placements=[Replicate()]).sum(dim=1)
        return h.redistribute(placements=[Shard(0)])


@needs_pipeline
def test_empty_shards_cross_stages() -> None:
    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    rank = mesh.get_local_rank("pp")
    torch.manual_seed(9)
    model = nn.ModuleList(Narrow(s == 0, s == PP - 1) for s in range(PP)).double()
    module = parallelize_module(copy.deepcopy(model[rank]), mesh["tp"],
                                {"lin": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    stage = pp.PipelineStage(module, rank, PP, "cpu", group=mesh["pp"])
    schedule = pp.Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=lambda out, y: ((out - y) ** 2).sum())
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(MICRO, DIM, generator=gen, dtype=torch.float64), torch.randn(MICRO, generator=gen,
                                                                                   dtype=torch.float64)
    seen = []
    if not stage.is_first:
        module.register_forward_pre_hook(lambda m, args: seen.append(args[0]._local_tensor.shape))
    losses: list[torch.Tensor] = []
    schedule.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None,
                  losses=losses if stage.is_last else None)
    h = x
    for m in model:
        h = torch.tanh(m.lin(h))
    ref = ((h.sum(dim=1) - y) ** 2)
    ref.sum().backward()
    tp_rank = mesh.get_local_rank("tp")
    problems = []
    if stage.is_last and not torch.allclose(_full(torch.stack(losses)).flatten(), ref.detach(), **TOL):
        problems.append(f"losses {losses} vs {ref}")
    for n, p in module.named_parameters():
        want = model[rank].get_parameter(n).grad / MICRO
        if not torch.allclose(_full(p.grad), want, **TOL):
            problems.append(f"{n}: {(_full(p.grad) - want).abs().max().item()}")
    if not stage.is_first and TP > 1 and seen and tuple(seen[0]) != ((1 if tp_rank == 0 else 0), DIM):
        problems.append(f"stage {rank} received local shape {tuple(seen[0])} at tp rank {tp_rank}")
    assert_all_ranks(not problems, "; ".join(problems))


class Batched(nn.Module):
    """A stage whose parameters are replicated DTensors on ``dp`` and whose batch comes as
    DTensors sharded by rows over ``dp`` (torchtitan's ``full_dtensor`` inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor) and x.placements != (Shard(0),):
            raise ValueError(f"the stage expects rows sharded over dp, got {x.placements}")
        return torch.tanh(self.lin(x))


@needs_pipeline
@pytest.mark.parametrize("schedule_name", ["Schedule1F1B", "ScheduleGPipe"])
def test_dtensor_batch_splits_into_local_rows(schedule_name: str) -> None:
    """A DTensor batch and target are split as torch splits them: each rank's rows into
    micro-batches, the placements kept (not a global ``chunk``, which would move the
    shard); the last stage's outputs merge back in the batch's row order. The losses' sum,
    the output and the gradients equal one process's on the whole batch. Local rows that do
    not split into the micro-batches are refused on every rank."""
    pp_size, dp = (P // 2, 2) if P % 2 == 0 and P >= 4 else (P, 1)
    mesh = init_device_mesh("cpu", (pp_size, dp), mesh_dim_names=("pp", "dp"))
    rank = mesh.get_local_rank("pp")
    torch.manual_seed(11)
    model = nn.ModuleList(Batched() for _ in range(pp_size)).double()
    module = distribute_module(copy.deepcopy(model[rank]), mesh["dp"])
    stage = pp.PipelineStage(module, rank, pp_size, "cpu", group=mesh["pp"])
    loss_fn = lambda out, y: ((out - y) ** 2).sum()  # noqa: E731
    micro = max(2, pp_size)  # 1F1B needs a micro-batch per stage
    schedule = getattr(pp, schedule_name)(stage, n_microbatches=micro, loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(4)
    x, y = (torch.randn(2 * micro * dp, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    rows = x.shape[0] // dp
    here = slice(mesh.get_local_rank("dp") * rows, (mesh.get_local_rank("dp") + 1) * rows)
    x_d, y_d = (DTensor.from_local(t[here], mesh["dp"], [Shard(0)]) for t in (x, y))
    losses: list[torch.Tensor] = []
    out = schedule.step(*((x_d,) if stage.is_first else ()), target=y_d if stage.is_last else None,
                        losses=losses if stage.is_last else None)
    h = x
    for m in model:
        h = m(h)
    ref = loss_fn(h, y)
    ref.backward()
    problems = []
    if stage.is_last and not torch.allclose(_full(torch.stack(losses).sum()), ref.detach(), **TOL):
        problems.append(f"losses {losses} vs {ref}")
    if stage.is_last and not (isinstance(out, DTensor) and out.placements == (Shard(0),)
                              and torch.allclose(out.full_tensor(), h.detach(), **TOL)):
        problems.append(f"the merged output {out!r} is not the batch's, in its rows' order")
    for n, p in module.named_parameters():
        want = model[rank].get_parameter(n).grad / micro
        if not torch.allclose(_full(p.grad), want, **TOL):
            problems.append(f"{n}: {(_full(p.grad) - want).abs().max().item()}")
    assert_all_ranks(not problems, "; ".join(problems))
    odd = DTensor.from_local(torch.zeros(2 * micro + 1, DIM, dtype=torch.float64), mesh["dp"], [Shard(0)])
    raises_everywhere(ValueError, lambda: schedule.step(*((odd,) if stage.is_first else ()),
                                                        target=y_d if stage.is_last else None),
                      match="which do not split into")
