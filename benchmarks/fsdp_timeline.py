"""Per-rank timeline of one FSDP training step, and how much communication hides behind compute.

    mpiexec -n 4 python benchmarks/fsdp_timeline.py [--layers 4] [--width 1024] [--rows 64] [--steps 5] [--out DIR]

The model is ``record_steps.LinearStack`` (bias-free ``Linear(width, width)`` layers),
every layer and the root ``fully_shard``-ed over all ranks; a step is forward, backward
and AdamW. The groups' methods are wrapped (in this script only) to time-stamp, per rank:
when each all-gather and reduce-scatter starts, the span its wait blocks (``wait``; with
progress ``off`` FSDP's reduce-scatter is the blocking call, counted whole as a wait), and
each layer's forward compute. Overlap fraction = 1 - (time blocked in waits) / (the same
collectives' time run alone, start then wait at once): 0 when every byte moves inside
the waits, 1 when all of it moved during compute. Each progress mode of
``mesh/progress.py`` (off, MPI_Test from the FSDP hooks, a progress thread) runs in
turn within each repetition, so all see the same machine load.

Prints the text timeline of each rank's last step (hooks mode) and the figures; writes
``<out>/fsdp_timeline.png`` when matplotlib is installed. ``measure`` returns the figures.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import record_steps as rs  # noqa: E402

import mpidtensor as md  # noqa: E402
from mpidtensor.fsdp.group import ShardedState  # noqa: E402
from mpidtensor.runtime import progress  # noqa: E402
from mpidtensor.comm.nonblocking import ireduce_scatter  # noqa: E402

COMM = MPI.COMM_WORLD
N, RANK = COMM.size, COMM.rank


class Recorder:
    """Time-stamped events of the running step: (kind, label, start, end) in seconds."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def span(self, kind: str, label: str, start: float) -> None:
        self.events.append((kind, label, start, self.now()))

    def instrument(self, model: torch.nn.Module) -> None:
        """Wrap every FSDP group of ``model`` and time each layer's forward."""
        for i, layer in enumerate(model.layers):
            self._wrap_group(layer._fsdp_state.group, f"L{i}")
            starts: dict[int, float] = {}
            layer.register_forward_pre_hook(lambda *_, i=i, s=starts: s.__setitem__(i, self.now()))
            layer.register_forward_hook(lambda *_, i=i, s=starts: self.span("compute", f"fwd L{i}", s[i]),
                                        prepend=True)

    def _wrap_group(self, group, label: str) -> None:
        start_unshard, finish_unshard = group.start_unshard, group.finish_unshard
        start_reduce, finish_reduce = group._start_reduce, group.finish_reduce

        def start_gather():
            idle = group.sharded_state in (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD)
            start_unshard()
            if idle and group.sharded_state is ShardedState.UNSHARDING:
                self.span("ag start", label, self.now())

        def finish_gather():
            t = self.now()
            waits = group.sharded_state is not ShardedState.UNSHARDED
            finish_unshard()
            if waits:
                self.span("ag wait", label, t)

        def start_rs(params):
            t = self.now()
            start_reduce(params)
            if progress.mode() == "off":  # the reduce-scatter is the blocking call: all of it blocked
                self.span("rs wait", label, t)
            self.span("rs start", label, self.now())

        def finish_rs():
            t = self.now()
            pending = group._pending is not None
            finish_reduce()
            if pending:
                self.span("rs wait", label, t)
        group.start_unshard, group.finish_unshard = start_gather, finish_gather
        group._start_reduce, group.finish_reduce = start_rs, finish_rs


def alone(model: torch.nn.Module, reps: int = 5) -> float:
    """Seconds of one step's collectives run alone: each group's all-gather (twice, as
    forward and backward do) and a reduce-scatter of its gradient bytes, start then wait."""
    total = 0.0
    for layer in model.layers:
        group = layer._fsdp_state.group
        grads = torch.zeros(sum(p.shard_numel for p in group.gathered) * N)
        samples = []
        for _ in range(reps):
            COMM.Barrier()
            t = time.perf_counter()
            for _ in range(2):
                group.start_unshard()
                group.finish_unshard()
                group.reshard()
            ireduce_scatter(grads, group.info.shard_comm).wait()
            samples.append(time.perf_counter() - t)
        total += statistics.median(samples)
    return total


def measure(layers: int, width: int, rows: int, steps: int, modes: tuple[str, ...] = progress.MODES) -> dict:
    """Per progress mode (``mesh.progress``), steps interleaved with the other modes: step
    time, time blocked in waits (slowest rank, medians), overlap fraction against the
    collectives run alone, and this rank's events of its last step."""
    model = rs.sharded_stack("mpidtensor", md.init_device_mesh, layers, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + RANK)
    batch = (torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen))
    rs.adam_step(model, opt, batch)  # lazy init, forward order recorded
    rec = Recorder()
    rec.instrument(model)
    before = progress.mode()
    samples = {m: ([], [], []) for m in modes}  # step times, wait times, events
    for _ in range(steps):
        for m in modes:
            progress.set_mode(m)
            COMM.Barrier()
            rec.events, rec.origin = [], time.perf_counter()
            rs.adam_step(model, opt, batch)
            samples[m][0].append(rec.now())
            samples[m][1].append(sum(e - s for kind, _, s, e in rec.events if kind.endswith("wait")))
            samples[m][2][:] = rec.events
    progress.set_mode(before)
    comm_alone = COMM.allreduce(alone(model), op=MPI.MAX)
    out = {"comm_alone_s": comm_alone}
    for m, (step_times, wait_times, events) in samples.items():
        step = COMM.allreduce(statistics.median(step_times), op=MPI.MAX)
        waits = COMM.allreduce(statistics.median(wait_times), op=MPI.MAX)
        out[m] = {"step_s": step, "wait_s": waits, "overlap": max(0.0, 1 - waits / comm_alone), "events": events}
    return out


def text_timeline(events, width: int = 100) -> str:
    """One line per event, bar scaled to the step."""
    end = max(e for *_, e in events) or 1.0
    lines = []
    for kind, label, s, e in sorted(events, key=lambda ev: ev[2]):
        a, b = int(s / end * width), max(int(e / end * width), int(s / end * width) + 1)
        lines.append(f"{kind:9} {label:7} {s * 1e3:8.2f} {e * 1e3:8.2f} ms |{' ' * a}{'#' * (b - a)}")
    return "\n".join(lines)


def plot(all_events: list, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"compute": "tab:green", "ag wait": "tab:red", "rs wait": "tab:orange"}
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(all_events)))
    for rank, events in enumerate(all_events):
        for kind, label, s, e in events:
            if kind in colors:
                ax.broken_barh([(s * 1e3, max((e - s) * 1e3, 0.05))], (rank - 0.4, 0.8), color=colors[kind])
            else:  # a start: a tick
                ax.plot([s * 1e3] * 2, [rank - 0.45, rank + 0.45], color="tab:blue" if kind == "ag start" else "tab:purple")
    ax.set_xlabel("ms since step start")
    ax.set_ylabel("rank")
    ax.set_title("FSDP step: green forward compute, red all-gather wait, orange reduce-scatter wait, "
                 "ticks collective starts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=rs.STACK[0])
    parser.add_argument("--width", type=int, default=rs.STACK[1])
    parser.add_argument("--rows", type=int, default=rs.STACK[2], help="batch rows per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--modes", nargs="+", default=list(progress.MODES), choices=progress.MODES)
    args = parser.parse_args(argv)
    result = measure(args.layers, args.width, args.rows, args.steps, tuple(args.modes))
    shown = "hooks" if "hooks" in args.modes else args.modes[0]
    all_events = COMM.gather(result[shown]["events"])
    if RANK == 0:
        for rank, events in enumerate(all_events):
            print(f"--- rank {rank}, last step, progress {shown}\n{text_timeline(events)}")
        args.out.mkdir(parents=True, exist_ok=True)
        drawn = plot(all_events, args.out / "fsdp_timeline.png")
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        print(f"{N} ranks, {args.layers} x Linear({args.width}), {args.rows} rows/rank, median of {args.steps}, "
              f"load average {load}; collectives alone {result['comm_alone_s'] * 1e3:.1f} ms"
              + ("" if drawn else " (no matplotlib: no plot)"))
        print("| progress | step ms | blocked in waits ms | overlap fraction |")
        print("| --- | ---: | ---: | ---: |")
        for m in args.modes:
            r = result[m]
            print(f"| {m} | {r['step_s'] * 1e3:.1f} | {r['wait_s'] * 1e3:.1f} | {r['overlap']:.2f} |")
    return result


if __name__ == "__main__":
    main()
