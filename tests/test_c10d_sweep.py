"""torch.distributed's c10d calls under the switch, against torch on gloo, call by call.

``programs/c10d_sweep.py`` (a torch-only program) makes every public c10d call that
takes a group, with parameters, tensors that require grad, non-contiguous and transposed
views, 0-dim and empty tensors, every dtype, ``async_op``, a ``new_group`` and bad input,
and writes each rank's results (values, or the error's type). It runs at N ranks under
``python -m mpidtensor.run`` and under torch's gloo (``programs/torch_gloo.py``, a peer
retried once); every rank's line of every call must agree: the same values, or the
same exception type.

The calls torch's gloo cannot do are listed in the program's ``GLOO_CANNOT`` with why
(gloo raises, crashes, or writes wrong values: a non-contiguous broadcast, all-reduce,
reduce-scatter or scatter in memory order); for those gloo runs a twin that gives the
values one process would (a contiguous copy, ``no_grad``, a flat view), and the switch's
real call must give them. :data:`BY_DESIGN` are the answers that differ on purpose.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from subjob import run_command, run_peer

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank
PROGRAMS = Path(__file__).parent / "programs"

# call: what the switch answers where torch's gloo names itself
BY_DESIGN = {"get_backend": "mpidtensor", "get_backend_config": "cpu:mpidtensor,cuda:mpidtensor"}


def _lines(folder: Path) -> dict[int, list[dict]]:
    return {int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in folder.glob("rank*.jsonl")}


def _outcome(line: dict) -> dict:
    """What must agree: the result, or the error's type (messages name the backend)."""
    return {"error": line["error"]} if "error" in line else {"result": line.get("result")}


def compare(ours: dict[int, list[dict]], gloo: dict[int, list[dict]], ranks: int) -> list[str]:
    """Every rank's every call: the same outcome (``BY_DESIGN``'s answers aside)."""
    problems = []
    for rank in range(ranks):
        mine, theirs = ours.get(rank, []), gloo.get(rank, [])
        if [m["call"] for m in mine] != [t["call"] for t in theirs] or not mine:
            problems.append(f"rank {rank}: {len(mine)} calls under the switch, {len(theirs)} on gloo")
            continue
        for m, t in zip(mine, theirs):
            if m["call"] in BY_DESIGN:
                if m.get("result") != BY_DESIGN[m["call"]]:
                    problems.append(f"rank {rank} {m['call']}: {m}")
            elif _outcome(m) != _outcome(t):
                problems.append(f"rank {rank} {m['call']}: switch {json.dumps(m)[:300]}\n    gloo {json.dumps(t)[:300]}")
    return problems


@pytest.mark.timeout(900)  # two sub-jobs of up to 4 ranks on shared cores
@pytest.mark.quick_at(2)
def test_c10d_calls_match_torch_gloo():
    if N == 1:
        pytest.skip("the sweep's collectives need 2 or more ranks")
    folder = Path(WORLD.bcast(tempfile.mkdtemp(prefix="mpidtensor-c10d-") if RANK == 0 else None))
    sweep = str(PROGRAMS / "c10d_sweep.py")
    if RANK == 0:
        (folder / "switch").mkdir()
        (folder / "gloo").mkdir()
    WORLD.Barrier()
    ran = run_command([sys.executable, "-m", "mpidtensor.run", sweep, str(folder / "switch")], ranks=N, timeout=400,
                      cwd=PROGRAMS)
    peer = run_peer([sys.executable, str(PROGRAMS / "torch_gloo.py"), sweep, str(folder / "gloo")], ranks=N,
                    timeout=400, cwd=PROGRAMS)
    if ran.returncode != 0 or peer.returncode != 0:
        problems = [f"exit {ran.returncode} / gloo {peer.returncode}:\n{ran.output[-3000:]}\n--- gloo:\n"
                    f"{peer.output[-3000:]}"]
    else:  # (the files are rank 0's: the sub-jobs ran from there)
        problems = WORLD.bcast(compare(_lines(folder / "switch"), _lines(folder / "gloo"), N) if RANK == 0 else None)
    assert_all_ranks(not problems, "\n".join(problems[:20]))
