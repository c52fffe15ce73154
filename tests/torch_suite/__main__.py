"""The torch-suite tier from the command line (run with ``tests`` on ``sys.path``):

    python -m torch_suite expect [--dir DIR]   run torch's test files on torch over gloo and
                                               write torch's outcomes to expected.json
    python -m torch_suite check  [--dir DIR]   run them on mpidtensor (the switch), compare with
                                               expected.json and docs/torch-conformance.md;
                                               exit 1 on a difference the document does not list
    python -m torch_suite draft --records PATH  rows for docs/torch-conformance.md: every
                                               difference in a check's --results file that
                                               the document does not list, cause guessed

Options: ``--files test_a.py,...`` (a subset), ``--max-ranks N`` (classes above N ranks are not
run), ``--timeout S`` (per test), ``--results PATH`` (every record, JSON), ``--run-hangs`` (also
run the tests the document lists as hangs, which ``check`` otherwise leaves out).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from . import compare, driver

DEFAULT_DIR = compare.ROOT.parent / "shared" / "torch-tests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_suite")
    parser.add_argument("command", choices=("expect", "check", "draft"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--files", default="")
    parser.add_argument("--max-ranks", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--results", type=Path)
    parser.add_argument("--records", type=Path)
    parser.add_argument("--run-hangs", action="store_true", help="also run the tests listed as hangs")
    args = parser.parse_args(argv)
    if args.command == "draft":
        records = json.loads(args.records.read_text())
        print("\n".join(compare.draft_rows(records, compare.load_expected(), compare.load_listed(), args.dir)))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM: the running job is taken down
    if not args.dir.is_dir():
        print(f"no torch test files at {args.dir}", file=sys.stderr)
        return 2
    files = sorted(args.dir.glob("test_*.py"))
    if args.files:
        files = [f for f in files if f.name in args.files.split(",")]
    settings = driver.Settings("torch" if args.command == "expect" else "mdt", timeout=args.timeout,
                               max_ranks=args.max_ranks)
    start = time.monotonic()
    records = {}
    listed = compare.load_listed()
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as work:
        for path in files:
            run_all = args.command == "expect" or args.run_hangs
            skip = frozenset() if run_all else compare.listed_hangs(listed, path.name)
            records[path.name] = driver.run_file(path, settings, Path(work), skip)
    wall = time.monotonic() - start
    if args.results:
        args.results.write_text(json.dumps(records, indent=1, sort_keys=True))
    if args.command == "expect":
        import torch
        expected = compare.load_expected() if compare.EXPECTED.exists() else {}
        expected.update({name: {t: r["status"] for t, r in tests.items()} for name, tests in records.items()})
        compare.save_expected({n: {t: {"status": s} for t, s in tests.items()} for n, tests in expected.items()},
                              torch.__version__)
        passed = sum(r["status"] == "pass" for tests in records.values() for r in tests.values())
        print(f"torch: {passed} of {sum(map(len, records.values()))} tests pass; wrote {compare.EXPECTED} "
              f"({wall:.0f} s)")
        return 0
    reports = compare.compare(records, compare.load_expected(), listed)
    print(compare.table(reports))
    print(compare.details(reports))
    unlisted = sum(len(r.unlisted) for r in reports)
    print(f"torch suite on mpidtensor: {unlisted} unlisted difference(s), {wall:.0f} s")
    return 1 if unlisted else 0


if __name__ == "__main__":
    sys.exit(main())
