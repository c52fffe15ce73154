"""transformers' own parallelism unmodified under the switch (issue 38): tiny random Llama,
Qwen2 and Qwen3-MoE models (and a DiffLlama at TP x FSDP: parameters partly on meta) saved
locally (no hub) loaded with ``from_pretrained(path, tp_plan="auto")`` (tensor parallel), ``distributed_config=DistributedConfig(fsdp_size=N)``
(transformers' FSDP2) or ``DistributedConfig(tp_size=2, fsdp_size=2)`` (both on a 2x2 mesh, 4
ranks; its weight loading slices the mesh from several threads at once), with ``ep_size=2`` for
the MoE (its tokens travel by torch's differentiable functional all-to-all), or as 2 pipeline
stages (``DistributedConfig(pp_size=2)``, inference only in transformers: one forward's logits;
its stages send over their mesh's group with ``P2POp``/``batch_isend_irecv``), 3 AdamW steps, under ``mpiexec -n N python -m mpidtensor.run``: the
losses and the logits' checksum equal one process and torch's own run on gloo within 1e-5. The
tensor-parallel model is then saved with ``save_pretrained`` and reloaded in one process: no
key missing or unexpected, and its loss equals that of the one-process model saved alike.
peft's LoRA on the tp_plan="auto" model (its adapters' losses, checksum and saved adapter) and
greedy ``generate`` under TP (token ids) are compared likewise."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from hf_figures import compare, differences, figures
from subjob import run_command, run_peer

WORLD = MPI.COMM_WORLD
N = WORLD.size
PROGRAMS = Path(__file__).parent / "programs"
SCRIPT = str(PROGRAMS / "hf_parallel.py")


def _run(model: str, mode: str) -> list[str]:
    if N not in (2, 4):
        pytest.skip("the models' 4 heads split over 2 or 4 ranks")
    if mode.startswith("tp_fsdp") and N != 4:
        pytest.skip("tensor parallel over 2 ranks, FSDP over the other mesh dim of 2")
    if mode == "pp" and N != 2:
        pytest.skip("the models' 2 layers, one per stage")
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="mpidtensor-hf-tp-") if WORLD.rank == 0 else None)
    saved = {side: f"{folder}/saved-{side}" for side in ("alone", "switch", "gloo")} if mode in ("tp", "lora") else {}

    def args(side: str) -> list[str]:
        return [SCRIPT, folder, model, mode] + ([saved[side]] if saved else [])

    alone = run_command([sys.executable] + args("alone"), ranks=None, timeout=300, cwd=PROGRAMS)  # makes the model
    ours = run_command([sys.executable, "-m", "mpidtensor.run"] + args("switch"), ranks=N, timeout=300, cwd=PROGRAMS)
    theirs = run_peer([sys.executable, str(PROGRAMS / "torch_gloo.py")] + args("gloo"), ranks=N, timeout=300,
                      cwd=PROGRAMS)
    count = {"pp": 1, "generate": 2}.get(mode, 4)  # the logits' checksum (generate: the tokens too); else 3 losses too
    problems = differences("switch", ours, alone, count) + differences("torch on gloo", theirs, alone, count)
    if saved and not problems:
        reload = run_command([sys.executable, SCRIPT, folder, model, "reload"] + list(saved.values()), ranks=None,
                             timeout=300, cwd=PROGRAMS)
        log = reload.output[-2500:]
        alone_again = figures(reload.output, "0")
        if reload.returncode != 0 or alone_again.get("MISSING") != "0":  # (a LoRA adapter: MISSING is not counted)
            problems.append(f"reloading (exit {reload.returncode}): {log}")
        for index, side in ((1, "switch"), (2, "torch on gloo")):
            problems += compare(f"{side}'s save_pretrained, reloaded", figures(reload.output, str(index)),
                                 alone_again, 3, log)
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


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("model, mode", [("llama", "tp_fsdp"), ("qwen3_moe", "tp_fsdp_ep"),
                                         pytest.param("qwen2", "tp_fsdp", marks=pytest.mark.exhaustive),
                                         pytest.param("qwen3_moe", "tp_fsdp", marks=pytest.mark.exhaustive),
                                         pytest.param("diffllama", "tp_fsdp", marks=pytest.mark.exhaustive)])
def test_tp_and_fsdp_2d(model, mode):
    problems = _run(model, mode)
    assert_all_ranks(not problems, "\n".join(problems))


@pytest.mark.exhaustive
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_peft_lora_on_tp_plan_auto(model):
    """peft's LoRA (colwise projections and the embedding) on the tp_plan="auto" model: the
    adapters' losses and checksum, and the saved adapter reloaded in one process."""
    problems = _run(model, "lora")
    assert_all_ranks(not problems, "\n".join(problems))


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_generate_on_tp_plan_auto():
    """Greedy ``generate`` with the DynamicCache and the static cache: the same token ids."""
    problems = _run("llama", "generate")
    assert_all_ranks(not problems, "\n".join(problems))


@pytest.mark.timeout(900)
def test_pipeline_stages_inference():
    problems = _run("llama", "pp")
    assert_all_ranks(not problems, "\n".join(problems))
