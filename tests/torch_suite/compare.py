"""torch's recorded outcomes (``expected.json``), the documented differences
(``docs/torch-conformance.md``) and the comparison of a run on mpidtensor with both.

A test that passes on torch and does not pass here is a difference; the tier fails on a
difference that the document does not list (one table row per test: file, test, cause, reason).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = Path(__file__).resolve().with_name("expected.json")
DOC = ROOT / "docs" / "torch-conformance.md"
CAUSES = ("torch internal", "public call raises", "collective counts", "behaviour", "hang", "value", "runner")
_ROW = re.compile(r"^\|\s*(test_\w+\.py)\s*\|\s*`?(\w+\.\w+)`?\s*\|\s*([^|]+?)\s*\|\s*(.+?)\s*\|\s*$")


def load_expected(path: Path = EXPECTED) -> dict[str, dict[str, str]]:
    """``{file: {Class.test: torch's status}}``."""
    return json.loads(path.read_text())["files"]


def save_expected(records: dict[str, dict[str, dict]], torch_version: str, path: Path = EXPECTED) -> None:
    files = {name: {test: rec["status"] for test, rec in sorted(tests.items())}
             for name, tests in sorted(records.items())}
    path.write_text(json.dumps({"torch": torch_version, "files": files}, indent=1, sort_keys=True) + "\n")


def listed_hangs(listed: dict[tuple[str, str], tuple[str, str]], name: str) -> frozenset[str]:
    """The tests of file ``name`` the document lists as hangs: the everyday run skips them
    (each would cost the per-test timeout); ``--run-hangs`` runs them."""
    return frozenset(test for (file, test), (cause, _) in listed.items() if file == name and cause == "hang")


def load_listed(doc: Path = DOC) -> dict[tuple[str, str], tuple[str, str]]:
    """The documented differences: ``{(file, Class.test): (cause, reason)}``; a cause outside
    :data:`CAUSES` is a ``ValueError`` (the list is the contract: keep it exact)."""
    listed = {}
    if not doc.exists():
        return listed
    for line in doc.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            name, test, cause, reason = match.groups()
            if cause not in CAUSES:
                raise ValueError(f"{doc.name}: {name} {test}: cause {cause!r} is not one of {CAUSES}")
            listed[(name, test)] = (cause, reason)
    return listed


@dataclass
class FileReport:
    name: str
    torch_passed: int = 0
    passed: int = 0  # of those that pass on torch
    listed: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)  # "Class.test: status: message"
    better: list[str] = field(default_factory=list)  # pass here, not on torch
    stale: list[str] = field(default_factory=list)  # listed, but passes here now
    by_design: int = 0


def compare(records: dict[str, dict[str, dict]], expected: dict[str, dict[str, str]],
            listed: dict[tuple[str, str], tuple[str, str]]) -> list[FileReport]:
    """Per file: how many pass on torch, how many of those pass here, and every difference."""
    reports = []
    for name, tests in sorted(records.items()):
        want = expected.get(name, {})
        report = FileReport(name)
        for test, rec in sorted(tests.items()):
            torch_status = want.get(test)
            if rec["status"] == "by_design":
                report.by_design += 1
                continue
            if rec["status"] == "not_run" and (name, test) not in listed:  # left out by --max-ranks
                continue
            if torch_status == "pass":
                report.torch_passed += 1
                if rec["status"] == "pass":
                    report.passed += 1
                    if (name, test) in listed:
                        report.stale.append(test)
                elif (name, test) in listed:
                    report.listed.append(test)
                else:
                    first = rec["message"].splitlines()[0][:240] if rec["message"] else ""
                    report.unlisted.append(f"{test}: {rec['status']}: {first}")
            elif rec["status"] == "pass" and torch_status is not None:
                report.better.append(f"{test} (torch: {torch_status})")
        reports.append(report)
    return reports


def guess_cause(status: str, message: str, line: str = "") -> str:
    """A first guess at a difference's cause class from its record and the test's line that
    failed (``line``), for ``draft``; each row is reviewed before it goes into the document."""
    first = message.splitlines()[0] if message else ""
    if status == "hang":
        return "hang"
    if status == "crash":
        return "runner"
    if "_local_tensor" not in first and re.search(r"has no attribute '_\w+'|torch\.distributed\.tensor\._|"
                                                  r"DTensorSpec|_MaskPartial|_StridedShard|_op_dispatcher", first):
        return "torch internal"
    if first.startswith("AssertionError"):
        if re.search(r"comm_mode|CommDebugMode|get_comm_counts|get_total_counts|comm_counts|funcol|c10d", line):
            return "collective counts"
        if re.search(r"not close|Mismatched elements|Greatest absolute difference", message):
            return "value"
        return "behaviour"
    return "public call raises"


def _failed_line(path: Path, message: str) -> str:
    """The source line of ``path`` that the message's traceback names, with the next one."""
    found = re.search(re.escape(path.name) + r":(\d+)", message)
    if not found or not path.exists():
        return ""
    lines = path.read_text().splitlines()
    at = int(found.group(1)) - 1
    return " ".join(lines[max(at - 1, 0):at + 2])


def draft_rows(records: dict[str, dict[str, dict]], expected: dict[str, dict[str, str]],
               listed: dict[tuple[str, str], tuple[str, str]], test_dir: Path) -> list[str]:
    """Document rows for every unlisted difference: file, test, guessed cause, the error's first line."""
    rows = []
    for name, tests in sorted(records.items()):
        for test, rec in sorted(tests.items()):
            if expected.get(name, {}).get(test) != "pass" or rec["status"] in ("pass", "by_design"):
                continue
            if (name, test) in listed:
                continue
            first = (rec["message"].splitlines() or [""])[0].replace("|", "/")[:200]
            cause = guess_cause(rec["status"], rec["message"], _failed_line(test_dir / name, rec["message"]))
            rows.append(f"| {name} | `{test}` | {cause} | {first} |")
    return rows


def table(reports: list[FileReport]) -> str:
    """The per-file table, markdown."""
    rows = ["| file | passed on torch | passed here | listed | unlisted | not multi-rank |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    totals = [0, 0, 0, 0, 0]
    for r in reports:
        cells = [r.torch_passed, r.passed, len(r.listed), len(r.unlisted), r.by_design]
        totals = [a + b for a, b in zip(totals, cells)]
        rows.append(f"| {r.name} | " + " | ".join(map(str, cells)) + " |")
    rows.append("| **total** | " + " | ".join(f"**{t}**" for t in totals) + " |")
    return "\n".join(rows)


def details(reports: list[FileReport]) -> str:
    lines = []
    for r in reports:
        for title, items in (("NOT LISTED (fails the tier)", r.unlisted), ("listed but passes now", r.stale),
                             ("passes here, not on torch", r.better)):
            if items:
                lines.append(f"{r.name}: {title}:")
                lines += [f"  {item}" for item in items]
    return "\n".join(lines)
