"""Schedules of one stage per rank: GPipe (fill and drain) and 1F1B."""
from __future__ import annotations

from .actions import B, F, Action
from .base import PipelineScheduleSingle


def gpipe_order(rank: int, n: int) -> list[Action]:
    """Every forward, then every backward (activations of all micro-batches held)."""
    return [Action(rank, F, m) for m in range(n)] + [Action(rank, B, m) for m in range(n)]


def one_f_one_b_order(rank: int, num_stages: int, n: int) -> list[Action]:
    """Warm-up forwards (fewer the later the stage), then one forward and one backward in
    turn, then the remaining backwards: at most ``num_stages - rank`` micro-batches'
    activations held."""
    warmup = min(n, num_stages - 1 - rank)
    order = [Action(rank, F, m) for m in range(warmup)]
    for m in range(n - warmup):
        order += [Action(rank, F, warmup + m), Action(rank, B, m)]
    return order + [Action(rank, B, m) for m in range(n - warmup, n)]


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards."""

    def _order(self, rank: int) -> list[Action]:
        return gpipe_order(rank, self._n_microbatches)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: one forward, one backward in the steady state (torch: needs n_microbatches >=
    num_stages)."""

    def _rules(self) -> list[str]:
        if self._n_microbatches < self._num_stages:
            return [f"Schedule1F1B needs n_microbatches >= num_stages ({self._num_stages}), "
                    f"got {self._n_microbatches}"]
        return []

    def _order(self, rank: int) -> list[Action]:
        return one_f_one_b_order(rank, self._num_stages, self._n_microbatches)
