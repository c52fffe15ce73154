"""Bad input to the pipeline: the same clear error on every rank, and no rank left
waiting (a stage that raises in forward or backward notifies the others)."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidtensor.pipelining as pp
import pipeline_models as pm
from helpers import assert_all_ranks, raises_everywhere
from subjob import run_job

WORLD = MPI.COMM_WORLD
P = WORLD.size
RANK = WORLD.rank
needs_two = pytest.mark.skipif(P < 2, reason="needs a pipeline of 2+ ranks")


def stage_of(module: nn.Module | None = None, num_stages: int = P, index: int = RANK, **kwargs) -> pp.PipelineStage:
    model = pm.make_model(num_stages)
    return pp.PipelineStage(module or pm.stage_module(model, index, num_stages), index, num_stages, "cpu", **kwargs)


def step(schedule, stage, n_mb: int, rows_per_mb: int = 2, seed: int = 11) -> None:
    x, y = pm.batch(n_mb, rows_per_mb, seed)
    x = x[:n_mb * rows_per_mb]
    schedule.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)


def test_num_stages_not_group_size() -> None:
    raises_everywhere(ValueError, lambda: pp.ScheduleGPipe(stage_of(num_stages=P + 1, index=RANK), 2,
                                                           loss_fn=pm.loss_fn),
                      match=f"num_stages is {P + 1} but the pipeline group has {P} ranks x 1 stage(s)")


@needs_two
def test_microbatches_fewer_than_1f1b_needs() -> None:
    raises_everywhere(ValueError, lambda: pp.Schedule1F1B(stage_of(), P - 1, loss_fn=pm.loss_fn),
                      match=f"Schedule1F1B needs n_microbatches >= num_stages ({P})")


@needs_two
def test_microbatches_not_multiple_of_rounds() -> None:
    stages = [stage_of(num_stages=2 * P, index=s) for s in (RANK, RANK + P)]
    raises_everywhere(ValueError, lambda: pp.ScheduleInterleaved1F1B(stages, 2 * P + 1, loss_fn=pm.loss_fn),
                      match="multiple of the number of rounds")


def test_dualpipev_microbatches_and_stages_per_rank() -> None:
    v_stages = [stage_of(num_stages=2 * P, index=s) for s in (RANK, 2 * P - 1 - RANK)]
    raises_everywhere(ValueError, lambda: pp.ScheduleDualPipeV(v_stages, 2 * P - 1, loss_fn=pm.loss_fn),
                      match=f"ScheduleDualPipeV needs n_microbatches >= num_stages ({2 * P})")
    raises_everywhere(ValueError, lambda: pp.ScheduleZBVZeroBubble([stage_of()], 4, loss_fn=pm.loss_fn),
                      match="ScheduleZBVZeroBubble needs 2 stages per rank")


@needs_two
def test_ranks_disagree_on_microbatches() -> None:
    raises_everywhere(ValueError, lambda: pp.ScheduleGPipe(stage_of(), 2 + (RANK == 0), loss_fn=pm.loss_fn),
                      match="ranks disagree on the schedule")


@needs_two
def test_loss_fn_on_some_ranks_only() -> None:
    last = RANK == P - 1
    raises_everywhere(ValueError, lambda: pp.ScheduleGPipe(stage_of(), 2, loss_fn=pm.loss_fn if last else None),
                      match=f"loss_fn is given on ranks [{P - 1}] but not on ranks")


def test_batch_not_divisible() -> None:
    """At the first step (found while shapes are inferred) and at a later one (found by
    the step's agreement); the step after that runs."""
    stage = stage_of()
    schedule = pp.ScheduleGPipe(stage, 2, loss_fn=pm.loss_fn)
    odd = "has 5 rows along dim 0, which do not split into 2 equal micro-batches"
    x, y = pm.batch(3)
    bad = lambda: schedule.step(*((x[:5],) if stage.is_first else ()),  # noqa: E731
                                target=y[:4] if stage.is_last else None)
    raises_everywhere(ValueError, bad, match=odd)
    step(schedule, stage, 2)
    raises_everywhere(ValueError, bad, match=odd)
    step(schedule, stage, 2)


class _Changing(nn.Module):
    """Returns ``width`` columns: a test changes it between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(pm.WIDTH, pm.WIDTH)
        self.width = pm.WIDTH

    def forward(self, x):
        return self.lin(x)[:, :self.width]


@needs_two
def test_output_shape_changes_between_steps() -> None:
    module = _Changing() if RANK == 0 else nn.Sequential(nn.Linear(pm.WIDTH, pm.WIDTH))
    stage = stage_of(module)
    schedule = pp.ScheduleGPipe(stage, 2, loss_fn=pm.loss_fn)
    step(schedule, stage, 2)
    module.width = pm.WIDTH - 1
    raises_everywhere(ValueError, lambda: step(schedule, stage, 2),
                      match=f"stage 0 output changed since the first step: it sent [(2, {pm.WIDTH}) float32] "
                            f"and now gives [(2, {pm.WIDTH - 1}) float32]")


@needs_two
def test_given_inputs_do_not_match_what_is_sent() -> None:
    wrong = torch.zeros(2, pm.WIDTH + 1) if RANK == 1 else None
    stage = stage_of(input_args=wrong)
    schedule = pp.ScheduleGPipe(stage, 2, loss_fn=pm.loss_fn)
    raises_everywhere(ValueError, lambda: step(schedule, stage, 2),
                      match=f"stage 0 sends [(2, {pm.WIDTH}) float32] but stage 1 expects [(2, {pm.WIDTH + 1}) float32]")


class _Raising(nn.Module):
    """A stage that raises in forward (or, through a custom function, in backward) on
    micro-batch ``on`` of the armed step."""

    def __init__(self, where: str, on: int = 1) -> None:
        super().__init__()
        self.lin = nn.Linear(pm.WIDTH, pm.WIDTH)
        self.where, self.on, self.armed, self.calls = where, on, False, 0

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if self.armed and call == self.on and self.where == "forward":
            raise ValueError("boom in forward")
        return _Boom.apply(self.lin(x), self.armed and call == self.on and self.where == "backward")


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise ValueError("boom in backward")
        return grad, None


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("schedule_cls", [pp.ScheduleGPipe, pp.Schedule1F1B])
def test_stage_raises(where, schedule_cls) -> None:
    """The middle (or only) stage raises on micro-batch 1; every rank raises StageFailed
    naming it, and the next step runs on a fresh channel."""
    bad = P // 2
    module = _Raising(where) if RANK == bad else None
    stage = stage_of(module)
    n = max(2, P)
    schedule = schedule_cls(stage, n, loss_fn=pm.loss_fn)
    step(schedule, stage, n)
    if module is not None:
        module.armed, module.calls = True, 0
    raises_everywhere(pp.StageFailed, lambda: step(schedule, stage, n),
                      match=f"pipeline stage {bad} failed in its {where} of micro-batch 1: ValueError: boom in {where}")
    if module is not None:
        module.armed = False
    step(schedule, stage, n)
    assert_all_ranks(True)


@pytest.mark.quick_at(2)
def test_stage_raises_in_a_job_of_its_own(tmp_path) -> None:
    """In a 3-rank job of its own: the last stage raises in forward; every rank prints
    the same error and the job ends at once (no rank hangs)."""
    result = run_job("""
        import sys
        sys.path.insert(0, %r)
        from mpi4py import MPI
        import torch
        import mpidtensor.pipelining as pp
        import pipeline_models as pm
        W = MPI.COMM_WORLD
        model = pm.make_model(3)
        class Bad(torch.nn.Module):
            def forward(self, x):
                raise RuntimeError("last stage broke")
        mod = Bad() if W.rank == 2 else pm.stage_module(model, W.rank, 3)
        stage = pp.PipelineStage(mod, W.rank, 3, "cpu", output_args=torch.zeros(2, pm.WIDTH))
        schedule = pp.Schedule1F1B(stage, 3, loss_fn=pm.loss_fn)
        x, y = pm.batch(3)
        try:
            schedule.step(*((x,) if W.rank == 0 else ()), target=y if W.rank == 2 else None)
        except pp.StageFailed as err:
            print(f"rank {W.rank} raised: {err}", flush=True)
    """ % str(pytest.importorskip("pathlib").Path(__file__).parent), tmp_path, ranks=3, timeout=300)
    expected = "raised: pipeline stage 2 failed in its forward of micro-batch 0: RuntimeError: last stage broke"
    lines = [f"rank {r} {expected}" for r in range(3)]
    missing = [line for line in lines if line not in result.output]
    assert_all_ranks(result.returncode == 0 and not missing, f"rc {result.returncode}, missing {missing}: "
                                                              f"{result.output[-2000:]}")


class _Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(pm.WIDTH, pm.WIDTH) for _ in range(3))

    def forward(self, x):
        h = self.a(x)
        pp.pipe_split()
        h2 = self.b(h)
        pp.pipe_split()
        return self.c(h2) + h


def test_traced_skip_connection_refused() -> None:
    """Decided from the traced graph, which every rank has alike."""
    pipe = pp.pipeline(_Skip(), (torch.zeros(2, pm.WIDTH),))
    raises_everywhere(NotImplementedError, lambda: pp.build_stage(pipe.get_stage_module(2), 2, pipe.info(), "cpu"),
                      match="stage 2 of the traced pipeline takes inputs other than all of the previous stage's "
                            "outputs in order")


def test_get_schedule_class_by_torch_names() -> None:
    """torch's names, case-insensitive (torchtitan reads its schedule from a config
    string); an unknown name is a ValueError listing the choices."""
    names = {"1F1B": pp.Schedule1F1B, "gpipe": pp.ScheduleGPipe, "Interleaved1F1B": pp.ScheduleInterleaved1F1B,
             "LoopedBFS": pp.ScheduleLoopedBFS, "interleavedzerobubble": pp.ScheduleInterleavedZeroBubble,
             "ZBVZeroBubble": pp.ScheduleZBVZeroBubble, "DualPipeV": pp.ScheduleDualPipeV,
             "PipelineScheduleSingle": pp.PipelineScheduleSingle, "PipelineScheduleMulti": pp.PipelineScheduleMulti}
    wrong = [n for n, cls in names.items() if pp.get_schedule_class(n) is not cls]
    assert_all_ranks(not wrong, f"wrong classes for {wrong}")
    raises_everywhere(ValueError, lambda: pp.get_schedule_class("2F2B"), match="Unknown schedule name '2F2B'")
