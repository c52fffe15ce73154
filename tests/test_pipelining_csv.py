"""Schedules from torch's CSV files (``schedule._load_csv``; torchtitan's
``pipeline_parallel_schedule_csv`` builds a ``_PipelineScheduleRuntime`` and loads one).

Each built-in schedule, written with ``_dump_csv`` and run by ``_PipelineScheduleRuntime``,
has the same order and trains like one process (losses of 3 steps, gradients and
parameters after SGD); a ``compute_comms`` file with torch's communication, FSDP, bubble
and overlap cells runs the computations it holds; a bad file raises the same error on
every rank before anything runs."""
from __future__ import annotations

from pathlib import Path

import pytest
from mpi4py import MPI

import mpidtensor.pipelining as pp
import pipeline_models as pm
from helpers import assert_all_ranks, raises_everywhere
from mpidtensor.pipelining.actions import rank_to_stages

WORLD = MPI.COMM_WORLD
P = WORLD.size

CASES = [  # (schedule, stages per rank, micro-batches as a function of the pipeline size)
    (pp.ScheduleGPipe, 1, lambda p: 3),
    (pp.Schedule1F1B, 1, lambda p: p + 1),
    (pp.ScheduleInterleaved1F1B, 2, lambda p: 2 * p),
    (pp.ScheduleInterleavedZeroBubble, 2, lambda p: 2 * p),
    (pp.ScheduleZBVZeroBubble, 2, lambda p: 3),
    (pp.ScheduleDualPipeV, 2, lambda p: 2 * p),
]


def _stages(v: int, style: str) -> tuple:
    num_stages = P * v
    model = pm.make_model(num_stages)
    stages = [pp.PipelineStage(pm.stage_module(model, s, num_stages), s, num_stages, "cpu")
              for s in rank_to_stages(P, num_stages, style)[WORLD.rank]]
    return model, stages, num_stages


def _file(tmp_path: Path, rows: list[list[str]]) -> str:
    """``rows`` written as a CSV by rank 0 (the rank that reads schedule files)."""
    path = tmp_path / "schedule.csv"
    if WORLD.rank == 0:
        path.write_text("\n".join(",".join(row) for row in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].__name__}-n{c[2](2)}")
def test_dumped_schedule_runs_from_file(case, tmp_path: Path) -> None:
    cls, v, n_of = case
    n_mb = n_of(P)
    model, stages, num_stages = _stages(v, cls.style)
    built = cls(stages[0] if issubclass(cls, pp.PipelineScheduleSingle) else stages, n_mb, loss_fn=pm.loss_fn)
    path = str(tmp_path / "schedule.csv")
    built._dump_csv(path)
    schedule = pp._PipelineScheduleRuntime(stages, n_mb, loss_fn=pm.loss_fn)
    schedule._load_csv(path)
    assert_all_ranks(schedule.pipeline_order == built.pipeline_order, f"{schedule.pipeline_order}")
    assert_all_ranks(schedule.stage_index_to_group_rank == built.stage_index_to_group_rank,
                     f"{schedule.stage_index_to_group_rank}")
    pm.check_against_reference(model, stages, pm.train(schedule, stages, n_mb), n_mb, num_stages)


def _compute_comms_rows() -> list[list[str]]:
    """GPipe over 2 micro-batches, one stage per rank, as torch's lowered IR spells it:
    receives, sends, FSDP cells, a bubble and an overlapped forward and backward."""
    rows = []
    for r in range(P):
        first, last = r == 0, r == P - 1
        row = [f"{r}UNSHARD", *([] if first else [f"{r}RECV_F0"]), f"{r}F0", *([] if last else [f"{r}SEND_F0"]),
               "", *([] if first else [f"{r}RECV_F1"]), *([] if last else [f"{r}RECV_B0"]),
               f"({r}F1;{r}B0)OVERLAP_F_B", *([] if first else [f"{r}SEND_B0"]), f"{r}B1", f"{r}REDUCE_GRAD",
               f"{r}RESHARD"]
        rows.append(row)
    return rows


def test_compute_comms_file(tmp_path: Path) -> None:
    model, stages, num_stages = _stages(1, "loop")
    path = _file(tmp_path, _compute_comms_rows())
    schedule = pp._PipelineScheduleRuntime(stages, 2, loss_fn=pm.loss_fn)
    raises_everywhere(ValueError, lambda: schedule._load_csv(path), match="format='compute_comms'")
    schedule._load_csv(path, format="compute_comms")
    want = [f"{WORLD.rank}{k}" for k in ("F0", "F1", "B0", "B1")]
    got = [str(a) for a in schedule.pipeline_order[WORLD.rank]]
    assert_all_ranks(got == want, f"rank {WORLD.rank} runs {got}")
    pm.check_against_reference(model, stages, pm.train(schedule, stages, 2), 2, num_stages)


def _row(r: int, cells: str) -> list[str]:
    return [c.format(r=r) for c in cells.split()]


BAD = {  # case: (rows, or None for no file; the error; words it carries)
    "missing file": (None, FileNotFoundError, "no-such"),
    "a row too many": ([_row(r, "{r}F0 {r}B0") for r in range(P + 1)], ValueError, "one per pipeline rank"),
    "unreadable cell": ([_row(r, "{r}F0 {r}X0 {r}B0") for r in range(P)], ValueError, "cannot read the action '0X0'"),
    "no micro-batch": ([_row(r, "{r}F {r}B0") for r in range(P)], ValueError, "names no micro-batch"),
    "backward before forward": ([_row(r, "{r}B0 {r}F0") for r in range(P)], ValueError, "deadlock"),
    "a micro-batch missing": ([_row(r, "{r}F0 {r}B0") for r in range(P)], ValueError, "never runs"),
    "W without I": ([_row(r, "{r}F0 {r}F1 {r}B0 {r}W1") for r in range(P)], ValueError, "never completes"),
    "B and I both": ([_row(r, "{r}F0 {r}F1 {r}B0 {r}I0 {r}B1") for r in range(P)], ValueError,
                     "both a whole (B) and a split (I)"),
    "beyond the micro-batches": ([_row(r, "{r}F0 {r}F1 {r}F2 {r}B0 {r}B1 {r}B2") for r in range(P)], ValueError,
                                "outside"),
}
if P >= 2:  # each rank's row names the next rank's stage
    BAD["stage on another rank"] = ([_row((r + 1) % P, "{r}F0 {r}F1 {r}B0 {r}B1") for r in range(P)], ValueError,
                                    "held by rank")


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_raises_on_every_rank(case: str, tmp_path: Path) -> None:
    rows, error, words = BAD[case]
    _, stages, _ = _stages(1, "loop")
    schedule = pp._PipelineScheduleRuntime(stages, 2, loss_fn=pm.loss_fn)
    path = str(tmp_path / "no-such.csv") if rows is None else _file(tmp_path, rows)
    raises_everywhere(error, lambda: schedule._load_csv(path), match=words)
    raises_everywhere(RuntimeError, lambda: pm.train(schedule, stages, 2), match="load one with _load_csv")


def test_built_in_schedule_refuses_compute_comms(tmp_path: Path) -> None:
    """torch's ``PipelineScheduleMulti._load_csv`` reads compute-only files; a built-in
    schedule takes a loaded order in place of its own, and writes no communication order."""
    _, stages, _ = _stages(2, "loop")
    schedule = pp.ScheduleInterleaved1F1B(stages, 2 * P, loss_fn=pm.loss_fn)
    path = str(tmp_path / "schedule.csv")
    raises_everywhere(ValueError, lambda: schedule._load_csv(path, format="compute_comms"), match="compute_only")
    raises_everywhere(ValueError, lambda: schedule._dump_csv(path, format="compute_comms"), match="no communication")
