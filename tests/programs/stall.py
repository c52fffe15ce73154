"""Two training steps of one parallelism in which, in the second, the last rank stops
(``sleep``) or dies (``kill``, SIGKILL) inside the step: the watchdog or the launcher
must end the job (tests/test_stalls.py).

    mpiexec -n N python stall.py PATH MODE [DIR]
    mpiexec -n 2 python -m mpidtensor.run stall.py switch MODE

PATH: fsdp (2 ranks), hsdp (4: 2 replicas x 2 shards, the rank stops in its backward),
tp (2), gpipe, 1f1b (2 stages on 2 ranks), zbv (4 stages in a V on 2 ranks), ring (ring
attention over 2 ranks, the rank stops before the ring's backward), async_save (the
rank's checkpoint writer stops while the others train on; DIR: where to write), switch
(``dist.all_reduce(async_op=True).wait()`` under ``python -m mpidtensor.run``), group_timeout
(an all-reduce on ``dist.new_group(timeout=2 s)``, the job's own timeout 300 s: the group's
ends it), wait_timeout (``irecv(...).wait(timeout=2 s)`` on rank 0 while the last rank has not
sent: torch's ``RuntimeError`` (a subclass), uncaught, ends the job). The rank prints ``STALL=<time>`` as it
stops.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
from mpi4py import MPI
from torch import nn

PATH, MODE = sys.argv[1], sys.argv[2]
WORLD = MPI.COMM_WORLD
STALLER = WORLD.size - 1
ARMED = [False]  # set for the second step


def stop() -> None:
    """On the last rank, in the armed step: stop answering, or die."""
    if ARMED[0] and WORLD.rank == STALLER:
        print(f"STALL={time.time()}", flush=True)
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)


class Stall(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stop()
        return x


class _StallBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        stop()
        return grad


class StallBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StallBackward.apply(x)


def layers(*extra: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), *extra, nn.Linear(16, 16), nn.Linear(16, 16))


def fsdp_steps(mesh_shape: tuple[int, ...], stall: nn.Module):
    from mpidtensor import init_device_mesh
    from mpidtensor.fsdp import fully_shard
    names = ("dp_replicate", "dp_shard")[-len(mesh_shape):]  # HSDP's mesh needs dim names (as torch's)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = layers(stall)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return sgd_steps(model)


def sgd_steps(model: nn.Module):
    """One SGD step of ``model`` on a fixed batch, as a function to call per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.ones(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    return step


def tp_steps():
    from mpidtensor import init_device_mesh
    from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (WORLD.size,))
    model = parallelize_module(layers(Stall()), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return sgd_steps(model)


def pipeline_steps(name: str):
    import mpidtensor.pipelining as pp
    from mpidtensor.pipelining.actions import rank_to_stages
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "zbv": pp.ScheduleZBVZeroBubble}[name]
    num_stages = WORLD.size * (2 if name == "zbv" else 1)
    mine = rank_to_stages(WORLD.size, num_stages, getattr(cls, "style", "loop"))[WORLD.rank]
    torch.manual_seed(0)
    stages = [pp.PipelineStage(nn.Sequential(nn.Linear(16, 16), Stall()), s, num_stages, "cpu") for s in mine]
    schedule = cls(stages if name == "zbv" else stages[0], 4, loss_fn=lambda out, y: nn.functional.mse_loss(out, y))
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)

    def step():
        schedule.step(*((torch.ones(8, 16),) if first else ()), target=torch.zeros(8, 16) if last else None)
    return step


def ring_steps():
    from mpidtensor import init_device_mesh
    from mpidtensor.experimental import context_parallel, set_rotate_method
    mesh = init_device_mesh("cpu", (WORLD.size,))
    set_rotate_method("alltoall")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * WORLD.size, 8) for _ in range(3))

    def step():
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            StallBackward()(out).sum().backward()  # stops before its ring's backward
    return step


def async_save_steps(directory: str):
    import mpidtensor.checkpoint as dcp
    from mpidtensor.checkpoint import async_saver
    train = fsdp_steps((WORLD.size,), nn.Identity())
    model_state = {}
    write = async_saver._write_in_background

    def stalled_write(*args):
        stop()  # in the writer thread of the last rank, while the others wait for it
        return write(*args)
    async_saver._write_in_background = stalled_write

    def step():
        train()
        if not model_state:
            model_state["state"] = {"step": torch.tensor(0)}
        future = dcp.async_save(model_state["state"], checkpoint_id=os.path.join(directory, f"ckpt{int(ARMED[0])}"))
        train()  # the training goes on while the checkpoint is written
        future.result()
    return step


def switch_steps():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(4)

    def step():
        stop()
        dist.all_reduce(t, async_op=True).wait()
    return step


def group_timeout_steps():
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    group = dist.new_group(timeout=timedelta(seconds=2))
    t = torch.ones(4)

    def step():
        stop()
        dist.all_reduce(t, group=group)
    return step


def wait_timeout_steps():
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo")
    t = torch.ones(4)

    def step():
        if WORLD.rank == 0:  # the healthy step waits as long as it takes (a loaded machine)
            dist.irecv(t, src=STALLER).wait(**({"timeout": timedelta(seconds=2)} if ARMED[0] else {}))
        elif WORLD.rank == STALLER:
            stop()
            dist.send(t, dst=0)
    return step


def steps():
    if PATH == "fsdp":
        return fsdp_steps((WORLD.size,), Stall())
    if PATH == "hsdp":
        return fsdp_steps((2, WORLD.size // 2), StallBackward())
    if PATH == "tp":
        return tp_steps()
    if PATH in ("gpipe", "1f1b", "zbv"):
        return pipeline_steps(PATH)
    if PATH == "ring":
        return ring_steps()
    if PATH == "async_save":
        return async_save_steps(sys.argv[3])
    if PATH == "switch":
        return switch_steps()
    if PATH == "group_timeout":
        return group_timeout_steps()
    if PATH == "wait_timeout":
        return wait_timeout_steps()
    raise SystemExit(f"unknown path {PATH!r}")


step = steps()
step()  # a healthy step: the report's previous wait
ARMED[0] = True
step()
print(f"rank {WORLD.rank} went on", flush=True)
