"""Collectives on torch tensors over an mpi4py communicator: the one module callers import.

Results are new C-contiguous tensors with the input's dtype and device. Each kind lives
in its own module, with the layout it computes once per signature, its MPI calls, and
its prepared form (``prepared``: bound to a communicator and an input signature, so a
repeated collective pays for checks, choices, counts and datatypes once):

- ``gather``: :func:`all_gather` (``Allgather``, a vector datatype, padded pieces,
  ``Allgatherv``);
- ``alltoall``: :func:`all_to_all` (``Alltoallw`` with subarray datatypes, or pieces packed
  for ``Alltoall(v)`` by ``packing``);
- ``reduce``: :func:`all_reduce`, :func:`reduce_scatter`;
- ``rooted``: :func:`broadcast`, :func:`scatter`;
- ``base``: what they share: the tunable thresholds, argument checks, reduction ops, the
  watchdog slot; ``compiled``: the custom ops tensors take while torch.compile traces
  (registered in torch's op registry at the first mesh, a process-wide effect).

Every choice is made from facts every rank shares (global bytes per rank against
thresholds measured per MPI library), so every rank makes the same one. Every collective
reports itself to ``recorders.record``. Argument errors are raised before any
communication; under ``MPIDTENSOR_DEBUG=1`` the ranks first agree on the collective and
its arguments (``guard``), and with ``MPIDTENSOR_TIMEOUT`` set each blocking MPI call is
watched (``watchdog``).

Large counts: mpi4py 4 calls MPI-4's large-count (``_c``) routines, so an MPI-4
library takes element counts beyond 2**31 as they are. With an older MPI the counts
and displacements of one call must fit in a C int: ``MAX_COUNT`` is then 2**31 - 1 and
the collectives that would exceed it run in rounds of at most ``MAX_COUNT`` elements
(``rounds``; all-to-all never needs to: its counts are 1 and its displacements 0).

The tunables (``MAX_COUNT``, ``ALLTOALL_PACKED_MIN``, ``ALLTOALL_PACK_SEND_MIN``,
``ALLGATHER_PADDED_MIN``, ``GATHER_TYPED_MAX``) live in ``base``, where every kind reads
them when it lays out a call: tests and benchmarks set ``base.MAX_COUNT = n``.
"""
from __future__ import annotations

from ..runtime.effects import effect
from .alltoall import all_to_all, prepare_all_to_all
from .base import ReduceOp
from .gather import all_gather, prepare_all_gather
from .prepared import BySignature, Prepared
from .reduce import all_reduce, prepare_all_reduce, prepare_reduce_scatter, reduce_scatter
from .rooted import broadcast, scatter


@effect("torch.ops.mpidtensor custom ops", "first mesh",
        "registers torch.ops.mpidtensor.all_gather, all_to_all, all_reduce and reduce_scatter in torch's op "
        "registry: the collectives as opaque ops that torch.compile traces")
def _register_traced_ops() -> None:
    from . import compiled  # noqa: F401  (registers the ops and fills base.TRACED_OPS)


__all__ = [
    "BySignature", "Prepared", "ReduceOp", "all_gather", "all_reduce", "all_to_all", "broadcast", "prepare_all_gather",
    "prepare_all_reduce", "prepare_all_to_all", "prepare_reduce_scatter", "reduce_scatter", "scatter",
]
