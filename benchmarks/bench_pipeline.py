"""Pipeline schedules: mpidtensor against torch's ``torch.distributed.pipelining`` on gloo,
a hand-written loop on mpi4py, and the ideal.

    mpiexec -n 4 python benchmarks/bench_pipeline.py [--width 512] [--layers 4] [--rows 32]
        [--microbatches 8] [--steps 5] [--reps 3] [--out benchmarks/results]
        [--schedules 1F1B,InterleavedZeroBubble] [--impls mdt,hand]

Every rank holds one stage (two for the interleaved, looped and V schedules, each with
half the layers, so that a rank's compute is the same): ``--layers`` bias-free
``Linear(width, width)`` + tanh, the same on every stage, so that the ideal step, with
no bubble and free communication, is ``microbatches x`` one stage's forward and backward
of one micro-batch (timed alone on every rank at once; the slowest rank). A step is the
schedule's forward and backward of ``microbatches`` micro-batches of ``rows`` rows (a
mean-square loss on the last stage), without the optimizer.

* **mdt**: each schedule class of ``mpidtensor.pipelining`` that exists;
* **torch**: the same schedule of ``torch.distributed.pipelining`` on gloo, in the same job;
* **hand**: GPipe and 1F1B written directly on mpi4py (``Irecv`` / ``Isend`` of the
  tensors' numpy views, one message per hop), the floor an implementation can reach.

Beside each row, ``calls``: the Python calls of one step on rank 0 (``sys.setprofile``,
as ``record_steps.python_calls`` counts them; mdt's and torch's schedules, the hand loop):
a figure of the step's CPU work that machine load does not move; and ``cpu ms``: the CPU
time of one step summed over the ranks (``time.process_time``, median of the steps),
polling inside MPI included. With more ranks than cores the step's wall time is about
this sum divided by the cores, so it shows what a schedule costs where its bubble does
not matter (a waiting rank leaves its core to a computing one).

The bubble fraction is measured from per-rank timelines: each stage records when its
forward and backward run (mdt and torch: each backward action of the pipeline stage, whole
``B``, input ``I`` or weight ``W``; hand: from the arrival of the output's gradient to the
first layer's weight gradient), and a rank's bubble is the share of the step it did not
compute; the table gives the mean over the ranks, beside the theory: the schedule's own
action lists run with free communication and costs ``F = I = W = 1``, ``B = 2`` (for GPipe,
1F1B and Interleaved 1F1B this is ``(p - 1) / (v m + p - 1)``). The implementations run
in turn within each repetition (the same machine load for all); the table gives medians.

A second table times one stage's backward of one micro-batch alone (the V-shaped
schedules' stage, half a rank's layers; every rank at once, the slowest rank's median):
whole (``torch.autograd.backward``), split as mdt's zero-bubble schedules run it (``I``
then ``W``, :mod:`mpidtensor.pipelining.split_backward`, through a stage's ``Splitter``,
which plans the graph's shape once), and split by walking the graph
twice (``I`` as ``autograd.grad(..., retain_graph=True)``, ``W`` as a second backward
restricted to the parameters: mdt before the split, the reference).

A third table splits one mdt step's CPU time on each rank by part (:func:`action_cpu`): the
stage's ``F``, ``B``, ``I`` and ``W``, the channel's receive waits (polling included), posts
and sends, and the rest (the schedule's own loop): what a rank with two stages pays twice;
beside it each rank's minor page faults per step (``getrusage``): memory the allocator gave
back to the kernel and takes again (glibc trims its heap when a freed block of a gradient's
size leaves enough free at its top), which moves a rank's backward CPU from run to run.

A schedule that refuses ``--microbatches`` (DualPipeV needs one per stage, ``2 x ranks``)
is skipped and named under the table.

Prints the table; writes ``<out>/<name>.md``, ``<name>.json`` and, with matplotlib,
``<name>_timeline.png`` (every rank's forward and backward spans in one 1F1B step of each
implementation); ``--name`` defaults to ``pipeline``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from llama_pp import Timeline  # noqa: E402
from record_steps import python_calls  # noqa: E402
from text_table import print_table  # noqa: E402

import mpidtensor  # noqa: E402,F401  (MPI set up as the rest of the benchmarks have it)
import mpidtensor.pipelining as mdt_pp  # noqa: E402
from mpidtensor.pipelining.split_backward import Splitter  # noqa: E402
from mpidtensor.testing.gloo import init_gloo_process_group  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, P = COMM.rank, COMM.size
SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
COST = {"F": 1, "I": 1, "W": 1, "B": 2}  # relative compute of each action, for the theoretical bubble
HAND = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}


class Stage(nn.Module):
    """``layers`` x (Linear + tanh); records its forward spans on ``timeline``, and its
    backward spans while ``marks_backward`` (the hand-written loops; mdt's and torch's
    backward actions are timed at their stage, :func:`time_backward_actions`)."""

    def __init__(self, width: int, layers: int, timeline: Timeline, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        for layer in self.layers:
            layer.weight.data = torch.randn(width, width, generator=gen) / width ** 0.5
        self.timeline = timeline
        self.marks_backward = True
        # the first layer's weight gradient is the stage's last backward work
        self.layers[0].weight.register_post_accumulate_grad_hook(
            lambda p: self.timeline.backward_end() if self.marks_backward else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.timeline.forward_start()
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.marks_backward:
            x = self.timeline.mark_backward_start(x)
        self.timeline.forward_end()
        return x


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def stage_indices(name: str) -> list[int]:
    """The stages this rank holds under schedule ``name`` (looped, or V-shaped)."""
    if name in ("ScheduleGPipe", "Schedule1F1B"):
        return [RANK]
    if name in V_SHAPED:
        return [RANK, 2 * P - 1 - RANK]
    return [RANK, RANK + P]


def build(name: str, args, timeline: Timeline) -> list[Stage]:
    v = len(stage_indices(name))
    return [Stage(args.width, args.layers // v, timeline, seed=s) for s in stage_indices(name)]


# --- the hand-written loops ---------------------------------------------------------------------
def hand_step(order: str, stage: Stage, xs: list, targets: list, shape: tuple) -> None:
    """One step of GPipe or 1F1B on one stage per rank, on mpi4py directly."""
    m, sends, saved = len(xs), [], {}

    def forward(mb: int) -> None:
        if RANK == 0:
            x = xs[mb]
        else:
            buf = np.empty(shape, np.float32)
            COMM.Irecv([buf, MPI.FLOAT], source=RANK - 1, tag=mb).Wait()
            x = torch.from_numpy(buf).requires_grad_()
        out = stage(x)
        if RANK == P - 1:
            out = mse(out, targets[mb])
        else:
            sends.append(COMM.Isend([out.detach().numpy(), MPI.FLOAT], dest=RANK + 1, tag=mb))
        saved[mb] = (x, out)

    def backward(mb: int) -> None:
        x, out = saved.pop(mb)
        if RANK == P - 1:
            out.backward()
        else:
            grad = np.empty(shape, np.float32)
            COMM.Irecv([grad, MPI.FLOAT], source=RANK + 1, tag=m + mb).Wait()
            out.backward(torch.from_numpy(grad))
        if RANK > 0:
            sends.append(COMM.Isend([x.grad.numpy(), MPI.FLOAT], dest=RANK - 1, tag=m + mb))

    warmup = m if order == "gpipe" else min(P - RANK - 1, m)
    for mb in range(warmup):
        forward(mb)
    for mb in range(m - warmup):
        forward(warmup + mb)
        backward(mb)
    for mb in range(m - warmup, m):
        backward(mb)
    MPI.Request.Waitall(sends)


# --- one implementation's steps -----------------------------------------------------------------
def make_runner(impl: str, name: str, args, timeline: Timeline):
    """A function running one step of schedule ``name`` in implementation ``impl``."""
    stages = build(name, args, timeline)
    m, shape = args.microbatches, (args.rows, args.width)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randn(m * args.rows, args.width, generator=gen)
    target = torch.randn(m * args.rows, args.width, generator=gen)
    indices = stage_indices(name)
    first, last = 0 in indices, len(indices) * P - 1 in indices
    if impl == "hand":
        xs, ts = list(batch.chunk(m)), list(target.chunk(m))
        return lambda: hand_step(HAND[name], stages[0], xs, ts, shape)
    if impl == "mdt":
        lib = mdt_pp
    else:
        import torch.distributed.pipelining as lib
    num_stages = len(indices) * P
    pipe = [lib.PipelineStage(s, i, num_stages, torch.device("cpu")) for s, i in zip(stages, indices)]
    for s, st in zip(stages, pipe):
        s.marks_backward = False
        time_backward_actions(st, timeline)
    schedule = getattr(lib, name)(pipe[0] if name in HAND else pipe, n_microbatches=m, loss_fn=mse)

    def step() -> None:
        schedule.step(*((batch,) if first else ()), target=target if last else None)
        for s in stages:
            s.zero_grad(set_to_none=True)
    step.theory = simulated_bubble(schedule.pipeline_order, num_stages) if impl == "mdt" else None
    step.schedule, step.stages = schedule, pipe
    return step


def time_backward_actions(stage, timeline: Timeline) -> None:
    """Record each backward action of pipeline ``stage`` (mdt's or torch's: both name them
    ``backward_one_chunk`` and ``backward_weight_one_chunk``) as a backward span."""
    for method in ("backward_one_chunk", "backward_weight_one_chunk"):
        fn = getattr(stage, method)

        def timed(*a, _fn=fn, **k):
            timeline.backward_start()
            try:
                return _fn(*a, **k)
            finally:
                timeline.backward_end()
        setattr(stage, method, timed)


def simulated_bubble(orders: dict[int, list], num_stages: int) -> float:
    """The mean idle share of the ranks when ``orders`` (every rank's actions) run with
    free communication and the compute costs ``COST``: each action starts when its rank
    is free and what it needs is done."""
    finish: dict[tuple[int, str, int], float] = {}
    clock = {r: 0.0 for r in orders}
    busy = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}

    def needs(s: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
        if kind == "F":
            return [(s - 1, "F", mb)] if s > 0 else []
        if kind == "W":
            return [(s, "I", mb)]
        if s == num_stages - 1:
            return [(s, "F", mb)]
        later = (s + 1, "B", mb) if (s + 1, "B", mb) in finish else (s + 1, "I", mb)
        return [(s, "F", mb), later]

    progressed = True
    while progressed:
        progressed = False
        for r, order in orders.items():
            while pos[r] < len(order):
                s, kind, mb = order[pos[r]]
                deps = needs(s, kind, mb)
                if not all(d in finish for d in deps):
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                clock[r] = finish[(s, kind, mb)] = start + COST[kind]
                busy[r] += COST[kind]
                pos[r] += 1
                progressed = True
    span = max(clock.values())
    return statistics.mean(1 - busy[r] / span for r in orders)


def backward_seconds(args) -> dict[str, float]:
    """One V-shaped stage's backward of one micro-batch, whole and split two ways (the
    module docstring); every rank at once, the slowest rank's median of ``5 x steps``."""
    stage = Stage(args.width, max(1, args.layers // 2), Timeline(), seed=RANK)
    stage.marks_backward = False
    params = list(stage.parameters())
    x = torch.randn(args.rows, args.width, requires_grad=True)
    grad = torch.randn(args.rows, args.width)
    splitter = Splitter()  # as a pipeline stage holds one: the graph's plan made once

    def whole() -> None:
        torch.autograd.backward([stage(x)], [grad])

    def split() -> None:
        _, weights = splitter.backward_input([stage(x)], [grad], [x], params)
        weights()

    def twice() -> None:
        out = stage(x)
        torch.autograd.grad([out], [x], [grad], retain_graph=True)
        torch.autograd.backward([out], [grad], inputs=params)

    def forward() -> None:
        stage(x)

    ways = {"forward": forward, "whole": whole, "split": split, "twice": twice}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for rep in range(5 * args.steps + 1):
        for key, fn in ways.items():  # interleaved: the same load for each
            COMM.Barrier()
            start = time.perf_counter()
            fn()
            if rep:
                times[key].append(time.perf_counter() - start)
    forward_s = statistics.median(times["forward"])
    return {k: COMM.allreduce(statistics.median(v) - (forward_s if k != "forward" else 0), op=MPI.MAX)
            for k, v in times.items()}


ACTION_PARTS = ("F", "B", "I", "W", "wait", "post", "send", "rest")


def action_cpu(runner, steps: int) -> tuple[dict[str, float], float]:
    """CPU seconds of one mdt step per rank by part (median of ``steps`` steps): the stage's
    forwards ``F``, whole backwards ``B``, input ``I`` and weight ``W`` backwards, the
    channel's receive waits (polling included), receive posts and sends (with the step's
    final wait for them), and ``rest``: the schedule's own work (its runtime loop, the
    rebuilding of received inputs, the step's set-up and end); and the step's minor page
    faults (median)."""
    spent: dict[str, float] = dict.fromkeys(ACTION_PARTS, 0.0)
    clock = time.process_time

    def timed(obj, method: str, part) -> None:  # an instance attribute over the method: this runner only
        fn = getattr(obj, method)

        def wrapper(*a, **k):
            start = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[part if isinstance(part, str) else part(k)] += clock() - start
        setattr(obj, method, wrapper)

    for stage in runner.stages:
        timed(stage, "forward_one_chunk", "F")
        timed(stage, "backward_one_chunk", lambda k: "B" if k.get("full_backward", True) else "I")
        timed(stage, "backward_weight_one_chunk", "W")
    channel = runner.schedule._channel
    for method, part in (("wait", "wait"), ("post", "post"), ("send", "send"), ("finish_sends", "send")):
        timed(channel, method, part)
    per_step, faults = [], []
    for _ in range(steps):
        for part in spent:
            spent[part] = 0.0
        COMM.Barrier()
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = clock()
        runner()
        total = clock() - start
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
        per_step.append({**spent, "rest": total - sum(spent.values())})
    return {part: statistics.median(s[part] for s in per_step) for part in ACTION_PARTS}, statistics.median(faults)


def ideal_seconds(args, timeline: Timeline) -> float:
    """``microbatches`` x one stage's forward + backward of one micro-batch, alone (no
    communication), timed on every rank at once; the slowest rank's median."""
    stage = Stage(args.width, args.layers, timeline, seed=RANK)
    stage.marks_backward = False
    x = torch.randn(args.rows, args.width)
    times = []
    for _ in range(args.steps + 1):
        COMM.Barrier()
        start = time.perf_counter()
        for _ in range(args.microbatches):
            mse(stage(x), x).backward()
        times.append(time.perf_counter() - start)
    return COMM.allreduce(statistics.median(times[1:]), op=MPI.MAX)


def measure(runner, timeline: Timeline, steps: int) -> tuple[list[float], list[float], list, list[float]]:
    """Step seconds (slowest rank), mean bubble fraction and CPU seconds (summed over the
    ranks) of ``steps`` steps after one warm-up; every rank's spans of the last step (on
    rank 0)."""
    secs, bubbles, cpus = [], [], []
    for i in range(steps + 1):
        COMM.Barrier()
        cpu = time.process_time()
        timeline.start_step()
        runner()
        timeline.end_step()
        cpu = COMM.allreduce(time.process_time() - cpu)
        elapsed = COMM.allreduce(timeline.step_end - timeline.step_start, op=MPI.MAX)
        bubble = COMM.allreduce(timeline.bubble_fraction) / P
        if i:
            secs.append(elapsed)
            bubbles.append(bubble)
            cpus.append(cpu)
    spans = COMM.gather([(k, s - timeline.step_start, e - timeline.step_start) for k, s, e in timeline.spans])
    return secs, bubbles, spans, cpus


def run(args) -> dict:
    """Every case's step time and bubble; torch's gloo group is taken down after if this
    call made it (a test runs this in a job whose later modules need no default group)."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    init_gloo_process_group()
    try:
        return _run(args)
    finally:
        if made:
            dist.destroy_process_group()


def _run(args) -> dict:
    timeline = Timeline()
    names = [n for n in SCHEDULES if hasattr(mdt_pp, n) and (not args.schedules or n in args.schedules)]
    cases = [(n, impl) for n in names for impl in (["hand"] if n in HAND else []) + ["mdt", "torch"]
             if not args.impls or impl in args.impls]
    runners, skipped = {}, {}
    for case in cases:
        try:  # a schedule refuses too few micro-batches (DualPipeV: one per stage) on every rank
            runners[case] = make_runner(case[1], case[0], args, timeline)
        except ValueError as err:
            skipped["/".join(case)] = str(err)
            continue
        measure(runners[case], timeline, 0)  # shape inference, first messages
    cases = list(runners)
    secs = {case: [] for case in runners}
    bubbles = {case: [] for case in runners}
    cpus = {case: [] for case in runners}
    spans = {}
    ideal = []
    for _ in range(args.reps):
        ideal.append(ideal_seconds(args, timeline))
        for case, runner in runners.items():
            s, b, sp, c = measure(runner, timeline, args.steps)
            secs[case] += s
            bubbles[case] += b
            cpus[case] += c
            spans[case] = sp
    ideal_s = statistics.median(ideal)
    calls = {}
    for case, runner in runners.items():  # every rank runs the step; rank 0 counts its calls
        calls[case] = python_calls(runner) if RANK == 0 else runner()
    backward_ms = {k: v * 1e3 for k, v in backward_seconds(args).items()}
    # last: its timers stay on the runners' stages and channels
    parts = {f"{n}/{i}": COMM.gather(action_cpu(runner, args.steps)) for (n, i), runner in runners.items() if i == "mdt"}
    faults = {case: [f for _, f in ranks] for case, ranks in parts.items()} if RANK == 0 else {}
    parts = {case: [p for p, _ in ranks] for case, ranks in parts.items()} if RANK == 0 else {}
    rows = []
    for case in cases:
        name, impl = case
        theory = getattr(runners.get((name, "mdt")), "theory", None)
        step = statistics.median(secs[case])
        hand = statistics.median(secs[(name, "hand")]) if (name, "hand") in secs else None
        rows.append({"schedule": name, "impl": impl, "step_ms": step * 1e3, "vs_ideal": step / ideal_s,
                     "vs_hand": step / hand if hand else None, "bubble": statistics.median(bubbles[case]),
                     "bubble_theory": theory, "calls": calls[case], "cpu_ms": statistics.median(cpus[case]) * 1e3})
    return {"ranks": P, "width": args.width, "layers": args.layers, "rows": args.rows,
            "microbatches": args.microbatches, "ideal_ms": ideal_s * 1e3, "rows_out": rows, "skipped": skipped,
            "backward_ms": backward_ms, "action_cpu_ms": {case: [{k: v * 1e3 for k, v in r.items()} for r in ranks]
                                                       for case, ranks in parts.items()} if RANK == 0 else {},
            "page_faults": faults,
            "spans": {f"{n}/{i}": sp for (n, i), sp in spans.items() if n == "Schedule1F1B"}}


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    header = ["schedule", "impl", "step ms", "x ideal", "x hand", "bubble", "theory", "calls", "cpu ms"]
    rows = []
    for r in result["rows_out"]:
        name = r["schedule"].removeprefix("Schedule")
        rows.append([name, r["impl"], f"{r['step_ms']:.1f}", f"{r['vs_ideal']:.2f}",
                     "-" if r["vs_hand"] is None else f"{r['vs_hand']:.2f}", f"{r['bubble']:.2f}",
                     "-" if r["bubble_theory"] is None else f"{r['bubble_theory']:.2f}", f"{r['calls']:,}",
                     f"{r['cpu_ms']:.1f}"])
    return header, rows


def plot(spans: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(spans), 1, figsize=(12, 1 + 1.2 * len(spans) * P / 4), squeeze=False)
    for ax, (label, per_rank) in zip(axes[:, 0], spans.items()):
        for rank, events in enumerate(per_rank):
            for kind, s, e in events:
                ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (rank - 0.4, 0.8),
                               color="tab:green" if kind == "F" else "tab:blue")
        ax.set_ylabel("rank")
        ax.set_title(f"{label}: green forward, blue backward, white bubble", fontsize=9)
    axes[-1, 0].set_xlabel("ms since step start")
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="layers per rank (split between its stages)")
    p.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--name", default="pipeline", help="stem of the files written under --out")
    p.add_argument("--schedules", type=lambda v: ["Schedule" + n.removeprefix("Schedule") for n in v.split(",")],
                   help="only these schedules (comma-separated, e.g. 1F1B,ZBVZeroBubble); all by default")
    p.add_argument("--impls", type=lambda v: v.split(","), help="only these of hand,mdt,torch; all by default")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args)
    if RANK == 0:
        header, rows = table(result)
        title = (f"pipeline step, {P} ranks, {args.microbatches} micro-batches of {args.rows} x {args.width}, "
                 f"{args.layers} layers per rank; ideal (no bubble) {result['ideal_ms']:.1f} ms; load average "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(title)
        print_table(header, rows)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        lines = [title, "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in widths) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        b = result["backward_ms"]
        note = (f"one stage's backward of one micro-batch ({max(1, args.layers // 2)} layers, alone, forward "
                f"excluded): whole {b['whole']:.2f} ms, split I+W {b['split']:.2f} ms ({b['split'] / b['whole']:.2f}x), "
                f"split by walking twice {b['twice']:.2f} ms ({b['twice'] / b['whole']:.2f}x); forward {b['forward']:.2f} ms")
        print(note)
        lines.append(f"\n{note}")
        part_header = ["schedule (mdt)", *ACTION_PARTS, "step", "page faults"]
        part_rows = [[case.split("/")[0].removeprefix("Schedule"),
                      *(" ".join(f"{r[k]:.1f}" for r in ranks) for k in ACTION_PARTS),
                      " ".join(f"{sum(r.values()):.1f}" for r in ranks),
                      " ".join(f"{f:.0f}" for f in result["page_faults"][case])]
                     for case, ranks in result["action_cpu_ms"].items()]
        part_title = ("CPU ms of one step by part, rank 0 1 ... (action_cpu: F/B/I/W stage compute, channel "
                      "waits/posts/sends, rest), and minor page faults per step")
        print(part_title)
        print_table(part_header, part_rows)
        lines += ["", part_title, "", "| " + " | ".join(part_header) + " |", "|" + "|".join("---" for _ in part_header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in part_rows]
        for case, why in result["skipped"].items():
            print(f"skipped {case}: {why}")
            lines.append(f"\nskipped {case}: {why}")
        (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
        (out / f"{args.name}.json").write_text(json.dumps({k: v for k, v in result.items() if k != "spans"}, indent=1))
        drawn = plot(result["spans"], out / f"{args.name}_timeline.png")
        print(f"wrote {out / args.name}.md, .json" + (", _timeline.png" if drawn else ""))
    return result


if __name__ == "__main__":
    main()
