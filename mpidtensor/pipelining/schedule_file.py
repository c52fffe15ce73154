"""Schedules read from and written to torch's CSV files (``schedule._load_csv(path)``;
torchtitan's ``pipeline_parallel_schedule_csv``).

A file holds one row per pipeline rank, each cell one action as torch writes it: ``2F0``
(forward of stage 2, micro-batch 0), ``B``, ``I`` and ``W`` alike, an empty cell for a
bubble. A ``compute_comms`` file also holds ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``,
``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` and ``(a;b)OVERLAP_F_B`` cells: the runtime here
places every message and FSDP step itself (:mod:`.runtime`), so those cells are read for
the order of the computations they hold, and the rest are checked for form and passed
over. A loaded order must be a whole schedule: every forward and every backward (``B``,
or ``I`` then ``W``) of every stage and micro-batch once, each stage on the rank that
holds it, and no rank left waiting (:func:`.actions.simulate`).
"""
from __future__ import annotations

import csv
import re

from .actions import B, I, KINDS, Action, simulate

_CELL = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
FORMATS = ("compute_only", "compute_comms")


def parse_cell(text: str, with_comms: bool) -> list[Action]:
    """The computations of one cell, in order (none for a bubble or, in a ``compute_comms``
    file, a communication or FSDP cell); ``ValueError`` naming the cell otherwise."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("(") and text.endswith(")OVERLAP_F_B"):
        return [a for part in text[1:-len(")OVERLAP_F_B")].split(";") for a in parse_cell(part, with_comms)]
    match = _CELL.fullmatch(text)
    if match is None:
        raise ValueError(f"cannot read the action {text!r}: torch writes them as stage, kind, micro-batch "
                         f"(e.g. '2F0', '1I3', '0W1')")
    stage, kind, microbatch = match.groups()
    if kind not in KINDS:
        if not with_comms:
            raise ValueError(f"the action {text!r} is a communication or FSDP action, which a compute_only "
                             f"schedule does not hold (load the file with format='compute_comms')")
        return []
    if not microbatch:
        raise ValueError(f"the action {text!r} names no micro-batch")
    return [Action(int(stage), kind, int(microbatch))]


def read(filename: str, format: str, ranks: int) -> dict[int, list[Action]]:  # noqa: A002  (torch's keyword)
    """Each rank's computations from the CSV file ``filename``; ``ValueError`` for a file of
    another number of rows than ``ranks`` or a cell that cannot be read."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    with open(filename, newline="") as f:
        rows = list(csv.reader(f))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # a trailing blank line
    if len(rows) != ranks:
        raise ValueError(f"{filename} holds {len(rows)} row(s) of actions, one per pipeline rank; "
                         f"the pipeline group has {ranks}")
    orders = {}
    for rank, row in enumerate(rows):
        try:
            orders[rank] = [a for cell in row for a in parse_cell(cell, format == "compute_comms")]
        except ValueError as err:
            raise ValueError(f"{filename}, row {rank}: {err}") from None
    return orders


def check(orders: dict[int, list[Action]], held: list[list[int]], num_stages: int,
          n_microbatches: int) -> tuple[dict[int, int], list[str]]:
    """Which rank runs each stage, and the problems of ``orders`` as a schedule for ranks
    that hold the stages ``held[rank]``: decided from what every rank holds alike."""
    problems = []
    placed: dict[int, set[int]] = {}
    for rank, order in orders.items():
        for s, kind, m in order:
            if not 0 <= s < num_stages or not 0 <= m < n_microbatches:
                problems.append(f"rank {rank} runs {Action(s, kind, m)}, outside {num_stages} stages x "
                                f"{n_microbatches} micro-batches")
            placed.setdefault(s, set()).add(rank)
    owner = {s: r for r, stages in enumerate(held) for s in stages}
    for s, ranks in sorted(placed.items()):
        if s in owner and ranks != {owner[s]}:
            problems.append(f"stage {s} is held by rank {owner[s]} but the file runs it on rank(s) {sorted(ranks)}")
    for rank, order in orders.items():
        whole = {(s, m) for s, kind, m in order if kind == B}
        both = sorted({(s, m) for s, kind, m in order if kind == I} & whole)
        problems += [f"rank {rank} runs both a whole (B) and a split (I) backward of stage {s}, micro-batch {m}"
                     for s, m in both]
    if not problems:
        problems += simulate(orders, num_stages, n_microbatches)
    return owner, problems


def write(filename: str, orders: dict[int, list[Action]]) -> None:
    """``orders`` as torch's compute-only CSV: one row per rank."""
    with open(filename, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(orders):
            writer.writerow([str(a) for a in orders[rank]])
