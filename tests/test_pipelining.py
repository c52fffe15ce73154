"""Pipeline parallelism (mpidtensor.pipelining) against one process with the same seed:
losses of 3 steps, the last gradients and the parameters after SGD, for every schedule
with the pipeline over all ranks (one or two stages per rank)."""
from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidtensor.pipelining as pp
import pipeline_models as pm
from helpers import assert_all_ranks, assert_close
from mpidtensor.pipelining.actions import rank_to_stages, simulate
from mpidtensor.pipelining.interleaved import interleaved_order, looped_bfs_order
from mpidtensor.pipelining.single import gpipe_order, one_f_one_b_order
from mpidtensor.pipelining.vshape import dualpipev_order, zbv_order

WORLD = MPI.COMM_WORLD
P = WORLD.size

# (schedule, stages per rank, micro-batches as a function of the pipeline size)
SCHEDULES = [
    (pp.ScheduleGPipe, 1, lambda p: 3),
    (pp.ScheduleGPipe, 1, lambda p: 1),
    (pp.Schedule1F1B, 1, lambda p: p),
    (pp.Schedule1F1B, 1, lambda p: p + 1),
    (pp.ScheduleLoopedBFS, 2, lambda p: 3),
    (pp.ScheduleLoopedBFS, 1, lambda p: 2),
    (pp.ScheduleInterleaved1F1B, 2, lambda p: 2 * p),
    (pp.ScheduleInterleaved1F1B, 2, lambda p: 3),
    (pp.ScheduleInterleaved1F1B, 1, lambda p: p + 2),
    (pp.ScheduleInterleavedZeroBubble, 2, lambda p: 2 * p),
    (pp.ScheduleInterleavedZeroBubble, 2, lambda p: 3),
    (pp.ScheduleZBVZeroBubble, 2, lambda p: 2 * p),
    (pp.ScheduleZBVZeroBubble, 2, lambda p: 3),
    (pp.ScheduleDualPipeV, 2, lambda p: 2 * p),
    (pp.ScheduleDualPipeV, 2, lambda p: 2 * p + 3),
]


def _ids(case) -> str:
    cls, v, n = case
    return f"{cls.__name__}-v{v}-n{n(2)}"


def build(cls, v: int, group=None, size: int = P, rank: int = WORLD.rank, **stage_kwargs):
    """The model, this rank's stages and the schedule's style."""
    style = getattr(cls, "style", "loop")
    num_stages = size * v
    model = pm.make_model(num_stages)
    stages = [pp.PipelineStage(pm.stage_module(model, s, num_stages), s, num_stages, "cpu", group=group,
                               **stage_kwargs) for s in rank_to_stages(size, num_stages, style)[rank]]
    return model, stages, num_stages


@pytest.mark.quick_at(1)
def test_orders_run_to_completion() -> None:
    """Every schedule's orders, at 1-8 ranks and 1-16 micro-batches where the schedule
    allows them, complete without a rank waiting forever and run every F and backward
    once (a simulation of the runtime's dependencies)."""
    problems = []
    for size in (1, 2, 3, 4, 8):
        for n in range(1, 17):
            cases = {"GPipe": ([gpipe_order(r, n) for r in range(size)], size)}
            if n >= size:
                cases["1F1B"] = ([one_f_one_b_order(r, size, n) for r in range(size)], size)
            if n >= 2 * size:
                cases["DualPipeV"] = ([dualpipev_order(r, size, n) for r in range(size)], 2 * size)
            cases["ZBV"] = ([zbv_order(r, size, n) for r in range(size)], 2 * size)
            for v in (1, 2, 3):
                cases[f"LoopedBFS v{v}"] = ([looped_bfs_order(r, size, v, n) for r in range(size)], size * v)
                if n % max(1, n // size) == 0:
                    cases[f"Interleaved1F1B v{v}"] = ([interleaved_order(r, size, v, n) for r in range(size)], size * v)
                    cases[f"InterleavedZB v{v}"] = ([interleaved_order(r, size, v, n, True) for r in range(size)],
                                                    size * v)
            for name, (orders, num_stages) in cases.items():
                found = simulate(dict(enumerate(orders)), num_stages, n)
                problems += [f"{name} at {size} ranks, {n} micro-batches: {p}" for p in found[:1]]
    assert_all_ranks(not problems, "; ".join(problems[:5]))


@pytest.mark.parametrize("case", SCHEDULES, ids=_ids)
def test_schedule_matches_one_process(case) -> None:
    cls, v, n_of = case
    n_mb = n_of(P)
    model, stages, num_stages = build(cls, v)
    schedule = cls(stages[0] if issubclass(cls, pp.PipelineScheduleSingle) else stages, n_mb, loss_fn=pm.loss_fn)
    losses = pm.train(schedule, stages, n_mb)
    pm.check_against_reference(model, stages, losses, n_mb, num_stages)


def test_pipeline_split_matches_one_process() -> None:
    """``pipeline()`` cuts the model with torch's tracer; the stages train on MPI."""
    model = pm.make_model(P)
    reference = copy.deepcopy(model)
    x, _ = pm.batch(4)
    per = len(model) // P
    pipe = pp.pipeline(model, (x.chunk(4)[0],), split_spec={str(s * per): pp.SplitPoint.BEGINNING for s in range(1, P)})
    stage = pipe.build_stage(WORLD.rank, "cpu")
    losses = pm.train(pp.Schedule1F1B(stage, 4, loss_fn=pm.loss_fn), [stage], 4)
    pm.check_against_reference(reference, [stage], losses, 4, P)


def test_given_shapes_and_eval() -> None:
    """Stages given ``input_args`` / ``output_args`` (no inference); ``eval`` runs the
    forwards alone and returns the model's output on the last stage's rank."""
    example = torch.zeros(2, pm.WIDTH)
    model, stages, num_stages = build(pp.ScheduleGPipe, 1, input_args=example, output_args=example)
    schedule = pp.ScheduleGPipe(stages[0], 2, loss_fn=pm.loss_fn)
    pm.check_against_reference(model, stages, pm.train(schedule, stages, 2), 2, num_stages)
    x, y = pm.batch(2, seed=99)
    params = [p.detach().clone() for p in stages[0].submod.parameters()]
    losses: list = []
    out = schedule.eval(*((x,) if stages[0].is_first else ()), target=y if stages[0].is_last else None,
                        losses=losses)
    unchanged = all(torch.equal(a, b) for a, b in zip(params, stages[0].submod.parameters()))
    assert_all_ranks(unchanged, "eval changed parameters")
    if stages[0].is_last:
        assert_all_ranks(out is not None and out.shape == (4, pm.WIDTH) and len(losses) == 2, f"eval gave {out}")
    else:
        assert_all_ranks(out is None, "eval returned an output off the last stage")


class _Pair(nn.Module):
    """A stage passing on two tensors, one of them an integer mask (no gradient) and one
    Fortran-ordered (``stage`` makes it C-contiguous before it is sent)."""

    def __init__(self, first: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.first = first
        self.lin = nn.Linear(pm.WIDTH, pm.WIDTH).to(dtype)

    def forward(self, x, mask=None):
        if self.first:
            mask = (x > 0).to(torch.int64)
        h = torch.tanh(self.lin(x)) * (1 + mask)
        return h.t().contiguous().t(), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_several_tensors_per_hop(dtype) -> None:
    """One packed message carries each micro-batch's tensors (float and int64; bfloat16
    as bytes; a Fortran-ordered one) and the gradients come back for the float ones."""
    torch.manual_seed(3)
    mods = [_Pair(s == 0, dtype) for s in range(P)]
    stage = pp.PipelineStage(copy.deepcopy(mods[WORLD.rank]), WORLD.rank, P, "cpu")
    loss = lambda out, target: (out[0].float() - target).pow(2).mean()  # noqa: E731
    schedule = pp.ScheduleGPipe(stage, 2, loss_fn=loss)
    x, y = pm.batch(2)
    x = x.to(dtype)
    schedule.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
    # one process
    h, mask = x, None
    per = []
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        h, mask = xm, None
        for m in mods:
            h, mask = m(h, mask)
        per.append(loss((h, mask), ym))
    (sum(per) / 2).backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    assert_close(stage.submod.lin.weight.grad, mods[WORLD.rank].lin.weight.grad, **tol)


@pytest.mark.skipif(P != 4, reason="a 2x2 mesh needs 4 ranks")
def test_mesh_dim_group_2d() -> None:
    """``group=mesh["pp"]`` of a 2x2 ("dp", "pp") mesh: two pipelines of 2 side by side."""
    from mpidtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp_rank = mesh.get_local_rank("pp")
    model = pm.make_model(2)
    stage = pp.PipelineStage(pm.stage_module(model, pp_rank, 2), pp_rank, 2, "cpu", group=mesh["pp"])
    losses = pm.train(pp.Schedule1F1B(stage, 3, loss_fn=pm.loss_fn), [stage], 3)
    pm.check_against_reference(model, [stage], losses, 3, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_stages() -> None:
    """Stages on the GPU: activations staged through host memory or handed to a
    CUDA-aware MPI, as the collectives do."""
    device = torch.device("cuda", torch.cuda.current_device())
    model, stages, num_stages = build(pp.Schedule1F1B, 1)
    for st in stages:
        st.submod.to(device)
        st.device = device
    schedule = pp.Schedule1F1B(stages[0], max(2, P), loss_fn=pm.loss_fn)
    x, y = pm.batch(max(2, P))
    schedule.step(*((x.to(device),) if stages[0].is_first else ()), target=y.to(device) if stages[0].is_last else None)
    grads = [p.grad is not None and p.grad.is_cuda for p in stages[0].submod.parameters()]
    assert_all_ranks(all(grads), "no CUDA gradients")
