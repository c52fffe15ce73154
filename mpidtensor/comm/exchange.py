"""The row exchange of a mixture-of-experts token dispatch: an all-to-all whose counts
differ from rank to rank (each rank sends each expert's rank the tokens routed there).
The redistribution all-to-all (``collectives.all_to_all``) moves pieces whose sizes all
ranks share; these sizes only the sender and the receiver know."""
from __future__ import annotations

from math import prod
from typing import Sequence

import torch
from mpi4py import MPI

from . import base, guard, recorders
from ..runtime import watchdog
from .buffers import as_buffer, empty, mpi_type, stage, unstage
from .rounds import offsets

__all__ = ["exchange_rows"]


def exchange_rows(tensor: torch.Tensor, comm: MPI.Intracomm, *, send_rows: Sequence[int],
                  recv_rows: Sequence[int]) -> torch.Tensor:
    """Send ``send_rows[k]`` consecutive rows of ``tensor`` (dim 0, in rank order) to rank k;
    the rows received, ``recv_rows[k]`` from rank k, in rank order (one ``Alltoallv``).

    Unlike ``collectives.all_to_all`` the counts are this rank's own and differ from rank to rank, as
    a mixture-of-experts token dispatch's do: ``recv_rows`` must be what the others send
    here (exchange the counts first). The counts' checks are this rank's own: a caller whose
    counts may be wrong must agree on them first (a wrong one raises here alone); under
    debug mode the ranks agree on the dtype and the row shape, not the counts."""
    send_rows, recv_rows = tuple(send_rows), tuple(recv_rows)
    if guard.ENABLED:
        guard.check("exchange_rows", comm, guard.tensor_facts(tensor, (0,)),
                    lambda: _check_rows(tensor, comm, send_rows, recv_rows))
    width = _check_rows(tensor, comm, send_rows, recv_rows)
    send = stage(tensor)
    out = empty((sum(recv_rows), *tensor.shape[1:]), send)
    datatype = mpi_type(send.dtype)
    sent, received = [r * width for r in send_rows], [r * width for r in recv_rows]
    recorders.record("exchange_rows", send.nbytes)
    if watchdog.ENABLED:
        watchdog.enter("exchange_rows", comm, {"dtype": tensor.dtype, "counts": sent})
    try:
        comm.Alltoallv([as_buffer(send), (sent, offsets(sent)), datatype],
                       [as_buffer(out), (received, offsets(received)), datatype])
    finally:
        if watchdog.ENABLED:
            watchdog.leave()
    return unstage(out, tensor)


def _check_rows(tensor: torch.Tensor, comm: MPI.Intracomm, send_rows: tuple, recv_rows: tuple) -> int:
    """Elements per row of an :func:`exchange_rows`, after checking its counts."""
    if tensor.ndim == 0:
        raise ValueError("exchange_rows needs a tensor with a row dim, got a 0-d tensor")
    for name, rows in (("send_rows", send_rows), ("recv_rows", recv_rows)):
        if len(rows) != comm.size or any(r < 0 for r in rows):
            raise ValueError(f"exchange_rows: {name} must give {comm.size} counts >= 0, got {rows}")
    if sum(send_rows) != tensor.shape[0]:
        raise ValueError(f"exchange_rows: send_rows {send_rows} add up to {sum(send_rows)}, "
                         f"the tensor has {tensor.shape[0]} rows")
    width = prod(tensor.shape[1:])
    max_count = base.MAX_COUNT
    if max_count is not None and max(sum(send_rows), sum(recv_rows)) * width > max_count:
        raise ValueError(f"exchange_rows of more than {max_count} elements needs an MPI-4 library")
    return width
