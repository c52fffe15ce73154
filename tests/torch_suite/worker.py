"""One MPI job of the torch-suite runner: every rank imports one of torch's test files and runs
the same ordered test methods with ``self.rank`` = its MPI rank.

    python -m torch_suite.worker list FILE                  (one process: the plan, as JSON)
    mpiexec -n N python -m torch_suite.worker run --backend torch|mdt --file FILE \
        --tests Class.test_a,Class.test_b --out RESULTS --store DIR --timeout S

``--backend torch``: torch's DTensor over gloo, ranks from MPI, a file store every rank shares
(the reference). ``--backend mdt``: the switch installed first and torch's helpers routed to
mpidtensor's modules (:mod:`.routing`). After each test one ``allgather`` over
``MPI.COMM_WORLD`` agrees on its outcome; rank 0 appends ``start`` and ``result`` lines to
RESULTS (JSON lines), which the driver watches for hangs. Each rank also writes its own outcome
to ``RESULTS.rank<r>`` before agreeing, and its stacks to ``RESULTS.stacks<r>`` when a test
outlives ``--timeout``, so a hang's report says who was where.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

SIMULATED = ("LocalDTensorTestBase", "LocalDTensorContinuousTestBase", "LocalDTensorOpTestBase")
MESSAGE_CHARS = 600


def load_test_file(path: Path) -> Any:
    """Import ``path`` as a module named after its stem (user code to the switch)."""
    sys.argv = [str(path)]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _bases(cls: type) -> set[str]:
    return {base.__name__ for base in cls.__mro__}


def class_kind(cls: type) -> tuple[str, str]:
    """``(kind, why)``: ``"spawn"`` (a MultiProcessTestCase: the test inits its own group
    via ``with_comms``), ``"group"`` (a class whose harness makes the group: the runner does),
    ``"plain"`` (a TestCase run at one rank without a group) or ``"by_design"`` (not a
    multi-rank test: simulated ranks in one process, or a fake process group)."""
    bases = _bases(cls)
    simulated = bases.intersection(SIMULATED)
    if simulated:
        return "by_design", f"simulates ranks in one process ({sorted(simulated)[0]})"
    if "MultiProcessTestCase" in bases:
        return "spawn", ""
    if bases.intersection({"MultiProcContinuousTest", "MultiThreadedTestCase"}):
        return "group", ""
    source = ""
    for klass in cls.__mro__:  # the class and its bases in the test file (test_utils' LocalTensorTestBase)
        if klass.__module__ == cls.__module__:
            try:
                source += inspect.getsource(klass)
            except (OSError, TypeError):
                pass
    if '"fake"' in source or "'fake'" in source or "FakeStore" in source:
        return "by_design", "uses a fake process group in one process"
    return "plain", ""


def world_size_of(cls: type, kind: str, default: int) -> int:
    """The class's world size as torch's harness reads it (a property or a class attribute);
    torch's unset ``-2`` (the device count) is ``default`` (torch's NUM_DEVICES, 4, on CPU)."""
    if kind in ("plain", "by_design"):
        return 1
    attr = inspect.getattr_static(cls, "world_size", None)
    size = attr.fget(object.__new__(cls)) if isinstance(attr, property) else getattr(cls, "world_size", default)
    return default if size in (-1, -2) else int(size)


def plan(path: Path) -> list[dict]:
    """The file's test classes in file order: name, kind, why, world size, test methods."""
    module = load_test_file(path)
    default = getattr(sys.modules.get("torch.testing._internal.distributed._tensor.common_dtensor"), "NUM_DEVICES", 4)
    loader = unittest.TestLoader()
    classes = [obj for obj in vars(module).values()
               if isinstance(obj, type) and issubclass(obj, unittest.TestCase) and obj.__module__ == module.__name__]
    out = []
    for cls in classes:
        methods = list(loader.getTestCaseNames(cls))
        if not methods:
            continue
        kind, why = class_kind(cls)
        out.append({"class": cls.__name__, "kind": kind, "why": why, "world_size": world_size_of(cls, kind, default),
                    "tests": methods})
    return out


class Backend:
    """How a test's default process group is made and torn down on one side."""

    def __init__(self, name: str, store: Path) -> None:
        self.name, self.store = name, store
        if name == "mdt":
            from . import routing
            routing.install()
            from mpidtensor import install_torch_distributed
            install_torch_distributed()
        import importlib
        self.dist = importlib.import_module("torch.distributed")  # under the switch: its view

    def init_group(self, rank: int, size: int, file_name: str) -> None:
        if not self.dist.is_initialized():
            self.dist.init_process_group("gloo", init_method=f"file://{file_name}", rank=rank, world_size=size)

    def clear(self) -> None:
        """No group left behind by a test (a failed one keeps its group)."""
        if self.dist.is_initialized():
            try:
                self.dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group: the next test makes a new one
                pass


def _prepare(cls: type, test: str, rank: int, size: int, file_name: str) -> unittest.TestCase:
    """The instance torch's harness would build in a spawned rank, built here without spawning."""
    if hasattr(cls, "_processes_spawned"):
        cls._processes_spawned = True  # MultiProcContinuousTest: no worker processes
        cls.world_size, cls.rank = size, rank
        cls.processes, cls.task_queues, cls.completion_queues = [], [], []
    case = cls(test)
    case._spawn_processes = lambda: None
    case._spawn_threads = lambda: None
    case.setUp()
    case.rank = rank
    case.file_name = file_name
    if "MultiProcContinuousTest" in _bases(cls):
        os.environ["LOCAL_RANK"] = str(rank)
    return case


def _skip_reason(cls: type, method: Any) -> str | None:
    for holder in (cls, method):
        if getattr(holder, "__unittest_skip__", False):
            return getattr(holder, "__unittest_skip_why__", "") or "skipped"
    return None


def run_one(cls: type, test: str, kind: str, rank: int, size: int, file_name: str, backend: Backend) -> dict:
    """Run one test on this rank: ``{"status": pass|fail|skip, "message": ...}``."""
    from torch.testing._internal.common_distributed import TEST_SKIPS
    skip_codes = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
    method = getattr(cls, test)
    reason = _skip_reason(cls, method)
    if reason is not None:
        return {"status": "skip", "message": reason}
    expecting_failure = getattr(method, "__unittest_expecting_failure__", False)
    case = None
    try:
        if kind == "group":
            backend.init_group(rank, size, file_name)
        case = _prepare(cls, test, rank, size, file_name)
        try:
            getattr(case, test)()
        finally:
            case.tearDown()
        status, message = ("fail", "unexpected success") if expecting_failure else ("pass", "")
    except unittest.SkipTest as skip:
        status, message = "skip", str(skip)
    except SystemExit as stop:
        status, message = ("skip", skip_codes[stop.code]) if stop.code in skip_codes else \
            ("fail", f"SystemExit({stop.code})")
    except BaseException as err:  # noqa: BLE001 - every failure is this test's outcome
        if expecting_failure:
            status, message = "pass", "expected failure"
        else:
            status = "fail"
            message = f"{type(err).__name__}: {err}"[:MESSAGE_CHARS] + "\n" + _where(err)
    return {"status": status, "message": message}


def _where(err: BaseException) -> str:
    """The innermost frames of the traceback, short."""
    frames = traceback.extract_tb(err.__traceback__)[-3:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))


def agree(outcomes: list[dict]) -> dict:
    """One outcome from every rank's: fail if any failed (the lowest such rank's message),
    else skip if any skipped, else pass."""
    seconds = max(outcome.get("seconds", 0.0) for outcome in outcomes)
    for status in ("fail", "skip"):
        for rank, outcome in enumerate(outcomes):
            if outcome["status"] == status:
                return {"status": status, "rank": rank, "message": outcome["message"], "seconds": seconds}
    return {"status": "pass", "message": "", "seconds": seconds}


def run(args: argparse.Namespace) -> None:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    out = Path(args.out)
    backend = Backend(args.backend, Path(args.store))
    module = load_test_file(Path(args.file))
    kinds = {}
    results = out.open("a", buffering=1) if rank == 0 else None
    mine = Path(f"{out}.rank{rank}").open("a", buffering=1)
    stacks = Path(f"{out}.stacks{rank}").open("a")
    for index, test_id in enumerate(args.tests.split(",")):
        class_name, test = test_id.split(".")
        cls = getattr(module, class_name)
        kind = kinds.setdefault(class_name, class_kind(cls)[0])
        if results:
            results.write(json.dumps({"event": "start", "test": test_id}) + "\n")
        file_name = str(Path(args.store) / f"{os.getpid() if size == 1 else world.bcast(os.getpid())}-{index}")
        stacks.write(f"== {test_id}\n")
        stacks.flush()
        faulthandler.dump_traceback_later(args.timeout, file=stacks)
        start = time.perf_counter()
        outcome = run_one(cls, test, kind, rank, size, file_name, backend)
        outcome["seconds"] = round(time.perf_counter() - start, 2)
        faulthandler.cancel_dump_traceback_later()
        mine.write(json.dumps({"test": test_id, **outcome}) + "\n")
        agreed = agree(world.allgather(outcome))
        backend.clear()  # after every rank is done: a rank that skips at once must not close gloo's
        # connections while the others still make them ("Gloo connectFullMesh failed")
        if results:
            results.write(json.dumps({"event": "result", "test": test_id, **agreed}) + "\n")
    if results:
        results.close()
    # MPICH's Hydra kills every rank with SIGKILL once one exits without MPI_Finalize, which
    # ``main`` skips: no rank may exit before rank 0 has written the last result.
    world.Barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torch_suite.worker")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list")
    listing.add_argument("file")
    running = sub.add_parser("run")
    running.add_argument("--backend", choices=("torch", "mdt"), required=True)
    running.add_argument("--file", required=True)
    running.add_argument("--tests", required=True)
    running.add_argument("--out", required=True)
    running.add_argument("--store", required=True)
    running.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.command == "list":
        print(json.dumps(plan(Path(args.file))))
    else:
        run(args)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: a test's leftover threads or groups cannot hang the job's end


if __name__ == "__main__":
    main()
