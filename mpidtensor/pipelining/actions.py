"""The schedule's language: per-rank ordered lists of actions, and where stages live.

An action is one computation of one stage on one micro-batch: ``F`` (forward), ``B``
(full backward), or a backward split in two for the zero-bubble schedules, ``I`` (the
input gradients, sent on at once) and ``W`` (the weight gradients, run later to fill a
bubble). Sends and receives are implied: an ``F`` of a stage that is not the last sends
its outputs to the next stage, a ``B``/``I`` of a stage that is not the first sends its
input gradients to the previous one; the runtime (:mod:`.runtime`) posts the matching
receives ahead. Every schedule family is a function from ``(rank, ...)`` to such a list;
one runtime executes them all.
"""
from __future__ import annotations

from typing import NamedTuple

F, B, I, W = "F", "B", "I", "W"  # noqa: E741  (torch's and the paper's letters)
KINDS = (F, B, I, W)


class Action(NamedTuple):
    """One computation: ``kind`` of ``stage_index`` on micro-batch ``microbatch_index``."""

    stage_index: int
    kind: str
    microbatch_index: int

    def __str__(self) -> str:
        return f"{self.stage_index}{self.kind}{self.microbatch_index}"

    __repr__ = __str__


def stage_to_rank(group_size: int, num_stages: int, style: str = "loop") -> dict[int, int]:
    """Which rank of the pipeline group holds each stage: ``loop`` deals stages round-robin
    (stage ``s`` on rank ``s % group_size``); ``v`` runs down the ranks and back up (rank
    ``r`` holds stages ``r`` and ``2 * group_size - 1 - r``, and so on for more)."""
    if style == "loop":
        return {s: s % group_size for s in range(num_stages)}
    if style == "v":
        mapping = {}
        for s in range(num_stages):
            lap, pos = divmod(s, group_size)
            mapping[s] = pos if lap % 2 == 0 else group_size - 1 - pos
        return mapping
    raise ValueError(f"unknown stage placement style {style!r}; expected 'loop' or 'v'")


def rank_to_stages(group_size: int, num_stages: int, style: str = "loop") -> dict[int, list[int]]:
    """The stages each rank holds, ascending."""
    stages: dict[int, list[int]] = {r: [] for r in range(group_size)}
    for s, r in stage_to_rank(group_size, num_stages, style).items():
        stages[r].append(s)
    return stages


def simulate(orders: dict[int, list[Action]], num_stages: int, n_microbatches: int) -> list[str]:
    """The problems of a whole schedule (every rank's list), found by running it with the
    dependencies as the runtime enforces them: an empty list means it completes (no rank
    waits forever) and does every F, and every B or I+W, of every stage and micro-batch
    once. Tests run it on each schedule; it costs O(actions x ranks)."""
    done: set[tuple[int, str, int]] = set()
    pos = {r: 0 for r in orders}
    problems = []

    def ready(a: Action) -> bool:
        s, k, m = a
        if k == F:
            return s == 0 or (s - 1, F, m) in done
        if k in (B, I):
            after = (s, F, m) in done
            return after and (s == num_stages - 1 or (s + 1, B, m) in done or (s + 1, I, m) in done)
        return (s, I, m) in done  # W

    progressed = True
    while progressed:
        progressed = False
        for r, order in orders.items():
            while pos[r] < len(order) and ready(order[pos[r]]):
                a = order[pos[r]]
                if tuple(a) in done:
                    problems.append(f"rank {r} runs {a} twice")
                done.add(tuple(a))
                pos[r] += 1
                progressed = True
    stuck = {r: order[pos[r]] for r, order in orders.items() if pos[r] < len(order)}
    if stuck:
        problems.append("deadlock: " + ", ".join(f"rank {r} waits at {a}" for r, a in stuck.items()))
    for s in range(num_stages):
        for m in range(n_microbatches):
            if (s, F, m) not in done:
                problems.append(f"{Action(s, F, m)} never runs")
            if (s, B, m) not in done and not {(s, I, m), (s, W, m)} <= done:
                problems.append(f"the backward of stage {s}, micro-batch {m} never completes")
    return problems
