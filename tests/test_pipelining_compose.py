"""Pipeline parallelism composed with FSDP and TP: the Llama-style model of
examples/llama.py cut into stages (examples/llama_pp.py), each stage ``fully_shard``-ed
over mesh["dp"] and/or tensor-parallel over mesh["tp"], trained by mpidtensor's
schedules like one process: the losses of 3 AdamW steps, every gradient before each
step and every parameter after them, in float64. FSDP reduces gradients once per step
(``pipelining.fsdp_sync``), under the zero-bubble schedules too: the test counts the
reduce-scatters."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tier

from helpers import WORLD, CollectiveLog, assert_all_ranks, assert_close
from mpidtensor import DTensor, init_device_mesh

pipelining = pytest.importorskip("mpidtensor.pipelining")
if not hasattr(pipelining, "PipelineStage"):
    pytest.skip("mpidtensor.pipelining has no PipelineStage yet", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import LlamaConfig, batches, build_model, cross_entropy  # noqa: E402
from llama_pp import shard_stage, split_stages  # noqa: E402

STEPS = 3
SEQ = 8  # divides by tp
MICRO = 4  # micro-batches per step
TOL = dict(atol=1e-10, rtol=1e-9)
# 5 blocks: uneven over 2 and 4 stages; heads and KV heads divide by tp = 2
CFG = LlamaConfig(vocab_size=29, dim=16, n_layers=5, n_heads=4, n_kv_heads=2, hidden_dim=24, max_seq_len=SEQ)

# (pp, dp, tp); the residual crosses stages as a plain local tensor (the transport sends plain tensors)
LAYOUTS = [(2, 1, 1), (3, 1, 1), (2, 2, 1), (2, 1, 2), (4, 1, 1)]
SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
if tier.QUICK:  # one of each family: single, looped, V-shaped with a split backward
    SCHEDULES = ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(pp: int, dp: int, tp: int, virtual: int, v_shaped: bool):
    """This rank's pipeline stages (``virtual`` per rank, looped: rank r holds stages
    r, r + pp, ...; or V-shaped: r and 2 pp - 1 - r) of the float64 model, sharded; the meshes."""
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = mesh.get_local_rank("pp")
    indices = [rank, 2 * pp - 1 - rank] if v_shaped else [rank + v * pp for v in range(virtual)]
    stages = split_stages(build_model(CFG, seed=7).double(), pp * virtual, indices)
    for stage in stages:
        shard_stage(stage, tp_mesh=mesh["tp"], fsdp_mesh=mesh["dp"] if dp > 1 else None)
    return mesh, indices, stages


def _rows(tokens: torch.Tensor, mesh) -> torch.Tensor:
    return tokens.chunk(mesh.size(1))[mesh.get_local_rank("dp")]


@pytest.mark.every_case  # each world size runs its own layouts
@pytest.mark.parametrize("schedule_name", SCHEDULES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: "pp{}-dp{}-tp{}{}".format(*c, "-2x2" * (c == (2, 2, 1) or
                                                                                            c == (2, 1, 2))))
def test_pipeline_composition_matches_single_process(layout, schedule_name):
    pp, dp, tp = layout
    if pp * dp * tp != WORLD.size:
        pytest.skip(f"layout {layout[:3]} needs {pp * dp * tp} ranks")
    if not hasattr(pipelining, schedule_name):
        pytest.skip(f"mpidtensor.pipelining has no {schedule_name}")
    virtual = 1 if schedule_name in ("ScheduleGPipe", "Schedule1F1B") else 2
    mesh, indices, stages = _build(pp, dp, tp, virtual, schedule_name in V_SHAPED)
    num_stages = pp * virtual
    pipe_stages = [pipelining.PipelineStage(s, i, num_stages, "cpu", group=mesh["pp"]) for s, i in zip(stages, indices)]
    schedule_cls = getattr(pipelining, schedule_name)
    micro = max(MICRO, num_stages)  # DualPipeV needs one per stage

    def make():
        return schedule_cls(pipe_stages if virtual > 1 else pipe_stages[0], n_microbatches=micro, loss_fn=cross_entropy)
    schedule = make()
    first, last = 0 in indices, num_stages - 1 in indices
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ref = build_model(CFG, seed=7).double()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_params = dict(ref.named_parameters())
    losses, ref_losses, reduce_counts = [], [], []
    for _, tokens in zip(range(STEPS), batches(CFG, dp * micro, SEQ, seed=3)):
        rows = _rows(tokens, mesh)
        args = (rows[:, :-1],) if first else ()
        step_losses: list[torch.Tensor] = []
        with CollectiveLog() as log:
            schedule.step(*args, target=rows[:, 1:] if last else None, losses=step_losses if last else None)
        reduce_counts.append(log.calls.count("reduce_scatter"))
        mine = torch.stack(step_losses).mean().item() if last and mesh.get_local_rank("tp") == 0 else 0.0
        losses.append(WORLD.allreduce(mine) / dp)
        loss = cross_entropy(ref(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        ref_losses.append(loss.item())
        differ = {name: (_full(p.grad) - ref_params[name].grad).abs().max().item()
                  for s in stages for name, p in s.named_parameters()
                  if not torch.allclose(_full(p.grad), ref_params[name].grad, **TOL)}
        assert_all_ranks(not differ, f"gradients differ from one process: {differ}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    differ = {name: (_full(p.detach()) - ref_params[name].detach()).abs().max().item()
              for s in stages for name, p in s.named_parameters()
              if not torch.allclose(_full(p.detach()), ref_params[name].detach(), **TOL)}
    assert_all_ranks(not differ, f"parameters differ from one process: {differ}")
    if dp > 1:  # one reduce-scatter per FSDP unit with parameters (each block; the stage's own
        # embedding or norm and output) per step, not per micro-batch (nor per I or W)
        units = sum(len(s.layers) + (s.first or s.last) for s in stages)
        assert_all_ranks(all(n == units for n in reduce_counts), f"reduce-scatters per step {reduce_counts}, "
                                                                  f"expected {units}")


# --- the 4-D example --------------------------------------------------------------------------------
SMALL = ["--steps", "2", "--seq", "16", "--dim", "32", "--hidden", "64", "--vocab", "64", "--heads", "4",
         "--kv-heads", "2", "--layers", "2", "--no-memory", "--check", "--double", "--tol", "1e-9"]


@pytest.mark.parametrize("layout", [[], ["--pp", "2", "--cp", "2", "--tp", "1"]], ids=["default", "pp2xcp2-2x2"])
def test_train_4d_example_matches_single_process(layout):
    """examples/train_4d.py: its default layout for this world size (pp 2, and tp 2 at 4
    ranks), and PP x CP (2x2, ring attention inside each stage)."""
    import train_4d

    if WORLD.size % 2 or (layout and WORLD.size != 4):
        pytest.skip("the default layout pipelines over 2 ranks; pp 2 x cp 2 needs 4")
    result = train_4d.run(train_4d.parse_args(SMALL + layout), say=lambda *a: None)
    assert_all_ranks(result.max_diff <= 1e-9, f"largest difference from one process {result.max_diff}")
    assert_all_ranks(len(result.bubble_mean) == 2 and all(0 <= b < 1 for b in result.bubble_max), f"{result}")
    assert_all_ranks(result.losses[1] < result.losses[0], f"loss did not fall: {result.losses}")


FOUR_D = """
    import sys
    sys.path.insert(0, {examples!r})
    import train_4d
    from mpi4py import MPI
    for layout in (["--pp", "2", "--dp", "1", "--cp", "2", "--tp", "2"], ["--pp", "2", "--dp", "2", "--cp", "1", "--tp", "2"]):
        result = train_4d.run(train_4d.parse_args({small!r} + layout), say=lambda *a: None)
        if MPI.COMM_WORLD.rank == 0:
            print("LAYOUT", layout, "DIFF", result.max_diff, "LOSSES", result.losses, flush=True)
"""


@pytest.mark.timeout(1000)  # an 8-rank job on shared cores (its own timeout: 900 s)
@pytest.mark.quick_at(1)
def test_4d_mesh_at_8_ranks(tmp_path):
    """The (pp, dp, cp, tp) mesh at 8 ranks (a job of its own, oversubscribed): pp x cp x tp
    and pp x dp x tp, each 2, against one process in float64. Its own job runs once (from
    the one-rank run of the suite)."""
    from subjob import run_job

    if WORLD.size != 1:
        pytest.skip("the 8-rank job is started once, from the one-rank run")
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    result = run_job(FOUR_D.format(examples=examples, small=SMALL), tmp_path, ranks=8, timeout=900)
    diffs = [float(line.split("DIFF ")[1].split()[0]) for line in result.output.splitlines()
             if line.startswith("LAYOUT")]
    assert_all_ranks(result.returncode == 0 and len(diffs) == 2 and max(diffs) <= 1e-9,
                     f"rc {result.returncode}, differences {diffs}\n{result.output[-3000:]}")
