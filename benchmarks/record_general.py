"""Rows of the benchmark of record for DTensor's general path (``bench_record.py``).

* ``TP MLP (DTensor ops)``: the record's TP MLP written with DTensor ops and no module style,
  as torch's tests and generic DTensor programs write it: ``x`` (a plain tensor) made a
  ``Replicate`` DTensor by ``from_local``, ``x @ w1 + b1`` with ``w1`` ``Shard(1)`` and ``b1``
  ``Shard(0)``, GELU, ``@ w2`` with ``w2`` ``Shard(0)`` (a ``Partial`` sum), ``redistribute`` to
  ``Replicate``, ``+ b2``, ``to_local``, the summed squared error, backward. mpidtensor and
  torch's DTensor (gloo) run the same function; mpi4py: Megatron's step of ``record_steps``
  (two autograd functions, two ``Allreduce``).
* ``Shard(0) -> Shard(1), 256 KiB per rank``: the all-to-all cell of the redistribution table,
  the public path (``redistribute().to_local()``) against the bare ``Alltoall`` of the already
  packed pieces (mpi4py column) — the floor the issue names, no packing copy in it.

Every implementation is checked against one process (same seed) before it is timed.
"""
from __future__ import annotations

import importlib
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from record_steps import COMM, MLP_SIZES, N, RANK, StepRow, agreed, close, megatron_mlp, mlp_reference, mlp_step

import mpidtensor as md


def dtensor_mlp(lib, mesh, ref) -> tuple[Callable, list]:
    """(forward, [w1, b1, w2, b2] as DTensor leaves) of the MLP in DTensor ops of ``lib``
    (``mpidtensor`` or ``torch.distributed.tensor``): no module style, no local tensors."""
    rep = [lib.Replicate()]

    def param(t: torch.Tensor, placements) -> torch.Tensor:
        return lib.distribute_tensor(t.detach().clone(), mesh, placements).requires_grad_()
    w1 = param(ref[0].weight.t().contiguous(), [lib.Shard(1)])
    b1 = param(ref[0].bias, [lib.Shard(0)])
    w2 = param(ref[2].weight.t().contiguous(), [lib.Shard(0)])
    b2 = param(ref[2].bias, rep)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.matmul(lib.DTensor.from_local(x, mesh, rep), w1) + b1)
        y = torch.matmul(h, w2).redistribute(mesh, rep) + b2
        out = y.to_local()
        return out.wait() if hasattr(out, "wait") else out  # torch's AsyncCollectiveTensor
    return forward, [w1, b1, w2, b2]


def tp_mlp_ops_row(gloo) -> StepRow:
    """The TP MLP in DTensor ops: mpidtensor, torch's DTensor on gloo, Megatron's step."""
    batch, dim, hidden = MLP_SIZES
    x0, target, ref, ref_x, ref_y = mlp_reference()
    ref_grads = [ref[0].weight.grad.t(), ref[0].bias.grad, ref[2].weight.grad.t(), ref[2].bias.grad]
    fns: dict[str, Callable | None] = {"torch": None}
    libs = {"mpidtensor": (md, md.init_device_mesh)}
    if gloo and hidden % N == 0:  # torch's matmul rule reads a Shard of an uneven hidden dim as even
        libs["torch"] = (importlib.import_module("torch.distributed.tensor"), gloo[1])
    for name, (lib, mesh_factory) in libs.items():
        forward, params = dtensor_mlp(lib, mesh_factory("cpu", (N,)), ref)
        x = x0.clone().requires_grad_()
        step = mlp_step(forward, params, x, target)
        y = step()
        agreed(close(y, ref_y) and close(x.grad, ref_x.grad) and all(map(close, [p.grad for p in params], ref_grads)),
               f"TP MLP (DTensor ops), {name}")
        fns[name] = step
    forward, params, blocks = megatron_mlp(ref)
    x = x0.clone().requires_grad_()
    step = mlp_step(forward, params, x, target)
    step()
    agreed(close(x.grad, ref_x.grad), "TP MLP (DTensor ops), mpi4py")
    fns["mpi4py"] = step
    return StepRow(f"TP MLP (DTensor ops) {batch}x{dim}, hidden {hidden}, fwd+bwd", fns)


ALLTOALL_BYTES = 256 << 10  # per rank


def alltoall_row(gloo) -> StepRow:
    """``Shard(0) -> Shard(1)`` of float32 at 256 KiB per rank (the redistribution table's
    cell): mpidtensor's and torch's public path against the bare ``Alltoall`` of this rank's
    pieces packed once beforehand (the MPI call's own time, the issue's floor)."""
    cols = max(N, int((ALLTOALL_BYTES // 4) ** 0.5))  # the table's shape: 256 x 256 per rank at 4 ranks
    cols -= cols % N
    rows = ALLTOALL_BYTES // 4 // cols
    full = torch.randn(rows * N, cols, generator=torch.Generator().manual_seed(2))
    mine, want = full.chunk(N, 0)[RANK].contiguous(), full.chunk(N, 1)[RANK].contiguous()
    fns: dict[str, Callable | None] = {"torch": None}
    libs = {"mpidtensor": (md, md.init_device_mesh)}
    if gloo:
        libs["torch"] = (importlib.import_module("torch.distributed.tensor"), gloo[1])
    for name, (lib, mesh_factory) in libs.items():
        mesh = mesh_factory("cpu", (N,))
        src = lib.DTensor.from_local(mine, mesh, [lib.Shard(0)], shape=full.shape, stride=full.stride())

        def public(src=src, mesh=mesh, dst=[lib.Shard(1)]):
            out = src.redistribute(mesh, dst).to_local()
            return out.wait() if hasattr(out, "wait") else out
        agreed(torch.equal(public(), want), f"S(0) -> S(1) 256 KiB, {name}")
        fns[name] = public
    even = cols % N == 0
    packed = np.ascontiguousarray(mine.numpy().reshape(rows, N, cols // N).transpose(1, 0, 2)) if even else None
    out = np.empty((N * rows, cols // N), np.float32) if even else None

    def bare():
        COMM.Alltoall(packed, out)
        return out
    if even:
        agreed(np.array_equal(bare(), want.numpy()), "S(0) -> S(1) 256 KiB, bare Alltoall")
        fns["mpi4py"] = bare
    return StepRow(f"[S0] -> [S1] {ALLTOALL_BYTES >> 10} KiB/rank, {rows * N}x{cols} (mpi4py: bare Alltoall)", fns)


def general_rows(gloo) -> list[StepRow]:
    """The general path's rows, checked; ``gloo`` as for ``record_steps.step_rows``."""
    return [tp_mlp_ops_row(gloo), alltoall_row(gloo)]


def main(argv: list[str] | None = None) -> list[dict]:
    """These rows alone (``mpiexec -n 4 python benchmarks/record_general.py``), timed as the
    record times them; ``--no-torch``: without torch's column (no gloo group)."""
    import argparse
    import os

    import bench_record
    from bench_redistribute import init_gloo

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per row")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--check-only", action="store_true", help="check every implementation, time nothing")
    parser.add_argument("--row", choices=("all", "tp-mlp", "alltoall"), default="all",
                        help="time one row only (the TP MLP in DTensor ops, or the all-to-all cell)")
    args = parser.parse_args(argv)
    gloo = None if args.no_torch else init_gloo()
    rows = []
    chosen = {"all": general_rows, "tp-mlp": lambda g: [tp_mlp_ops_row(g)], "alltoall": lambda g: [alltoall_row(g)]}
    for row in chosen[args.row](gloo):
        times = bench_record.interleaved(row.fns, None if args.check_only else args.budget)
        rows.append({"step": row.name, **times, "checked": [k for k, f in row.fns.items() if f]})
        if RANK == 0 and not args.check_only:
            print(f"| {row.name} | " + bench_record.ratios(times["mpidtensor"], times["torch"], times["mpi4py"]),
                  flush=True)
    if RANK == 0:
        print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if gloo is not None:
        gloo[0].destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
