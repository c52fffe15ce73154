"""transformers' own parallelism unmodified under the switch (issue 38): tiny random Llama,
Qwen2 and Qwen3-MoE models saved locally (no hub) loaded with ``from_pretrained(path,
tp_plan="auto")`` (tensor parallel) or ``distributed_config=DistributedConfig(fsdp_size=N)``
(transformers' FSDP2), 3 AdamW steps, under ``mpiexec -n N python -m mpidtensor.run``: the
losses and the logits' checksum equal one process and torch's own run on gloo within 1e-5. The
tensor-parallel model is then saved with ``save_pretrained`` and reloaded in one process: no
key missing or unexpected, and its loss equals that of the one-process model saved alike."""
from __future__ import annotations

import math
import re
import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from subjob import Result, run_command, run_peer

WORLD = MPI.COMM_WORLD
N = WORLD.size
PROGRAMS = Path(__file__).parent / "programs"
SCRIPT = str(PROGRAMS / "hf_parallel.py")


def _figures(output: str) -> dict[str, str]:
    """``LOSS i``, ``CHECKSUM``, ``MISSING``, ``UNEXPECTED`` and ``RELOADED`` lines, by name."""
    found = re.finditer(r"^((?:LOSS \d+)|CHECKSUM|MISSING|UNEXPECTED|RELOADED) (\S+)", output, re.M)
    return {m.group(1): m.group(2) for m in found}


def _differences(name: str, ran: Result, alone: Result, count: int) -> list[str]:
    """What differs between ``ran``'s figures and one process's (``count`` figures expected)."""
    want, got = _figures(alone.output), _figures(ran.output)
    if alone.returncode != 0 or ran.returncode != 0 or len(want) != count or got.keys() != want.keys():
        return [f"{name}: exit {ran.returncode} (one process {alone.returncode}), figures {got} against {want}:\n"
                f"{ran.output[-2500:]}\n--- one process:\n{alone.output[-1000:]}"]
    return [f"{name} {k}: {got[k]} != {want[k]}" for k in want
            if not math.isclose(float(got[k]), float(want[k]), rel_tol=1e-5, abs_tol=1e-5)]


def _run(model: str, mode: str) -> list[str]:
    if N not in (2, 4):
        pytest.skip("the models' 4 heads split over 2 or 4 ranks")
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="mpidtensor-hf-tp-") if WORLD.rank == 0 else None)
    saved = {side: f"{folder}/saved-{side}" for side in ("alone", "switch", "gloo")} if mode == "tp" else {}

    def args(side: str) -> list[str]:
        return [SCRIPT, folder, model, mode] + ([saved[side]] if saved else [])

    alone = run_command([sys.executable] + args("alone"), ranks=None, timeout=300, cwd=PROGRAMS)  # makes the model
    ours = run_command([sys.executable, "-m", "mpidtensor.run"] + args("switch"), ranks=N, timeout=300, cwd=PROGRAMS)
    theirs = run_peer([sys.executable, str(PROGRAMS / "torch_gloo.py")] + args("gloo"), ranks=N, timeout=300,
                      cwd=PROGRAMS)
    problems = _differences("switch", ours, alone, 4) + _differences("torch on gloo", theirs, alone, 4)
    if saved and not problems:
        reloaded = {side: run_command([sys.executable, SCRIPT, folder, model, "reload", where], ranks=None,
                                      timeout=300, cwd=PROGRAMS) for side, where in saved.items()}
        if _figures(reloaded["alone"].output).get("MISSING") != "0":
            problems.append(f"one process's reload: {reloaded['alone'].output[-1500:]}")
        problems += _differences("switch's save_pretrained, reloaded", reloaded["switch"], reloaded["alone"], 3)
        problems += _differences("gloo's save_pretrained, reloaded", reloaded["gloo"], reloaded["alone"], 3)
    return problems


@pytest.mark.timeout(1200)
@pytest.mark.quick_at(2)
def test_llama_tp_plan_auto():
    problems = _run("llama", "tp")
    assert_all_ranks(not problems, "\n".join(problems))


@pytest.mark.exhaustive
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("model", ["qwen2", "qwen3_moe"])
def test_tp_plan_auto(model):
    problems = _run(model, "tp")
    assert_all_ranks(not problems, "\n".join(problems))


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_llama_transformers_fsdp():
    problems = _run("llama", "fsdp")
    assert_all_ranks(not problems, "\n".join(problems))
