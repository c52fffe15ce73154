"""The benchmark of record: mpidtensor against torch DTensor on gloo and hand-written mpi4py.

    mpiexec -n 4 python benchmarks/bench_record.py [--quick] [--out benchmarks/results]

One MPI job. Every redistribution on a 1-D mesh (and, at 4 ranks, a 2x2 mesh) at
4 KiB, 256 KiB, 4 MiB and 32 MiB of float32 per rank, with even shards and with
uneven ones (one more row than divides evenly); then dispatch per op on a cache hit.
Each cell is first checked against a plain torch reference built on every rank
from a fixed seed, then timed with the three implementations interleaved: each
repetition runs mpidtensor, torch and mpi4py once, each after a barrier, and a
time is the median over repetitions of the slowest rank. torch's DTensor gets a
gloo process group initialised from the MPI ranks (rank 0 picks the port).

Writes a table (stdout and ``<out>/record.md``), ``<out>/record.json`` and, when
matplotlib is installed, ``<out>/record.png`` (time against size, one panel per
transition, three lines each).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import mpidtensor as md

COMM = MPI.COMM_WORLD
N, RANK = COMM.size, COMM.rank
SIZES = {"4K": 4 << 10, "256K": 256 << 10, "4M": 4 << 20, "32M": 32 << 20}
LIBS = ("mpidtensor", "torch", "mpi4py")


# --- timing -------------------------------------------------------------------------------
def interleaved(fns: dict, budget: float) -> dict:
    """Median over repetitions of the slowest rank's seconds per call, for each of ``fns``,
    run in turn within each repetition; about ``budget`` seconds in all (3 to 200 reps)."""
    live = {k: f for k, f in fns.items() if f is not None}
    for f in live.values():
        f()
    start = time.perf_counter()
    for f in live.values():
        f()
    one = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
    reps = COMM.bcast(max(3, min(200, int(budget / max(one, 1e-6)))))
    calls = COMM.bcast(max(1, min(50, int(2e-3 / max(one, 1e-6)))))  # small cells: a batch per sample
    samples = {k: [] for k in live}
    for _ in range(reps):
        for k, f in live.items():
            COMM.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            samples[k].append((time.perf_counter() - t0) / calls)
    return {k: (COMM.allreduce(statistics.median(samples[k]), op=MPI.MAX) if k in samples else None) for k in fns}


def agreed(ok: bool, what: str) -> None:
    """Stop every rank if any rank's result differs from the reference."""
    if not COMM.allreduce(bool(ok), op=MPI.LAND):
        raise SystemExit(f"benchmark check failed: {what}")


# --- torch on gloo ------------------------------------------------------------------------
def init_gloo():
    """torch.distributed.tensor on gloo over these ranks, or None if it cannot start."""
    try:
        import torch.distributed as dist
        import torch.distributed.tensor as tdt
        from torch.distributed.device_mesh import init_device_mesh

        port = None
        if RANK == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = COMM.bcast(port)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=N)
        return tdt, init_device_mesh
    except Exception as err:  # noqa: BLE001 - the column is then left empty
        if RANK == 0:
            print(f"torch column skipped: {type(err).__name__}: {err}")
        return None


# --- the cases ----------------------------------------------------------------------------
def placements(lib, text: str):
    return [lib.Partial() if p == "P" else lib.Replicate() if p == "R" else lib.Shard(int(p[1]))
            for p in text.split(",")]


def reference(full: torch.Tensor, mesh_shape, coord, text: str, partial_part: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``full`` under ``text`` (torch.chunk layout, nested)."""
    local = full
    for size, c, p in zip(mesh_shape, coord, text.split(",")):
        if p.startswith("S"):
            chunks = local.chunk(size, int(p[1]))
            local = chunks[c] if c < len(chunks) else local.narrow(int(p[1]), 0, 0)
    return partial_part if "P" in text else local


def chunk_sizes(total: int, n: int) -> list[int]:
    """Lengths of torch.chunk's n pieces of ``total`` (empty ones included)."""
    sizes = [len(p) for p in torch.arange(total).chunk(n)]
    return sizes + [0] * (n - len(sizes))


class Case:
    """One redistribution: a global tensor, source and target placements on a mesh."""

    def __init__(self, mesh_shape, src, dst, nbytes, uneven):
        self.mesh_shape, self.src, self.dst, self.uneven = mesh_shape, src, dst, uneven
        per_rank = nbytes // 4
        cols = max(N, int(per_rank ** 0.5))
        cols -= cols % N
        rows = max(1, per_rank // cols) * (N if "P" not in src else 1)
        rows += 1 if uneven else 0
        self.shape = (rows, cols)
        self.name = f"{'2x2 ' if len(mesh_shape) == 2 else ''}[{src}] -> [{dst}]"


def one_d_cases(nbytes, uneven):
    pairs = [("S0", "R"), ("S1", "R"), ("S0", "S1"), ("R", "S0"), ("P", "R"), ("P", "S0")]
    return [Case((N,), s, d, nbytes, uneven) for s, d in pairs]


def two_d_cases(nbytes, uneven):
    if N != 4:
        return []
    pairs = [("S0,S0", "R,R"), ("S0,S1", "R,R"), ("P,P", "R,R"), ("R,S0", "S0,R"), ("S0,R", "S0,S1")]
    return [Case((2, 2), s, d, nbytes, uneven) for s, d in pairs]


class Mpi4py:
    """Hand-written mpi4py equivalents: the collective a programmer would call, on numpy."""

    def __init__(self):
        cart = COMM.Create_cart([2, 2]) if N == 4 else None
        self.sub = {(0,): cart.Sub([True, False]), (1,): cart.Sub([False, True])} if cart else {}
        self.coord2 = cart.Get_coords(RANK) if cart else None

    def comm(self, case, mesh_dim):
        return COMM if len(case.mesh_shape) == 1 else self.sub[(mesh_dim,)]

    def build(self, case, local_src, coord):
        """A callable doing the redistribution of ``local_src`` (numpy), or None."""
        src, dst = case.src.split(","), case.dst.split(",")
        x = np.ascontiguousarray(local_src.numpy())
        changed = [i for i, (a, b) in enumerate(zip(src, dst)) if a != b]
        if len(changed) == 1:
            i = changed[0]
            return self._one(self.comm(case, i), src[i], dst[i], x, coord[i], case)
        if case.src == "S0,S0":  # rank (i, j) holds block 2i + j: one world all-gather
            return self._gather(COMM, x, 0)
        if case.src == "P,P":
            out = np.empty_like(x)
            return lambda: (COMM.Allreduce(x, out), out)[1]
        return None

    def _one(self, comm, a, b, x, c, case):
        n = comm.size
        if a.startswith("S") and b == "R":
            return self._gather(comm, x, int(a[1]))
        if a == "R" and b.startswith("S"):
            d = int(b[1])
            start, size = sum(chunk_sizes(x.shape[d], n)[:c]), chunk_sizes(x.shape[d], n)[c]
            return lambda: x[start:start + size] if d == 0 else x[:, start:start + size]
        if a == "P" and b == "R":
            out = np.empty_like(x)
            return lambda: (comm.Allreduce(x, out), out)[1]
        if a == "P" and b.startswith("S"):
            counts = [r * x.shape[1] for r in chunk_sizes(x.shape[0], n)]
            out = np.empty(counts[comm.rank], np.float32)
            return lambda: (comm.Reduce_scatter(x, out, counts), out)[1]
        if a.startswith("S") and b.startswith("S"):
            return self._alltoall(comm, x, int(a[1]), int(b[1]))
        return None

    @staticmethod
    def _gather(comm, x, dim):
        rows = comm.allgather(x.shape[dim])
        inner = int(np.prod([s for i, s in enumerate(x.shape) if i != dim]))
        counts = [r * inner for r in rows]
        out = np.empty(sum(counts), np.float32)

        def run():
            send = x if dim == 0 else np.ascontiguousarray(x)
            if len(set(counts)) == 1:
                comm.Allgather(send, out)
            else:
                comm.Allgatherv(send, [out, counts])
            if dim != 0:  # pieces -> columns
                return np.concatenate([p.reshape(x.shape[0], -1) for p in np.split(out, np.cumsum(counts)[:-1])], 1)
            return out
        return run

    @staticmethod
    def _alltoall(comm, x, a, b):
        n = comm.size
        sizes = chunk_sizes(x.shape[b], n)
        starts = [sum(sizes[:k]) for k in range(n)]
        rows = comm.allgather(x.shape[a])
        send_counts = [s * x.shape[a] for s in sizes]
        recv_counts = [r * sizes[comm.rank] for r in rows]
        out = np.empty(sum(recv_counts), np.float32)

        def run():
            send = np.concatenate([x[:, s:s + k].ravel() for s, k in zip(starts, sizes)])
            if len(set(send_counts)) == 1 and len(set(recv_counts)) == 1:
                comm.Alltoall(send, out)
            else:
                comm.Alltoallv([send, send_counts], [out, recv_counts])
            return out
        return run


def run_case(case, md_mesh, torch_lib, mpi, budget):
    """Check and time one case; returns {lib: seconds or None}."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}{case.shape}".encode()))  # same on all ranks
    full = torch.randn(case.shape, generator=gen)
    mesh = md_mesh[case.mesh_shape]
    coord = mesh.get_coordinate()
    part = torch.randn(case.shape, generator=torch.Generator().manual_seed(1000 + RANK))
    total = torch.from_numpy(np.array(COMM.allreduce(part.numpy(), op=MPI.SUM))) if "P" in case.src else None
    local_src = reference(full, case.mesh_shape, coord, case.src, part)
    expect = reference(total if total is not None else full, case.mesh_shape, coord, case.dst, None)
    shape = torch.Size(case.shape)

    fns = {}
    src = md.DTensor.from_local(local_src, mesh, placements(md, case.src), shape=shape)
    dst = placements(md, case.dst)
    fns["mpidtensor"] = lambda: src.redistribute(mesh, dst).to_local()
    agreed(torch.allclose(fns["mpidtensor"](), expect, atol=1e-4), f"mpidtensor {case.name}")
    fns["torch"] = None
    if torch_lib is not None:
        tdt, tmesh_of = torch_lib
        tmesh = tmesh_of[case.mesh_shape]
        tsrc = tdt.DTensor.from_local(local_src, tmesh, placements(tdt, case.src), shape=shape,
                                      stride=tuple(full.stride()))
        tdst = placements(tdt, case.dst)

        def theirs():
            out = tsrc.redistribute(tmesh, tdst).to_local()
            wait = getattr(out, "wait", None)
            return wait() if wait else out
        got = theirs()
        agreed(torch.allclose(got, expect, atol=1e-4), f"torch {case.name}")
        fns["torch"] = theirs
    fns["mpi4py"] = mpi.build(case, local_src, coord)
    if fns["mpi4py"] is not None:
        got = fns["mpi4py"]()
        got = torch.as_tensor(np.asarray(got)).reshape(-1)
        agreed(got.numel() == expect.numel() and torch.allclose(got, expect.reshape(-1), atol=1e-4),
               f"mpi4py {case.name}")
    return interleaved(fns, budget)


def dispatch_rows(md_mesh, torch_lib, budget):
    """Per-op time on a cache hit, 64x64 per rank: mpidtensor, torch DTensor, plain torch."""
    full, weight = torch.randn(64 * N, 64), torch.randn(64, 64)
    mesh = md_mesh[(N,)]
    x, w = md.distribute_tensor(full, mesh, [md.Shard(0)]), md.distribute_tensor(weight, mesh, [md.Replicate()])
    local, shape = full[:64].clone(), full.shape

    def ops(lib, x, w, mesh, loc):
        return {
            "add": lambda: x + x, "mm (S(0) @ R)": lambda: torch.mm(x, w), "view": lambda: x.view(-1),
            "sum (-> Partial)": lambda: x.sum(),
            "from_local": (lambda: lib.DTensor.from_local(loc, mesh, [lib.Shard(0)], shape=shape,
                                                          stride=(64, 1))) if lib else (lambda: loc.view_as(loc)),
            "to_local": (lambda: x.to_local()) if lib else (lambda: loc),
        }
    rows = {name: {} for name in ops(md, x, w, mesh, local)}
    mine = ops(md, x, w, mesh, local)
    theirs = None
    if torch_lib is not None:
        tdt, tmesh_of = torch_lib
        tmesh = tmesh_of[(N,)]
        theirs = ops(tdt, tdt.distribute_tensor(full, tmesh, [tdt.Shard(0)]),
                     tdt.distribute_tensor(weight, tmesh, [tdt.Replicate()]), tmesh, local)
    plain = ops(None, local, weight, None, local)
    for name in rows:
        rows[name] = interleaved({"mpidtensor": mine[name], "torch": theirs and theirs[name],
                                  "mpi4py": plain[name]}, budget)
    return rows


# --- output -------------------------------------------------------------------------------
def fmt(t):
    if t is None:
        return "-"
    return f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def table(results, dispatch, header) -> str:
    lines = [header, "", "| transition | size/rank | shards | mpidtensor | torch gloo | mpi4py | md/mpi4py | torch/md |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        a, b, c = r["mpidtensor"], r["torch"], r["mpi4py"]
        lines.append(f"| {r['transition']} | {r['size']} | {r['shards']} | {fmt(a)} | {fmt(b)} | {fmt(c)} | "
                     f"{a / c:.2f} |" if a and c else
                     f"| {r['transition']} | {r['size']} | {r['shards']} | {fmt(a)} | {fmt(b)} | {fmt(c)} | - |")
        lines[-1] += f" {b / a:.1f} |" if a and b else " - |"
    ratios = [r["mpidtensor"] / r["mpi4py"] for r in results if r["mpidtensor"] and r["mpi4py"]
              and "[R] -> [S0]" not in r["transition"] and "[R,S0] -> [S0,R]" not in r["transition"]]
    if ratios:
        lines.append(f"\ngeometric mean md/mpi4py over {len(ratios)} communicating cells: "
                     f"{np.exp(np.mean(np.log(ratios))):.2f}")
    lines += ["", "dispatch per call on a cache hit, 64x64 per rank (mpi4py column: the plain torch op)", "",
              "| op | mpidtensor | torch DTensor | plain torch | torch/md |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in dispatch.items():
        a, b, c = r["mpidtensor"], r["torch"], r["mpi4py"]
        lines.append(f"| {name} | {fmt(a)} | {fmt(b)} | {fmt(c)} | {f'{b / a:.1f}' if a and b else '-'} |")
    return "\n".join(lines)


def plot(results, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = sorted({(r["transition"], r["shards"]) for r in results})
    cols = 4
    fig, axes = plt.subplots((len(names) + cols - 1) // cols, cols, figsize=(16, 3.2 * ((len(names) + cols - 1) // cols)))
    for ax, (name, shards) in zip(np.ravel(axes), names):
        rows = [r for r in results if r["transition"] == name and r["shards"] == shards]
        for lib, style in zip(LIBS, ("o-", "s--", "^:")):
            pts = [(SIZES[r["size"]], r[lib]) for r in rows if r[lib]]
            if pts:
                ax.loglog([p[0] for p in pts], [p[1] for p in pts], style, label=lib)
        ax.set_title(f"{name} ({shards})", fontsize=9)
        ax.set_xlabel("bytes per rank", fontsize=8)
        ax.set_ylabel("s", fontsize=8)
    for ax in np.ravel(axes)[len(names):]:
        ax.axis("off")
    np.ravel(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--budget", type=float, default=0.25, help="seconds of timing per cell")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ",".join(SIZES))
    args = parser.parse_args()
    started = time.time()
    torch.manual_seed(0)
    md_mesh = {(N,): md.init_device_mesh("cpu", (N,))}
    if N == 4:
        md_mesh[(2, 2)] = md.init_device_mesh("cpu", (2, 2))
    gloo = init_gloo()
    torch_lib = None
    if gloo is not None:
        tdt, init = gloo
        torch_lib = (tdt, {shape: init("cpu", shape) for shape in md_mesh})
    mpi = Mpi4py()
    results = []
    for size in args.sizes.split(","):
        for uneven in (False, True):
            for case in one_d_cases(SIZES[size], uneven) + two_d_cases(SIZES[size], uneven):
                times = run_case(case, md_mesh, torch_lib, mpi, args.budget)
                results.append({"transition": case.name, "size": size, "shards": "uneven" if uneven else "even",
                                "shape": list(case.shape), **times})
                if RANK == 0:
                    print(f"{case.name:28s} {size:>5s} {'uneven' if uneven else 'even':6s} "
                          + "  ".join(f"{k} {fmt(v):>10s}" for k, v in times.items()), flush=True)
    dispatch = dispatch_rows(md_mesh, torch_lib, args.budget)
    if RANK == 0:
        load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "?"
        header = (f"benchmark of record: {N} ranks, float32, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                  f"load average {' '.join(load)}, {time.time() - started:.0f} s")
        text = table(results, dispatch, header)
        print("\n" + text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "record.md").write_text(text + "\n")
        (out / "record.json").write_text(json.dumps({"ranks": N, "header": header, "redistribute": results,
                                                      "dispatch": dispatch}, indent=1))
        print(f"wrote {out}/record.md, record.json" + (", record.png" if plot(results, out / "record.png") else
                                                        " (no matplotlib: no plot)"))
    if gloo is not None:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
