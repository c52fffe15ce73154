"""Debugging aids: count collectives, show who holds which block."""
from __future__ import annotations

from collections import Counter

from .tensor.dtensor import DTensor
from .comm import recorders


class CommDebugMode:
    """Counts the collectives run inside the ``with`` block, by kind and bytes sent by this rank.

    >>> with CommDebugMode() as comm:
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> comm.get_comm_counts()
    Counter({'all_gather': 1})
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._recorder = self._record  # one bound method, so pop finds what push got

    def _record(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += nbytes

    def __enter__(self) -> "CommDebugMode":
        self.counts.clear()
        self.bytes.clear()
        recorders.push(self._recorder)
        return self

    def __exit__(self, *exc) -> None:
        recorders.pop(self._recorder)

    def get_total_counts(self) -> int:
        return sum(self.counts.values())

    def get_comm_counts(self) -> Counter[str]:
        return Counter(self.counts)

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
    blocks = spec.mesh.comm.allgather((spec.mesh.get_rank(), offset, shape))
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
