"""Context parallelism against sequence length: time per step and activation memory per
rank for cp = 1, 2, 4, and how much of the ring's communication the computation hides.

    mpiexec -n 4 python benchmarks/bench_context_parallel.py [--base 512] [--factors 1 2 4 8] [--reps 3]

The step is the forward and backward (no optimizer) of the Llama-style model of
examples/llama.py with causal attention, under ``context_parallel`` over the "cp" dim of
a (dp, cp) mesh of all ranks, ``dp = world / cp``: each dp group runs one sequence of
``--base x factor`` tokens, so at cp = 1 every rank runs a whole sequence of its own
(all ranks busy, as at cp > 1), at cp = 4 (4 ranks) the four ranks share one sequence.
The parameters are replicated (no gradient exchange: only the attention's messages move).

Per (cp, sequence length), the slowest rank's figures, medians over ``--reps`` of
repetitions in which the timed variants take turns (the same machine load for each):

* **step ms**: the step, ring rotation (``"alltoall"``: each key/value block's exchange
  overlaps the computation on the block before); **tokens/s**: ``dp * seq / step``;
  **allgather ms**: the step with ``set_rotate_method("allgather")`` (cp > 1).
* **saved MiB**: bytes autograd keeps for backward (distinct storages, ``SavedBytes`` of
  the example): the activations, which should fall ~1/cp.
* **RSS growth MiB**: peak resident set during the step minus the RSS before it
  (``mpidtensor.tools.memory``; glibc's mmap threshold is fixed at 128 KiB so freed buffers
  leave the RSS, see ``fix_mmap_threshold``): activations plus every transient buffer.
* **overlap** (cp > 1): **compute ms** is the step with the ring's exchange replaced by
  no communication (``exchange.shift`` returns a buffer of zeros: the same kernels on
  wrong data); **exchange ms** the same messages (recorded from a step through
  ``mesh.recorders``: the ``ring_shift`` kind; **exchange MiB** their sum) sent alone, one
  after another, by the ring's own ``exchange.shift``; **waited ms** the time the step
  spent in the exchanges' ``wait()`` (what the computation did not hide, waiting for a
  slower neighbour included); **hidden** = 1 - waited / exchange.

Before timing, each cp checks its loss and gradients (averaged over the cp group) on the
base length against the same model run in one process. Writes
``benchmarks/results/context_parallel.{md,json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

import torch
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples")]
from llama import LlamaConfig, build_model, cross_entropy, rope_table  # noqa: E402
from train_context_parallel import MIB, SavedBytes, fix_mmap_threshold  # noqa: E402

from mpidtensor import init_device_mesh  # noqa: E402
from mpidtensor.experimental import context_parallel, set_rotate_method  # noqa: E402
from mpidtensor.experimental._context_parallel import exchange  # noqa: E402
from mpidtensor.tools.memory import max_memory_reserved, memory_reserved, reset_peak_memory_stats  # noqa: E402
from mpidtensor.comm import recorders  # noqa: E402

world = MPI.COMM_WORLD
RESULTS = HERE / "results"


def say(*args) -> None:
    if world.rank == 0:
        print(*args, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=512, help="base sequence length")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8], help="multiples of the base")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="cp sizes (dividing the world)")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per figure (median)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tol", type=float, default=1e-4, help="check tolerance (float32)")
    parser.add_argument("--quick", action="store_true", help="factors 1 and 2, one rep")
    parser.add_argument("--out", type=Path, default=RESULTS / "context_parallel")
    args = parser.parse_args(argv)
    if args.quick:
        args.factors, args.reps = [1, 2], 1
    return args


class Setup:
    """One cp size: the (dp, cp) mesh of all ranks and the model (replicated)."""

    def __init__(self, cfg: LlamaConfig, cp: int) -> None:
        self.cfg, self.cp = cfg, cp
        self.mesh = init_device_mesh("cpu", (world.size // cp, cp), mesh_dim_names=("dp", "cp"))
        self.model = build_model(cfg, seed=0)

    def tokens(self, seq: int) -> torch.Tensor:
        """This dp group's sequence (seq + 1 tokens: inputs and the shifted labels)."""
        gen = torch.Generator().manual_seed(1000 + self.mesh.get_local_rank("dp"))
        return torch.randint(0, self.cfg.vocab_size, (1, seq + 1), generator=gen)

    def step(self, seq: int, counter: SavedBytes | None = None) -> float:
        """Forward + backward of this rank's share of the sequence; its seconds."""
        tokens = self.tokens(seq)
        inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        self.model.rope = rope_table(self.cfg.head_dim, seq, self.cfg.rope_theta)  # one row per position
        world.Barrier()
        start = MPI.Wtime()
        with context_parallel(self.mesh["cp"], buffers=[inputs, labels, self.model.rope], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={inputs, labels}):
            with counter() if counter is not None else nullcontext():
                loss = cross_entropy(self.model(inputs), labels)
            loss.backward()
        seconds = MPI.Wtime() - start
        self.model.zero_grad(set_to_none=True)
        return seconds


def slowest(value: float) -> float:
    return world.allreduce(value, op=MPI.MAX)


def check(setup: Setup, seq: int) -> float:
    """Largest difference of the loss and gradients (cp-group averages) from one process."""
    comm = setup.mesh.get_group("cp")
    tokens = setup.tokens(seq)
    ref = build_model(setup.cfg, seed=0)
    ref.rope = rope_table(setup.cfg.head_dim, seq, setup.cfg.rope_theta)
    loss = cross_entropy(ref(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = [p.grad.clone() for p in ref.parameters()]
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    setup.model.rope = ref.rope.clone()
    with context_parallel(setup.mesh["cp"], buffers=[inputs, labels, setup.model.rope], buffer_seq_dims=[1, 1, 0]):
        local = cross_entropy(setup.model(inputs), labels)
        local.backward()
    diff = abs(comm.allreduce(local.item()) / comm.size - loss.item())
    for p, g in zip(setup.model.parameters(), grads):
        mean = p.grad.clone()
        comm.Allreduce(MPI.IN_PLACE, mean.numpy(), op=MPI.SUM)
        diff = max(diff, (mean / comm.size - g).abs().max().item())
    setup.model.zero_grad(set_to_none=True)
    return slowest(diff)


@contextmanager
def exchange_skipped() -> Iterator[None]:
    """The ring's neighbour exchanges replaced by a buffer of zeros (no communication)."""
    real = exchange.shift

    def no_shift(send: torch.Tensor, receive_numel: int, comm, tag: int, step: str = "") -> exchange.Shift:
        return exchange.Shift([], (), torch.zeros(receive_numel, dtype=send.dtype), ())

    exchange.shift = no_shift
    try:
        yield
    finally:
        exchange.shift = real


def recorded_shifts(run_step: Callable[[], float]) -> list[int]:
    """Bytes of every ring exchange one step sends, in order."""
    sizes: list[int] = []

    def recorder(kind: str, nbytes: int) -> None:
        if kind == "ring_shift":
            sizes.append(nbytes)

    recorders.push(recorder)
    try:
        run_step()
    finally:
        recorders.pop(recorder)
    return sizes


def replay(sizes: list[int], comm: MPI.Intracomm) -> float:
    """Seconds to send the recorded messages around the ring alone, one after another."""
    buffers = {n: torch.zeros(n, dtype=torch.uint8) for n in set(sizes)}
    comm.Barrier()
    start = MPI.Wtime()
    for n in sizes:
        exchange.shift(buffers[n], n, comm, tag=99).wait()
    return MPI.Wtime() - start


@contextmanager
def rotate_method(name: str) -> Iterator[None]:
    """``set_rotate_method(name)`` for the block, the ring (``"alltoall"``) after."""
    set_rotate_method(name)
    try:
        yield
    finally:
        set_rotate_method("alltoall")


class WaitClock:
    """Seconds spent in the ring's ``Shift.wait`` while installed: the communication the
    block computations did not hide (including waiting for a slower neighbour)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def installed(self) -> Iterator["WaitClock"]:
        real = exchange.Shift.wait
        self.seconds = 0.0

        def timed_wait(shift: exchange.Shift) -> torch.Tensor:
            start = MPI.Wtime()
            try:
                return real(shift)
            finally:
                self.seconds += MPI.Wtime() - start

        exchange.Shift.wait = timed_wait
        try:
            yield self
        finally:
            exchange.Shift.wait = real


def measure(setup: Setup, seq: int, reps: int) -> dict:
    """All figures of one (cp, sequence length), slowest rank; the timed variants take
    turns within each repetition, so that they see the same machine load."""
    setup.step(seq)  # warm-up
    counter = SavedBytes()
    reset_peak_memory_stats()
    before = memory_reserved()
    setup.step(seq, counter)
    row = {"cp": setup.cp, "dp": world.size // setup.cp, "seq": seq, "tokens_per_rank": seq // setup.cp,
           "saved_mib": slowest(counter.nbytes) / MIB,
           "rss_growth_mib": slowest(max_memory_reserved() - before) / MIB}
    sizes = recorded_shifts(lambda: setup.step(seq)) if setup.cp > 1 else []
    comm, clock = setup.mesh.get_group("cp"), WaitClock()
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        with clock.installed():
            timed = {"step_ms": setup.step(seq)}
        if setup.cp > 1:
            timed["waited_ms"] = clock.seconds
            with exchange_skipped():
                timed["compute_ms"] = setup.step(seq)
            timed["exchange_ms"] = replay(sizes, comm)
            with rotate_method("allgather"):
                timed["allgather_ms"] = setup.step(seq)
        for key, seconds in timed.items():
            samples.setdefault(key, []).append(1e3 * slowest(seconds))
    row.update({key: statistics.median(values) for key, values in samples.items()})
    row["tokens_s"] = row["dp"] * seq / row["step_ms"] * 1e3
    if setup.cp > 1:
        row["exchange_mib"] = sum(sizes) / MIB
        row["hidden"] = 1 - row["waited_ms"] / row["exchange_ms"]
    return row


COLUMNS = [("cp", "cp", "{}"), ("dp", "dp", "{}"), ("seq", "seq", "{}"), ("tokens_per_rank", "tokens/rank", "{}"),
           ("step_ms", "step ms", "{:.1f}"), ("tokens_s", "tokens/s", "{:.0f}"),
           ("allgather_ms", "allgather ms", "{:.1f}"), ("saved_mib", "saved MiB", "{:.1f}"),
           ("rss_growth_mib", "RSS growth MiB", "{:.1f}"), ("compute_ms", "compute ms", "{:.1f}"),
           ("exchange_ms", "exchange ms", "{:.1f}"), ("waited_ms", "waited ms", "{:.1f}"),
           ("exchange_mib", "exchange MiB", "{:.1f}"), ("hidden", "hidden", "{:.2f}")]


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table ("-" where a figure does not apply)."""
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "| " + " | ".join("---:" for _ in COLUMNS) + " |"]
    for row in rows:
        cells = [fmt.format(row[key]) if key in row else "-" for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fix_mmap_threshold()
    cps = [cp for cp in args.cps if world.size % cp == 0]
    seqs = [args.base * f for f in args.factors]
    if any(seq % (2 * cp) for seq in seqs for cp in cps):
        raise ValueError(f"every sequence length {seqs} must divide by 2 * cp for cp in {cps}")
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, hidden_dim=args.hidden, max_seq_len=max(seqs))
    torch.manual_seed(0)
    set_rotate_method("alltoall")
    load_before = os.getloadavg()[0]
    say(f"{world.size} ranks, cp in {cps} (dp = {world.size} / cp, one sequence per dp group); {cfg}")
    rows, checks = [], {}
    for cp in cps:
        setup = Setup(cfg, cp)
        checks[cp] = check(setup, args.base)
        say(f"cp {cp}: largest difference from one process at seq {args.base}: {checks[cp]:.1e}")
        if checks[cp] > args.tol:
            say(f"cp {cp}: above --tol {args.tol}, left out")
            continue
        for seq in seqs:
            rows.append(measure(setup, seq, args.reps))
            say(table(rows[-1:]).splitlines()[-1])
    text = table(rows)
    machine = (f"{os.cpu_count()} cores, load average {load_before:.1f} at the start and "
               f"{os.getloadavg()[0]:.1f} at the end")
    say(f"\n{text}\n{machine}")
    if world.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"world": world.size, "config": vars(cfg), "reps": args.reps, "checks": checks, "machine": machine}
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(
            f"# Context parallelism: {world.size} ranks, {cfg}\n\n{machine}\n\n{text}\n")
    return 0 if all(d <= args.tol for d in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
