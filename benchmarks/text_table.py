"""The benchmarks' plain-text tables: columns as wide as their widest cell, the first
left-aligned (row names), the others right-aligned (figures), a rule under the header."""
from __future__ import annotations


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Print ``rows`` (cells already formatted) under ``header``, ``" | "`` between columns."""
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths]] + rows:
        print(" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def time_and_rate(seconds: float | None, nbytes: int, unit: float, rate_format: str) -> list[str]:
    """Two cells: ``seconds`` and the throughput ``nbytes / seconds / unit`` (``rate_format``,
    e.g. ``"{:.2f}"``); ``-`` in both where nothing was timed."""
    if not seconds:
        return ["-", "-"]
    return [f"{seconds:.3f}", rate_format.format(nbytes / seconds / unit)]
