"""accelerate's FSDP2 and transformers' Trainer unmodified under the switch (issue 38): the
tiny random Llama trained 3 AdamW steps with ``Accelerator(fsdp_plugin=...(fsdp_version=2))``
(then ``save_state``/``load_state``), with ``ParallelismConfig(dp_shard_size=N)``, with
and with ``Trainer(fsdp=
"full_shard", fsdp_config={"fsdp_version": 2})``, under ``mpiexec -n N python -m
mpidtensor.run``: losses, checksum and reloaded loss equal one process and torch's own run on
gloo within 1e-5. accelerate keeps CPU jobs as DDP; the program undoes that alike for both
(``fsdp_on_cpu`` in tests/programs/hf_accelerate.py), not the library. accelerate's TP
(``ParallelismConfig(tp_size=...)``) is not run: on CPU it refuses TP alone (not a multi-device
type), and with dp_shard x tp its ``prepare`` imports ``ReplicateParallel``, which transformers
5.24 no longer has (an ImportError before any torch.distributed call, for torch alike)."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from hf_figures import differences
from subjob import run_command, run_peer

WORLD = MPI.COMM_WORLD
N = WORLD.size
PROGRAMS = Path(__file__).parent / "programs"
SCRIPT = str(PROGRAMS / "hf_accelerate.py")
FIGURES = {"plugin": 5, "pc": 5, "trainer": 4}  # LOSS 0-2, CHECKSUM (and RELOADED)


@pytest.mark.exhaustive
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", sorted(FIGURES))
def test_accelerate_fsdp2(mode):
    if N not in (2, 4):
        pytest.skip("runs at 2 and 4 ranks: the Trainer's batch of 4 rows splits evenly there")
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="mpidtensor-hf-acc-") if WORLD.rank == 0 else None)
    model = [str(PROGRAMS / "hf_parallel.py"), folder, "llama", "plain"]
    made = run_command([sys.executable] + model, ranks=None, timeout=300, cwd=PROGRAMS)
    alone = run_command([sys.executable, SCRIPT, folder, mode, f"{folder}/alone"], ranks=None, timeout=300,
                        cwd=PROGRAMS)
    ours = run_command([sys.executable, "-m", "mpidtensor.run", SCRIPT, folder, mode, f"{folder}/switch"], ranks=N,
                       timeout=300, cwd=PROGRAMS)
    theirs = run_peer([sys.executable, str(PROGRAMS / "torch_gloo.py"), SCRIPT, folder, mode, f"{folder}/gloo"],
                      ranks=N, timeout=300, cwd=PROGRAMS)
    problems = [] if made.returncode == 0 else [f"making the model: {made.output[-2000:]}"]
    problems += differences("switch", ours, alone, FIGURES[mode])
    problems += differences("torch on gloo", theirs, alone, FIGURES[mode])
    assert_all_ranks(not problems, "\n".join(problems))
