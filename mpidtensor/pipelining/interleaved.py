"""Schedules of several stages per rank placed round-robin (stage ``s`` on rank
``s % P``): looped breadth-first, interleaved 1F1B and interleaved zero bubble."""
from __future__ import annotations

from collections import defaultdict, deque

from .actions import B, F, I, W, Action
from .base import PipelineScheduleMulti


def looped_bfs_order(rank: int, P: int, v: int, n: int) -> list[Action]:
    """Each local stage forwards every micro-batch before the next stage starts; the
    backwards run the stages in reverse (https://arxiv.org/abs/2211.05953)."""
    stages = [rank + l * P for l in range(v)]
    order = [Action(s, F, m) for s in stages for m in range(n)]
    return order + [Action(s, B, m) for s in reversed(stages) for m in reversed(range(n))]


def interleaved_order(rank: int, P: int, v: int, n: int, zero_bubble: bool = False) -> list[Action]:
    """Depth-first interleaving (Megatron's, https://arxiv.org/pdf/2104.04473): micro-batches
    go through the local stages in rounds of ``n // max(1, n // P)``; a warm-up of forwards
    (two per hop from the last rank, one with ``zero_bubble``), then one forward and one
    backward in turn, then the remaining backwards. With ``zero_bubble`` (ZB1P,
    https://arxiv.org/pdf/2401.10241) a backward is ``I`` and each rank keeps ``rank``
    weight passes (``W``) pending, running the oldest after each later ``I``."""
    per_round = n // max(1, n // P)
    total = n * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (P - 1 - rank), total)
    count: dict[tuple[str, int], int] = defaultdict(int)

    def next_action(kind: str, local: int) -> Action:
        s = local * P + rank
        m = count[kind, s]
        count[kind, s] += 1
        return Action(s, kind, m)

    def forward(k: int) -> Action:
        return next_action(F, (k // per_round) % v)

    def backward(k: int) -> Action:
        return next_action(I if zero_bubble else B, v - 1 - (k // per_round) % v)

    order = [forward(k) for k in range(warmup)]
    pending: deque[Action] = deque()

    def after_backward(b: Action) -> None:
        if zero_bubble:
            pending.append(b)
            if len(pending) > rank:
                order.append(pending.popleft()._replace(kind=W))

    for k in range(total):
        if k < total - warmup:
            order.append(forward(warmup + k))
        b = backward(k)
        order.append(b)
        after_backward(b)
    order += [a._replace(kind=W) for a in pending]
    return order


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Looped breadth-first: all micro-batches through a stage before the next."""

    def _order(self, rank: int) -> list[Action]:
        return looped_bfs_order(rank, self.pp_group_size, len(self._stages), self._n_microbatches)


class _Rounds(PipelineScheduleMulti):
    def _rules(self) -> list[str]:
        n, rounds = self._n_microbatches, max(1, self._n_microbatches // self.pp_group_size)
        if n % rounds:
            return [f"{type(self).__name__} needs n_microbatches to be a multiple of the number of rounds "
                    f"(n_microbatches // pipeline ranks = {rounds}), got {n}"]
        return []


class ScheduleInterleaved1F1B(_Rounds):
    """Interleaved 1F1B (torch's rule: n_microbatches a multiple of max(1, n // P))."""

    def _order(self, rank: int) -> list[Action]:
        return interleaved_order(rank, self.pp_group_size, len(self._stages), self._n_microbatches)


class ScheduleInterleavedZeroBubble(_Rounds):
    """Interleaved zero bubble (ZB1P): backward split into I and W, W filling bubbles."""

    def _order(self, rank: int) -> list[Action]:
        return interleaved_order(rank, self.pp_group_size, len(self._stages), self._n_microbatches, True)
