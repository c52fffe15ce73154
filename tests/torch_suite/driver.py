"""The torch-suite driver: plans each test file (its classes, world sizes, tests), runs each
class's tests in MPI jobs of its world size (:mod:`.worker`), watches every test, and turns
the jobs' result lines into one record per test.

A test that makes no progress within the per-test timeout is a hang: the job is killed (its
whole process group) and the file resumes after that test in a new job. A job that dies in a
test (a crash) is handled the same way. On torch's side every test that fails, hangs or
crashes is run once more in a new job before it is recorded: gloo's rendezvous fails now and
then ("Gloo connectFullMesh failed") and the next test then waits for a peer that is gone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpidtensor.tools import launcher

TESTS_DIR = Path(__file__).resolve().parents[1]
GLOO_FLAKES = ("connectFullMesh", "Connection refused", "Connection reset by peer", "Socket Timeout")
STARTUP_S = 240.0  # importing torch and a test file on loaded shared cores
POLL_S = 0.25


@dataclass
class Settings:
    backend: str  # "torch" (gloo, the reference) or "mdt" (the switch)
    timeout: float = 180.0  # seconds one test may take before it is a hang
    max_ranks: int = 8  # classes above this world size are not run (recorded as skipped)
    only: set[str] = field(default_factory=set)  # class names to run (empty: all)
    log: bool = True


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return launcher.nested_env({"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                "PYTHONUNBUFFERED": "1", "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"})


def list_file(path: Path) -> list[dict]:
    """The worker's plan of ``path`` (one plain process, torch's modules)."""
    done = subprocess.run([sys.executable, "-m", "torch_suite.worker", "list", str(path)], env=_env(),
                          capture_output=True, text=True, timeout=STARTUP_S, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"planning {path.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def _stuck(out: Path, test: str, ranks: int, timeout: float) -> dict:
    """The record of a test that made no progress: a failure when some rank failed in it
    (the others then blocked, e.g. in ``destroy_pg``'s barrier), else a hang."""
    failed = [r for rank in range(ranks) for r in _read(Path(f"{out}.rank{rank}"))
              if r.get("test") == test and r["status"] == "fail"]
    where = f"no result within {timeout:.0f} s; " + _stalled(out, test, ranks)
    if failed:
        return {"status": "fail", "message": f"{failed[0]['message']}\n(other ranks blocked: {where})"}
    return {"status": "hang", "message": where}


def _stalled(work: Path, test: str, ranks: int) -> str:
    """Who was where when ``test`` hung: each rank's own outcome or its innermost stack frames."""
    notes = []
    for rank in range(ranks):
        own = [r for r in _read(Path(f"{work}.rank{rank}")) if r.get("test") == test]
        if own:
            notes.append(f"rank {rank}: {own[-1]['status']} {own[-1]['message'][:200]}")
            continue
        stacks = Path(f"{work}.stacks{rank}")
        text = stacks.read_text(errors="replace") if stacks.exists() else ""
        block = text.rsplit(f"== {test}\n", 1)[-1] if f"== {test}\n" in text else ""
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")][:3]
        notes.append(f"rank {rank}: in the test" + (f" at {' <- '.join(frames)}" if frames else ""))
    return "; ".join(notes)


def run_tests(path: Path, tests: list[str], ranks: int, settings: Settings, work_dir: Path) -> dict[str, dict]:
    """Run ``tests`` (``Class.test`` ids, in order) of ``path`` in jobs of ``ranks`` ranks until
    each has a record; hangs and crashes end a job and the next job resumes after the test."""
    records: dict[str, dict] = {}
    pending = list(tests)
    job = 0
    # Each call its own folder: two classes of one file at one world size must not share result files.
    folder = Path(tempfile.mkdtemp(prefix=f"{path.stem}-{ranks}-", dir=work_dir))
    while pending:
        job += 1
        out, log_path = folder / f"job{job}.jsonl", folder / f"job{job}.log"
        store = Path(tempfile.mkdtemp(prefix="store-", dir=folder))
        argv = [sys.executable, "-m", "torch_suite.worker", "run", "--backend", settings.backend, "--file", str(path),
                "--tests", ",".join(pending), "--out", str(out), "--store", str(store),
                "--timeout", str(settings.timeout * 0.8)]
        log = log_path.open("w")
        proc = subprocess.Popen(launcher.command(ranks, argv), env=_env(), cwd=folder, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            current = _watch(proc, out, ranks, settings, records)
        finally:
            if proc.poll() is None:  # the driver itself was stopped: take the job down with it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        if current is not None and current not in records:  # the job died inside the test
            tail = log_path.read_text(errors="replace")[-800:]
            records[current] = {"status": "crash", "message": f"job exited {proc.returncode} in the test: {tail}"}
        if not any(t in records for t in pending) and current is None:  # the job died before its first test
            tail = log_path.read_text(errors="replace")[-1500:]
            for test in pending:
                records[test] = {"status": "crash", "message": f"job exited {proc.returncode} before the test: {tail}"}
        pending = [t for t in pending if t not in records]
    return records


def _watch(proc: subprocess.Popen, out: Path, ranks: int, settings: Settings, records: dict[str, dict]) -> str | None:
    """Follow the job's result lines into ``records`` until it ends, or kill it when a test
    makes no progress in time (recorded as a hang); the test it was in when it ended, if any."""
    seen, deadline, current = 0, time.monotonic() + STARTUP_S + settings.timeout, None
    while True:
        ended = proc.poll() is not None  # before reading: the last lines come before the job's end
        lines = _read(out)
        for line in lines[seen:]:
            if line["event"] == "start":
                current = line["test"]
            else:
                records[line["test"]] = {k: v for k, v in line.items() if k not in ("event", "test")}
                current = None
            deadline = time.monotonic() + settings.timeout
        seen = len(lines)
        if ended:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            lines = _read(out)  # a result written at the last moment
            if lines and lines[-1]["event"] == "result":
                current = None
                records[lines[-1]["test"]] = {k: v for k, v in lines[-1].items() if k not in ("event", "test")}
            if current is not None:
                records[current] = _stuck(out, current, ranks, settings.timeout)
            break
        time.sleep(POLL_S)
    return current


def _flaky(record: dict) -> bool:
    """Whether a failure is gloo's own (its rendezvous or a connection), not the test's."""
    return record["status"] in ("fail", "hang", "crash") and any(s in record["message"] for s in GLOO_FLAKES)


def run_file(path: Path, settings: Settings, work_dir: Path, skip: frozenset[str] = frozenset()) -> dict[str, dict]:
    """Every test of ``path``: ``{Class.test: {"status", "message", "ranks", "seconds"?}}``; classes
    that are not multi-rank tests recorded as ``by_design``; the tests in ``skip`` (documented
    hangs: each costs the timeout) recorded as ``not_run``."""
    records: dict[str, dict] = {}
    path = path.resolve()  # the jobs run in the work folder
    for entry in list_file(path):
        ids = [f"{entry['class']}.{test}" for test in entry["tests"]]
        ranks = entry["world_size"]
        if settings.only and entry["class"] not in settings.only:
            continue
        if entry["kind"] == "by_design":
            records.update({i: {"status": "by_design", "message": entry["why"], "ranks": ranks} for i in ids})
            continue
        if ranks > settings.max_ranks:
            records.update({i: {"status": "not_run", "message": f"world size {ranks} > {settings.max_ranks} (not run)",
                                "ranks": ranks} for i in ids})
            continue
        start = time.monotonic()
        records.update({i: {"status": "not_run", "message": "a documented hang: not run", "ranks": ranks}
                        for i in ids if i in skip})
        ids = [i for i in ids if i not in skip]
        if not ids:
            continue
        got = run_tests(path, ids, ranks, settings, work_dir)
        if settings.backend == "torch":  # gloo's rendezvous fails now and then, and the next test waits
            again = [i for i in ids if got[i]["status"] in ("fail", "hang", "crash")]
            if again:
                rerun = run_tests(path, again, ranks, settings, work_dir)
                got.update({i: rerun[i] for i in again if rerun[i]["status"] == "pass" or not _flaky(rerun[i])})
        for i in ids:
            got[i]["ranks"] = ranks
        records.update({i: got[i] for i in ids})
        if settings.log:
            passed = sum(got[i]["status"] == "pass" for i in ids)
            print(f"  {path.name} {entry['class']} at {ranks}: {passed}/{len(ids)} passed, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
    return records
