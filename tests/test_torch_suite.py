"""torch's own DTensor tests as the contract (tests/torch_suite, docs/torch-conformance.md).

The tier (full tier, at world size 1: it starts its own jobs at each class's world size) runs
the test files of ../shared/torch-tests on mpidtensor under the switch and compares each test
with torch's recorded outcome (tests/torch_suite/expected.json, ``make torch-expect``): a test
that passes on torch and not here fails the tier unless docs/torch-conformance.md lists it.
The runner's own behaviour (helpers routed, one-rank failures, hangs resumed after, simulated
ranks left out) is checked on a small torch-style file on both sides.
"""
from __future__ import annotations

import json

import pytest
from mpi4py import MPI

from torch_suite import compare, driver
from torch_suite.__main__ import DEFAULT_DIR
from torch_suite.worker import agree

WORLD = MPI.COMM_WORLD
SAMPLE = driver.TESTS_DIR / "torch_suite" / "sample_suite.py"
at_one_rank = pytest.mark.skipif(WORLD.size != 1, reason="runs at world size 1: it starts its own jobs")


def test_agree_takes_any_failure_then_any_skip():
    ok, skip = {"status": "pass", "message": ""}, {"status": "skip", "message": "no gpu"}
    bad = {"status": "fail", "message": "AssertionError: 1 != 0"}
    assert agree([ok, ok])["status"] == "pass"
    assert agree([ok, skip])["status"] == "skip"
    assert agree([ok, skip, bad]) == {"status": "fail", "rank": 2, "message": bad["message"], "seconds": 0.0}


def test_listed_differences_parse_and_unlisted_fail(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("| file | test | cause | reason |\n| --- | --- | --- | --- |\n"
                   "| test_x.py | `A.test_one` | torch internal | Shard._split_tensor |\n")
    listed = compare.load_listed(doc)
    assert listed == {("test_x.py", "A.test_one"): ("torch internal", "Shard._split_tensor")}
    records = {"test_x.py": {"A.test_one": {"status": "fail", "message": "x"},
                             "A.test_two": {"status": "hang", "message": "stuck"},
                             "A.test_three": {"status": "pass", "message": ""},
                             "A.test_four": {"status": "by_design", "message": "simulated"}}}
    expected = {"test_x.py": {"A.test_one": "pass", "A.test_two": "pass", "A.test_three": "fail"}}
    (report,) = compare.compare(records, expected, listed)
    assert (report.torch_passed, report.passed, report.listed, report.by_design) == (2, 0, ["A.test_one"], 1)
    assert report.unlisted == ["A.test_two: hang: stuck"] and report.better == ["A.test_three (torch: fail)"]
    doc.write_text("| test_x.py | A.test_one | because | why |\n")
    with pytest.raises(ValueError, match="cause"):
        compare.load_listed(doc)


class _JobThatEndsAsItWrites:
    """A finished job whose last result line lands between the driver's read and its poll."""

    def __init__(self, out, line):
        self.out, self.line, self.pid = out, line, -1

    def poll(self):
        with self.out.open("a") as f:
            f.write(self.line)
        return 0


def test_watch_reads_the_last_result_of_a_job_that_just_ended(tmp_path):
    """A race once recorded a passing test as a crash (CI, 2026-12-07): the job wrote its last
    result and ended after the driver read the file but before it polled the job."""
    out = tmp_path / "job1.jsonl"
    out.write_text(json.dumps({"event": "start", "test": "A.test_x"}) + "\n")
    line = json.dumps({"event": "result", "test": "A.test_x", "status": "pass", "message": ""}) + "\n"
    records: dict[str, dict] = {}
    current = driver._watch(_JobThatEndsAsItWrites(out, line), out, 2, driver.Settings("mdt"), records)
    assert current is None and records == {"A.test_x": {"status": "pass", "message": ""}}


def test_classes_at_one_world_size_get_their_own_files(tmp_path, monkeypatch):
    """Two classes of a file at one world size once shared ``FILE-RANKS-JOB`` result files."""
    seen = []
    monkeypatch.setattr(driver, "_watch", lambda proc, out, ranks, settings, records: seen.append(out) or
                        records.update({t: {"status": "pass", "message": ""} for t in ("A.t", "B.t")}))
    monkeypatch.setattr(driver.launcher, "command", lambda ranks, argv: ["true"])
    for test in ("A.t", "B.t"):
        driver.run_tests(SAMPLE, [test], 2, driver.Settings("mdt"), tmp_path)
    assert len(set(seen)) == 2, seen


def test_every_listed_difference_names_a_known_cause():
    compare.load_listed()  # raises on a row whose cause is not one of compare.CAUSES


@at_one_rank
@pytest.mark.exhaustive
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["mdt"])  # "torch" as well: 95 s more; make torch-expect runs that side
def test_runner_isolates_failures_and_hangs(backend, tmp_path):
    """A failure on one rank and a hang on one rank each cost that test only (passed on both
    sides, 95 s each, 2026-12-05)."""
    records = driver.run_file(SAMPLE, driver.Settings(backend, timeout=25, log=False), tmp_path)
    status = {test.split(".")[1]: record["status"] for test, record in records.items()}
    assert status == {"test_a_passes": "pass", "test_b_fails_on_one_rank": "fail", "test_c_hangs_on_one_rank": "hang",
                      "test_d_runs_after_the_hang": "pass", "test_e_helpers_see_the_same_dtensor": "pass",
                      "test_simulated": "by_design"}, records
    if backend == "mdt":  # the others block in destroy_pg's barrier; gloo's barrier fails on torch instead
        assert "rank 1" in records["SampleTest.test_b_fails_on_one_rank"]["message"]
    assert "rank 1: in the test" in records["SampleTest.test_c_hangs_on_one_rank"]["message"]


@at_one_rank
@pytest.mark.exhaustive
@pytest.mark.skipif(not DEFAULT_DIR.is_dir(), reason=f"torch's test files are absent ({DEFAULT_DIR}: the shared/ "
                                                     "folder beside the clone)")
@pytest.mark.timeout(3600)
def test_torch_suite_conforms(tmp_path):
    """Every test of torch's files that passes on torch passes here or is listed with its reason."""
    listed = compare.load_listed()
    records = {path.name: driver.run_file(path, driver.Settings("mdt"), tmp_path,
                                          compare.listed_hangs(listed, path.name))
               for path in sorted(DEFAULT_DIR.glob("test_*.py"))}
    reports = compare.compare(records, compare.load_expected(), listed)
    unlisted = [f"{r.name} {item}" for r in reports for item in r.unlisted]
    assert not unlisted, compare.table(reports) + "\n" + compare.details(reports)
