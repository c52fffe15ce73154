"""Every sample input of every op the OpInfo sweep covers, on DTensors, against plain torch.

``tests/test_opinfo.py`` checks a few samples per op to stay quick; this script checks
them all (forward, and gradients where the op supports autograd; values and local
layouts), under each layout
given (default: ``S0,S-1,R``; see ``opinfo_support``), and prints the failures::

    mpiexec -n 3 python tests/opinfo_all_samples.py [--ops a,b] [--start I --stop J]
        [--layouts S0,S-1,R] [--first-sample I] [--max-samples N] [--rotate] [--out failures.txt]

``--start/--stop`` select ops by position in the sweep's op list, to split a long run.
Every verdict is agreed by all ranks (one small allgather per case). Ops with no
sharding rule run through the replicated fallback (MPIDTENSOR_STRICT is unset), as
in the sweep. Rank 0 prints one line per op and, at the end, the list of failures
(``op [layout] sample i: message``); the exit status is 1 when any case failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("MPIDTENSOR_STRICT", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpi4py import MPI  # noqa: E402

import opinfo_support as S  # noqa: E402
from mpidtensor import init_device_mesh  # noqa: E402

WORLD = MPI.COMM_WORLD


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="", help="comma-separated op keys (name[.variant]); default: all")
    parser.add_argument("--start", type=int, default=0, help="first op position in the sweep's list")
    parser.add_argument("--stop", type=int, default=None, help="op position to stop before")
    parser.add_argument("--layouts", default="S0,S-1,R", help="comma-separated layouts (S0, S-1, R, P, 2d)")
    parser.add_argument("--max-samples", type=int, default=None, help="at most this many samples per op")
    parser.add_argument("--first-sample", type=int, default=0, help="skip the samples before this one")
    parser.add_argument("--rotate", action="store_true",
                        help="run sample i under layout i mod (number of layouts) only (a quicker pass)")
    parser.add_argument("--out", default="", help="rank 0 appends the failures to this file as they come")
    return parser.parse_args()


def _selected(args: argparse.Namespace) -> list:
    wanted = {k for k in args.ops.split(",") if k}
    ops = list(enumerate(S.sweep_ops()))[args.start:args.stop]
    chosen = [(i, op) for i, op in ops if (not wanted or S.op_key(op) in wanted) and S.op_key(op) not in S.NOT_CHECKED]
    missing = wanted - {S.op_key(op) for _, op in chosen}
    if missing:
        raise SystemExit(f"not in the selected part of the sweep (or not checked): {sorted(missing)}")
    return chosen


def main() -> int:
    args = _arguments()
    layouts = [lay for lay in args.layouts.split(",") if lay]
    meshes = {"1d": init_device_mesh("cpu", (WORLD.size,))}
    if "2d" in layouts:
        if WORLD.size != 4:
            raise SystemExit("layout 2d needs 4 ranks")
        meshes["2d"] = init_device_mesh("cpu", (2, 2))
    failures: list[str] = []
    cases = 0
    begin = time.time()
    for position, op in _selected(args):
        key = S.op_key(op)
        start, failed = time.time(), 0
        drawn = S.sample_list(key, args.max_samples)
        for index, (sample, ref_out, ref_grads) in enumerate(drawn):
            if index < args.first_sample:
                continue
            for layout in [layouts[index % len(layouts)]] if args.rotate else layouts:
                mesh = meshes["2d" if layout == "2d" else "1d"]
                cases += 1
                message = S.agreed(S.run_case(op, key, sample, ref_out, ref_grads, mesh, layout))
                if message:
                    failed += 1
                    line = f"{key} [{layout}] sample {index}: " + " ".join(message[:400].split())
                    failures.append(line)
                    if WORLD.rank == 0 and args.out:
                        with open(args.out, "a") as f:
                            f.write(line + "\n")
        if WORLD.rank == 0:
            print(f"[{position}] {key}: {len(drawn)} samples, {failed} failed, "
                  f"{time.time() - start:.1f}s", flush=True)
    if WORLD.rank == 0:
        print(f"\n{cases} cases in {time.time() - begin:.0f}s at {WORLD.size} ranks; {len(failures)} failed")
        for line in failures:
            print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
