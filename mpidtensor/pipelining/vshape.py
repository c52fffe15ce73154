"""Schedules of two stages per rank placed in a V (rank ``r`` holds stages ``r`` and
``2P - 1 - r``, so the first and last stage share rank 0): ZBV zero bubble and DualPipeV.
Rank ``r``'s two stages are called ``down`` (``r``) and ``up`` (``2P - 1 - r``)."""
from __future__ import annotations

from collections import defaultdict, deque

from .actions import B, F, I, W, Action
from .base import PipelineScheduleMulti


class _Builder:
    """An order under construction with a micro-batch counter per stage and kind; ``I``
    and ``B`` share the backward counter, and each ``I`` queues its ``W``."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.count: dict[tuple[int, str], int] = defaultdict(int)
        self.weights: deque[Action] = deque()

    def add(self, stage: int, kind: str) -> None:
        key = (stage, I if kind in (B, I) else kind)
        action = Action(stage, kind, self.count[key])
        self.count[key] += 1
        self.order.append(action)
        if kind == I:
            self.weights.append(action._replace(kind=W))

    def weight(self) -> None:
        """The oldest pending ``W``, if any."""
        if self.weights:
            self.order.append(self.weights.popleft())


def zbv_order(rank: int, P: int, n: int) -> list[Action]:
    """ZB-V (https://arxiv.org/pdf/2401.10241, section 6): forwards down the V, the up
    stage starts its I/W as soon as its first micro-batch is back, then a steady state of
    F, I, W on each stage, and a cool-down of the pending I and W. Planned for at least
    ``2P - 1`` micro-batches; the actions of micro-batches beyond ``n`` are dropped."""
    down, up = rank, 2 * P - 1 - rank
    planned = max(2 * P - 1, n)
    b = _Builder()
    for _ in range(2 * (P - rank) - 1):
        b.add(down, F)
    for _ in range(rank):
        b.add(up, F)
        b.add(down, F)
    for _ in range(P - rank):
        b.add(up, F)
        b.add(up, I)
        b.weight()
    while b.count[up, F] < b.count[down, F] or b.count[down, F] < planned:
        if b.count[down, F] < planned:
            b.add(down, F)
        b.add(down, I)
        b.weight()
        b.add(up, F)
        b.add(up, I)
        b.weight()
    for _ in range(rank):
        b.add(down, I)
        b.add(up, I)
    # the cool-down runs the down stage's weights first, then every remaining one
    ups = deque(w for w in b.weights if w.stage_index == up)
    downs = deque(w for w in b.weights if w.stage_index == down)
    for _ in range(P - rank):
        b.add(down, I)
        downs.append(b.weights.pop())
        b.order.append(downs.popleft())
    b.order += list(ups) + list(downs)
    return [a for a in b.order if a.microbatch_index < n]


def dualpipev_order(rank: int, P: int, n: int) -> list[Action]:
    """DualPipeV (DeepSeek, https://arxiv.org/pdf/2412.19437): as its reference code, with
    each overlapped forward+backward pair run one after the other (F, then B)."""
    down, up = rank, 2 * P - 1 - rank
    b = _Builder()
    for _ in range(2 * (P - rank - 1)):
        b.add(down, F)
    for _ in range(rank + 1):
        b.add(down, F)
        b.add(up, F)
    for _ in range(P - rank - 1):
        b.add(up, I)
        b.weight()
        b.add(up, F)
    for _ in range(n - 2 * P + rank + 1):
        b.add(down, F)
        b.add(up, B)
        b.add(up, F)
        b.add(down, B)
    for _ in range(P - rank - 1):
        b.add(up, B)
        b.add(up, F)
        b.add(down, B)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        split = split or (i == half and rank % 2 == 1)
        b.add(up, I if split else B)
        split = split or (i == half and rank % 2 == 0)
        b.add(down, I if split else B)
    for _ in range(P - rank - 1):
        b.weight()
        b.add(down, I if split else B)
    for _ in range(rank + 1):
        b.weight()
    while b.weights:
        b.weight()
    return b.order


class _VShape(PipelineScheduleMulti):
    style = "v"
    stages_per_rank = 2


class ScheduleZBVZeroBubble(_VShape):
    """ZB-V zero bubble: two stages per rank in a V, backward split into I and W."""

    def _order(self, rank: int) -> list[Action]:
        return zbv_order(rank, self.pp_group_size, self._n_microbatches)


class ScheduleDualPipeV(_VShape):
    """DualPipeV (torch's rule: n_microbatches >= num_stages)."""

    def _rules(self) -> list[str]:
        if self._n_microbatches < self._num_stages:
            return [f"ScheduleDualPipeV needs n_microbatches >= num_stages ({self._num_stages}), "
                    f"got {self._n_microbatches}"]
        return []

    def _order(self, rank: int) -> list[Action]:
        return dualpipev_order(rank, self.pp_group_size, self._n_microbatches)
