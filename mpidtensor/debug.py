"""Debugging aids: count collectives, show who holds which block."""
from __future__ import annotations

from collections import Counter, defaultdict
from functools import lru_cache
from typing import Any

import torch

from .tensor.dtensor import DTensor
from .comm import recorders
from .runtime import watchdog

# mpidtensor's collective kinds and the ops torch's CommDebugMode counts them under: the
# functional collectives (torch.ops.c10d_functional, which torch's class reports native ones as)
# and, where torch has no functional one, the c10d op its DTensor calls.
TORCH_OPS = {
    "all_gather": ("c10d_functional", "all_gather_into_tensor"),
    "reduce_scatter": ("c10d_functional", "reduce_scatter_tensor"),
    "all_reduce": ("c10d_functional", "all_reduce"),
    "all_to_all": ("c10d_functional", "all_to_all_single"),
    "broadcast": ("c10d_functional", "broadcast"),
    "scatter": ("c10d", "scatter_"),
}
# other spellings of the same collectives that users and torch's tests look counts up by
_ALSO = {
    "all_gather": (("_c10d_functional", "all_gather_into_tensor"), ("c10d", "_allgather_base_"),
                   ("c10d", "allgather_")),
    "reduce_scatter": (("_c10d_functional", "reduce_scatter_tensor"), ("c10d", "_reduce_scatter_base_"),
                       ("c10d", "reduce_scatter_")),
    "all_reduce": (("_c10d_functional", "all_reduce"), ("c10d", "allreduce_")),
    "all_to_all": (("_c10d_functional", "all_to_all_single"), ("c10d", "alltoall_base_")),
    "broadcast": (("_c10d_functional", "broadcast"), ("c10d", "broadcast_")),
}


def _op(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name)


@lru_cache(maxsize=1)  # not cleared: torch's op objects, fixed for the process
def _kinds() -> tuple[dict[str, Any], dict[Any, str]]:
    """``(kind -> torch's op, any torch op spelling -> kind)``; torch registers the
    ``c10d_functional`` ops when its functional collectives module is imported."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers torch.ops.c10d_functional

    to_op = {kind: _op(*where) for kind, where in TORCH_OPS.items()}
    to_kind = {op: kind for kind, op in to_op.items()}
    to_kind.update({_op(*where): kind for kind, spellings in _ALSO.items() for where in spellings})
    return to_op, to_kind


def torch_op(kind: str) -> Any:
    """The op torch's CommDebugMode counts mpidtensor's collective ``kind`` under (``kind``
    itself for a collective torch has no op for, e.g. ``exchange_rows``)."""
    return _kinds()[0].get(kind, kind)


class CommCounts(Counter):
    """Collective counts keyed by mpidtensor's kind names (``"all_gather"``), that also answer
    a lookup by torch's op (``counts[torch.ops.c10d_functional.all_gather_into_tensor]``,
    ``.get(op, 0)``, ``op in counts``), as code written for torch's CommDebugMode does."""

    def _key(self, key: Any) -> Any:
        return key if isinstance(key, str) else _kinds()[1].get(key, key)

    def __getitem__(self, key: Any) -> int:
        return super().__getitem__(self._key(key))

    def __contains__(self, key: Any) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._key(key), default)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class CommDebugMode:
    """Counts the collectives run inside the ``with`` block, by kind and bytes sent by this rank.

    >>> with CommDebugMode() as comm:
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> comm.get_comm_counts()
    CommCounts({'all_gather': 1})

    As torch's class: ``get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor]``
    reads the same count; ``comm_counts`` is keyed by torch's ops, and ``comm_module_counts``
    holds ``{"Global": {"forward": {op: n}, "backward": {op: n}}}`` (collectives run inside a
    backward pass counted under ``"backward"``; no per-module entries: mpidtensor does not
    track modules).
    """

    def __init__(self) -> None:
        self.counts: CommCounts = CommCounts()
        self.bytes: Counter[str] = Counter()
        self.comm_counts: dict[Any, int] = defaultdict(int)
        self.comm_module_counts: dict[str, dict[str, dict[Any, int]]] = {}
        self._recorder = self._record  # one bound method, so pop finds what push got

    def _record(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += nbytes
        op = torch_op(kind)
        self.comm_counts[op] += 1
        self.comm_module_counts["Global"]["backward" if _in_backward() else "forward"][op] += 1

    def __enter__(self) -> "CommDebugMode":
        self.counts.clear()
        self.bytes.clear()
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self.comm_module_counts["Global"] = {"forward": defaultdict(int), "backward": defaultdict(int)}
        recorders.push(self._recorder)
        return self

    def __exit__(self, *exc) -> None:
        recorders.pop(self._recorder)

    def get_total_counts(self) -> int:
        return sum(self.counts.values())

    def get_comm_counts(self) -> CommCounts:
        """Counts by kind, also looked up by torch's ops (:class:`CommCounts`)."""
        return CommCounts(self.counts)

    def get_comm_bytes(self) -> Counter[str]:
        return Counter(self.bytes)


def visualize_sharding(dtensor: DTensor, header: str = "") -> str:
    """Print (on the mesh's first rank) and return a table of which ranks hold which block.

    Collective over the DTensor's mesh. Each row is one block: its index range per
    tensor dim and the ranks holding it (several ranks for replicas; Partial
    placements are marked, since each rank then holds a partial value).
    """
    spec = dtensor._spec
    shape, offset = spec.local_shape_and_offset()
    comm = spec.mesh.comm
    blocks = watchdog.call("visualize_sharding: every rank's block (allgather)", comm, comm.allgather,
                           (spec.mesh.get_rank(), offset, shape))
    holders: dict[tuple, list[int]] = {}
    for rank, off, size in blocks:
        holders.setdefault((off, size), []).append(rank)
    partial = [repr(p) for p in spec.placements if p.is_partial()]
    lines = [header] if header else []
    lines.append(f"{tuple(spec.shape)} as {list(spec.placements)} on mesh {spec.mesh.mesh.tolist()}")
    for (off, size), ranks in sorted(holders.items()):
        block = ", ".join(f"{o}:{o + s}" for o, s in zip(off, size)) or "scalar"
        note = f"  ({'/'.join(partial)}: partial values)" if partial else ""
        lines.append(f"  [{block}] -> ranks {ranks}{note}")
    text = "\n".join(lines)
    if spec.mesh.get_coordinate() == [0] * spec.mesh.ndim:
        print(text, flush=True)
    return text
