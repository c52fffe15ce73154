"""transformers' own parallelism unmodified under the switch (issue 38): a tiny random Llama
saved locally (no hub) loaded with ``from_pretrained(path, tp_plan="auto")`` (tensor
parallel) or ``distributed_config=DistributedConfig(fsdp_size=N)`` (transformers' FSDP2), 3
AdamW steps, under ``mpiexec -n N python -m mpidtensor.run``: the losses and the logits'
checksum equal one process and torch's own run on gloo within 1e-5."""
from __future__ import annotations

import math
import re
import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from subjob import run_command, run_peer

WORLD = MPI.COMM_WORLD
N = WORLD.size
PROGRAMS = Path(__file__).parent / "programs"


def _figures(output: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^((?:LOSS \d+)|CHECKSUM) (\S+)$", output, re.M)}


def _run(mode: str) -> list[str]:
    if N not in (2, 4):
        pytest.skip("the model's 4 heads split over 2 or 4 ranks")
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="mpidtensor-hf-tp-") if WORLD.rank == 0 else None)
    script = str(PROGRAMS / "hf_parallel.py")
    model = f"{folder}/llama"
    alone = run_command([sys.executable, script, model, mode], ranks=None, timeout=300, cwd=PROGRAMS)  # saves it
    ours = run_command([sys.executable, "-m", "mpidtensor.run", script, model, mode], ranks=N, timeout=300,
                       cwd=PROGRAMS)
    theirs = run_peer([sys.executable, str(PROGRAMS / "torch_gloo.py"), script, model, mode], ranks=N, timeout=300,
                      cwd=PROGRAMS)
    problems = []
    want = _figures(alone.output)
    for name, ran in (("switch", ours), ("torch on gloo", theirs)):
        got = _figures(ran.output)
        if alone.returncode != 0 or ran.returncode != 0 or len(want) != 4 or got.keys() != want.keys():
            problems.append(f"{name}: exit {ran.returncode} (one process {alone.returncode}), figures {got} "
                            f"against {want}:\n{ran.output[-2500:]}\n--- one process:\n{alone.output[-1000:]}")
            continue
        problems += [f"{name} {k}: {got[k]} != {want[k]}" for k in want
                     if not math.isclose(got[k], want[k], rel_tol=1e-5, abs_tol=1e-5)]
    return problems


@pytest.mark.timeout(900)
@pytest.mark.quick_at(2)
def test_llama_tp_plan_auto():
    problems = _run("tp")
    assert_all_ranks(not problems, "\n".join(problems))


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_llama_transformers_fsdp():
    problems = _run("fsdp")
    assert_all_ranks(not problems, "\n".join(problems))
