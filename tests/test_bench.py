"""The benchmark of record keeps working: ``benchmarks/bench_record.py --check-only`` run
in-process checks every redistribution cell and every training step of the three
implementations (mpidtensor, torch's DTensor on gloo, hand-written mpi4py) against the
single-process references, timing nothing. Sizes 4K, 256K and 4M per rank lie on both
sides of the library's size thresholds (the 32M cells take the 4M paths); the quick
tier checks the 4K cells only. 4 ranks only:
the record runs there (2x2 mesh cells, the FSDP x TP step)."""
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import tier
from helpers import assert_all_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

WORLD = MPI.COMM_WORLD
SIZES = ["4K", "256K", "4M"]  # the quick tier checks the 4K cells (and every step)
NO_HAND_WRITTEN = {"2x2 [S0,S1] -> [R,R]", "2x2 [R,S0] -> [S0,R]"}  # no single mpi4py call


@pytest.mark.timeout(300)
def test_record_checks_every_cell_and_step():
    if WORLD.size != 4:
        pytest.skip("the benchmark of record runs at 4 ranks")
    import bench_record

    sizes = SIZES[:tier.count(len(SIZES), 1)]
    record = bench_record.main(["--check-only", "--sizes", ",".join(sizes)])
    cells = record["redistribute"]
    assert_all_ranks(len(cells) == len(sizes) * 2 * 11, f"{len(cells)} cells")
    for cell in cells:
        want = {"mpidtensor", "torch"} | (set() if cell["transition"] in NO_HAND_WRITTEN else {"mpi4py"})
        assert_all_ranks(set(cell["checked"]) == want, f"{cell['transition']} {cell['size']}: {cell['checked']}")
        assert_all_ranks(all(cell[lib] is None for lib in bench_record.LIBS), "check-only timed a cell")
    steps = {", ".join(row["step"].split(", ")[:2]).split(" 2x2")[0]: set(row["checked"]) for row in record["steps"]}
    everything = set(bench_record.LIBS)
    want = ["TP MLP 32x1024, hidden 4096", "FSDP, 4 x Linear(1024", "FSDP, dim 128", "FSDP x TP",
            "FSDP, dim 512", "FSDP x TP, dim 512",
            "TP MLP (DTensor ops) 32x1024", "[S0] -> [S1] 256 KiB/rank"]
    assert_all_ranks(len(steps) == len(want) and all(any(k.startswith(w) for k in steps) for w in want)
                     and all(checked == everything for checked in steps.values()), str(steps))


@pytest.mark.timeout(300)
def test_expert_parallel_bench_checks_every_variant():
    """``benchmarks/bench_experts.py --check-only`` (small sizes): mpidtensor's dispatch, the
    hand-written mpi4py one and transformers' on torch's gloo all match one process."""
    if 8 % WORLD.size:
        pytest.skip("8 experts split over 1, 2 or 4 ranks")
    import bench_experts

    checked = bench_experts.main(["--check-only", "--tokens", "16", "--hidden", "32"])
    assert_all_ranks(checked == ["mpidtensor", "mpi4py", "torch gloo"], f"checked {checked}")


@pytest.mark.timeout(300)
def test_general_path_rows_check_at_every_size():
    """``benchmarks/record_general.py --check-only --no-torch`` at any world size: the TP MLP in
    DTensor ops (uneven hidden blocks at 3 ranks) and the 256 KiB ``Shard(0) -> Shard(1)``
    match one process, and so do the hand-written Megatron step and the bare ``Alltoall``."""
    import record_general

    rows = record_general.main(["--check-only", "--no-torch"])
    assert_all_ranks([row["checked"] for row in rows] == [["mpidtensor", "mpi4py"]] * 2, str(rows))
    assert_all_ranks(all(row[lib] is None for row in rows for lib in ("mpidtensor", "mpi4py")), "check-only timed")


@pytest.mark.quick_at(2)
@pytest.mark.timeout(600)
def test_pipeline_bench_runs_every_schedule(tmp_path):
    """``benchmarks/bench_pipeline.py`` at tiny sizes: a row per schedule of
    ``mpidtensor.pipelining`` for mdt and torch on gloo, and the hand-written loops for
    GPipe and 1F1B, with sane figures; the table written."""
    if WORLD.size < 2:
        pytest.skip("a pipeline needs two ranks")
    import bench_pipeline

    out = WORLD.bcast(str(tmp_path), root=0)
    micro = str(max(4, 2 * WORLD.size))  # DualPipeV needs one per stage (two stages per rank)
    result = bench_pipeline.main(["--width", "16", "--rows", "4", "--layers", "2", "--microbatches", micro,
                                  "--steps", "1", "--reps", "1", "--out", out])
    assert_all_ranks(not result["skipped"], f"schedules skipped: {result['skipped']}")
    rows = {(r["schedule"], r["impl"]): r for r in result["rows_out"]}
    names = [n for n in bench_pipeline.SCHEDULES if hasattr(bench_pipeline.mdt_pp, n)]
    want = {(n, impl) for n in names for impl in ("mdt", "torch")} | {(n, "hand") for n in bench_pipeline.HAND}
    assert_all_ranks(set(rows) == want, f"rows {sorted(rows)}")
    assert_all_ranks(all(r["step_ms"] > 0 and r["cpu_ms"] > 0 and 0 <= r["bubble"] < 1 for r in rows.values()), f"{rows}")
    counted = all(r["calls"] > 0 for r in rows.values()) if WORLD.rank == 0 else True  # rank 0 counts
    assert_all_ranks(counted, f"Python calls per step: {[(k, r['calls']) for k, r in rows.items()]}")
    written = Path(out, "pipeline.md").exists() if WORLD.rank == 0 else True
    assert_all_ranks(written, "no pipeline.md")
    parts = result["action_cpu_ms"]  # rank 0: each mdt schedule's CPU per step by part, every rank
    split_ok = WORLD.rank != 0 or (
        set(parts) == {f"{n}/mdt" for n in names} and all(len(ranks) == WORLD.size for ranks in parts.values())
        and all(r["F"] > 0 and min(r.values()) >= -1e-3 for ranks in parts.values() for r in ranks)
        and all(r["I"] > 0 and r["W"] > 0 for r in parts["ScheduleZBVZeroBubble/mdt"])
        and all(r["B"] > 0 and r["I"] == 0 for r in parts["Schedule1F1B/mdt"]))
    assert_all_ranks(split_ok, f"CPU by part: {parts}")
    faults = result["page_faults"]  # rank 0: each mdt schedule's minor page faults per step, every rank
    faults_ok = WORLD.rank != 0 or (set(faults) == set(parts)
                                    and all(len(f) == WORLD.size and min(f) >= 0 for f in faults.values()))
    assert_all_ranks(faults_ok, f"page faults per step: {faults}")


@pytest.mark.timeout(600)
def test_context_parallel_bench_runs(tmp_path):
    """``benchmarks/bench_context_parallel.py`` at tiny sizes: every mode it times (the ring,
    the ring with its exchanges skipped, all-gather rotation) runs and checks against one
    process. It broke unnoticed once when the ring's exchange took a new argument."""
    if WORLD.size < 2:
        pytest.skip("context parallelism needs two ranks")
    import bench_context_parallel

    out = WORLD.bcast(str(tmp_path), root=0)
    code = bench_context_parallel.main(["--base", "48", "--factors", "1", "--cps", "1", str(WORLD.size),
                                        "--reps", "1", "--dim", "32", "--hidden", "64", "--vocab", "64",
                                        "--out", str(Path(out, "cp"))])
    assert_all_ranks(code == 0, f"bench_context_parallel exited {code}")


@pytest.mark.timeout(300)
def test_fsdp_profile_rows_check_and_count():
    """``benchmarks/profile_fsdp_rows.py`` at any world size: the FSDP Llama and stack steps
    (and at 4 ranks the FSDP x TP step) and their hand-written steps match one process, and
    the profile has every part: the call counts (mpidtensor's step makes more calls than the
    hand-written one), a CPU figure per phase and repetition, and the FSDP group methods' CPU."""
    import profile_fsdp_rows

    rows = "llama,stack,tp" if WORLD.size == 4 else "llama,stack"
    results = profile_fsdp_rows.main(["--reps", "1", "--top", "3", "--rows", rows])
    names = ["FSDP Llama", "FSDP stack"] + (["FSDP x TP"] if WORLD.size == 4 else [])
    ok = sorted(results) == sorted(names)
    for row in results.values():
        calls, phases = row["calls"], row["phases"]
        ok = ok and sum(calls["mpidtensor"].values()) > sum(calls["Zero3"].values()) > 0
        ok = ok and all(len(reps) == 1 and len(reps[0]) == len(profile_fsdp_rows.PHASES) for reps in phases.values())
        ok = ok and "ParamGroup.finish_unshard" in row["groups"]
    assert_all_ranks(ok, str({name: sorted(row["groups"]) for name, row in results.items()}))


@pytest.mark.timeout(300)
def test_general_profile_checks_and_splits():
    """``benchmarks/profile_general.py`` at any world size: the TP MLP in DTensor ops and
    Megatron's step match one process, every step has its phases' CPU, the library steps'
    all-reduces were timed (mpidtensor's moves nothing on one rank; the local-op steps have
    none), and mpidtensor's step makes more Python calls than Megatron's."""
    import profile_general

    results = profile_general.main(["--reps", "1"])
    ok = sorted(results) == sorted(["mpidtensor", "mpi4py", "local ops of mpidtensor", "local ops of mpi4py"])
    ok = ok and all(len(r["phases"]) == len(profile_general.PHASES) + 1 and min(r["phases"]) >= 0
                    for r in results.values())
    ok = ok and results["mpi4py"]["phases"][-1] > 0 and (results["mpidtensor"]["phases"][-1] > 0) == (WORLD.size > 1)
    ok = ok and all(results[name]["phases"][-1] == 0 for name in ("local ops of mpidtensor", "local ops of mpi4py"))
    ok = ok and results["mpidtensor"]["calls"] > results["mpi4py"]["calls"] > 0
    assert_all_ranks(ok, str(results))
