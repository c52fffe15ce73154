"""``torch.distributed`` on MPI, for third-party code that calls it.

mpidtensor needs no ``init_process_group``; code written against torch.distributed does:
Hugging Face ``generate(synced_gpus=True)`` all-reduces a "this rank finished" flag so
that a rank stopping early keeps joining the others' forwards (FSDP gathers in every
one), training loops all-reduce metrics, libraries call ``dist.barrier()``.
:func:`init_process_group` registers a torch ``ProcessGroup`` backend, ``"mpidtensor"``,
whose collectives are mpidtensor's on an MPI communicator (``comm.collectives``: the
staging path, bfloat16 reduced in float32, debug-mode checks, the watchdog) and makes it
torch's default group over the MPI ranks; ``dist.new_group(ranks)`` gets a
sub-communicator. Functional collectives (``torch.distributed._functional_collectives``)
reach the same methods.

Collectives: ``all_reduce`` (sum, avg, product, min, max, and ``PREMUL_SUM``: scaled by its
factor, then summed, as NCCL does for FSDP's gradient division), ``broadcast``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``all_to_all_single`` (its splits agreed by one small ``allgather`` first: a mismatch is a
``ValueError`` on every rank), ``barrier``. Each runs to completion when called (MPI
blocking calls): the returned work is done. Point-to-point ``send``/``recv`` (and so
``isend``/``irecv``/``batch_isend_irecv``) are MPI non-blocking sends and receives whose
work completes them at ``wait()``. ``reduce``, ``gather`` and ``scatter`` reach a Python
backend through no method torch lets it override: under the switch
(:mod:`mpidtensor.compat.distributed`) ``torch.distributed``'s functions of those names
are composed from the collectives above.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from ..runtime import abort, watchdog
from ..comm import collectives
from ..comm.buffers import as_buffer, stage
from ..comm.exchange import exchange_rows
from ..runtime import effects

__all__ = ["BACKEND", "init_process_group"]

BACKEND = "mpidtensor"

_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.PRODUCT, "product"),
        (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.MAX, "max"))


def init_process_group(comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Make torch.distributed's default group the ranks of ``comm`` (each with its rank
    there), its collectives carried by MPI; nothing if a default group exists already.
    Collective over ``comm``. No store, port or launcher variable is needed. Like a first
    mesh, it installs the abort hook: a rank that dies must not leave the others waiting."""
    effects.install(abort.EFFECT)
    if dist.is_initialized():
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    _WORLD[0] = comm
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=comm.rank, world_size=comm.size)


_WORLD: list[MPI.Intracomm] = [MPI.COMM_WORLD]  # the communicator of the default group


def _create(options: Any, _pg_options: Any = None) -> "MPIProcessGroup":
    """torch's backend factory (extended API): the default group, or a ``new_group`` of the
    default group's ranks ``global_ranks_in_group`` (called on those ranks only)."""
    world = _WORLD[0]
    ranks = list(options.global_ranks_in_group)
    if not ranks or ranks == list(range(world.size)):
        comm = world.Dup()
    else:
        comm = world.Create_group(world.group.Incl(ranks))
    return MPIProcessGroup(comm)


class Completed(dist._Work):
    """A collective that completed when it was called."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: Future = Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future:
        return self._future


class _Pending(dist._Work):
    """Point-to-point transfers in flight (MPI requests); ``wait`` completes them and copies
    what was received into the caller's tensors where they were staged."""

    def __init__(self, requests: list[MPI.Request], keep: list[torch.Tensor],
                 copies: list[tuple[torch.Tensor, torch.Tensor]], result: list[torch.Tensor], what: tuple) -> None:
        super().__init__()
        self._requests, self._keep, self._copies, self._result = requests, keep, copies, result
        self._what = what  # (kind, communicator, details) for the watchdog's report
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            watchdog.wait_all(self._requests, *self._what)
            for into, received in self._copies:
                into.copy_(received)
            self._done, self._keep = True, []
        return True

    def is_completed(self) -> bool:
        return self._done or MPI.Request.Testall(self._requests) and self.wait()

    def get_future(self) -> Future:
        self.wait()
        future: Future = Future()
        future.set_result(self._result)
        return future


class MPIProcessGroup(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives are mpidtensor's on ``comm``."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # torch names the group after creating it; a Python group has no C++ backend to keep the name
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Completed:
        op, factor = reduce_op_of(opts.reduceOp)
        for t in tensors:
            t.copy_(collectives.all_reduce(premultiplied(t, factor), self.comm, op))
        return Completed(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Completed:
        for t in tensors:
            t.copy_(collectives.broadcast(t, self.comm, opts.rootRank))
        return Completed(tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Completed:
        for outputs, t in zip(output_lists, inputs):
            gathered = self._gather(t.unsqueeze(0))
            for out, piece in zip(outputs, gathered):
                out.copy_(piece)
        return Completed([t for outputs in output_lists for t in outputs])

    def _allgather_base(self, output: torch.Tensor, t: torch.Tensor, opts: Any) -> Completed:
        output.copy_(self._gather(t.reshape(1, -1)).reshape(output.shape))
        return Completed([output])

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Completed:
        for out, pieces in zip(outputs, input_lists):
            stacked = torch.stack([p.reshape(out.shape) for p in pieces])
            out.copy_(self._scatter(stacked, opts).reshape(out.shape))
        return Completed(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, t: torch.Tensor, opts: Any) -> Completed:
        output.copy_(self._scatter(t.reshape(self.comm.size, -1), opts).reshape(output.shape))
        return Completed([output])

    def alltoall_base(self, output: torch.Tensor, t: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any) -> Completed:
        n = self.comm.size
        send = list(input_split_sizes) or [t.shape[0] // n] * n
        recv = list(output_split_sizes) or [output.shape[0] // n] * n
        _check_splits(self.comm.allgather((send, recv, t.shape[0], output.shape[0])))
        output.copy_(exchange_rows(t, self.comm, send_rows=send, recv_rows=recv))
        return Completed([output])

    # torch 2.13's Python API calls these names; the C++ functional collectives the older ones
    all_gather_single, reduce_scatter_single, all_to_all_single = _allgather_base, _reduce_scatter_base, alltoall_base

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Pending:
        staged = [stage(t) for t in tensors]
        requests = [self.comm.Isend(as_buffer(t), dest=dst, tag=tag) for t in staged]
        return _Pending(requests, staged, [], tensors,
                        ("torch.distributed send", self.comm, _peer("to", dst, tag, staged)))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Pending:
        if src < 0:  # torch's recv(src=None) asks any source; it has no override for Python backends
            raise NotImplementedError("torch.distributed.recv without a source is not provided by mpidtensor's "
                                      "MPI backend: name the source rank")
        staged = [stage(t) for t in tensors]
        requests = [self.comm.Irecv(as_buffer(t), source=src, tag=tag) for t in staged]
        copies = [(t, s) for t, s in zip(tensors, staged) if s is not t]
        return _Pending(requests, staged, copies, tensors,
                        ("torch.distributed recv", self.comm, _peer("from", src, tag, staged)))

    def barrier(self, opts: Any = None) -> Completed:
        self.comm.Barrier()
        return Completed([])

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather(t.contiguous(), self.comm, dim=0, sizes=[t.shape[0]] * self.comm.size)

    def _scatter(self, t: torch.Tensor, opts: Any) -> torch.Tensor:
        op, factor = reduce_op_of(opts.reduceOp)
        return collectives.reduce_scatter(premultiplied(t, factor).contiguous(), self.comm, op, dim=0,
                                          sizes=[1] * self.comm.size)


def _check_splits(table: list[tuple[list[int], list[int], int, int]]) -> None:
    """``ValueError`` on every rank (each checks the same gathered ``table`` of every rank's
    send and receive splits and row counts) unless each split list has a count per rank,
    adds up to its tensor's rows, and each rank receives from rank k what rank k sends it;
    a rank alone in the exchange would hang or truncate."""
    n = len(table)
    for r, (send, recv, rows_in, rows_out) in enumerate(table):
        if len(send) != n or len(recv) != n or sum(send) != rows_in or sum(recv) != rows_out:
            raise ValueError(f"all_to_all_single on rank {r}: splits {send} -> {recv} do not fit {n} ranks "
                             f"and tensors of {rows_in} -> {rows_out} rows")
        wrong = [k for k in range(n) if recv[k] != table[k][0][r]]
        if wrong:
            raise ValueError(f"all_to_all_single: rank {r} expects {[recv[k] for k in wrong]} rows from ranks "
                             f"{wrong}, which send it {[table[k][0][r] for k in wrong]}")


def reduce_op_of(reduce_op: Any) -> tuple[str, Any]:
    """The collectives' name of a torch ``ReduceOp`` (it compares equal to its kind, not
    hashes) and the factor to scale by first (``PREMUL_SUM``'s, a number or a tensor; else None)."""
    if reduce_op == dist.ReduceOp.PREMUL_SUM:
        return "sum", reduce_op.factor
    op = next((name for kind, name in _OPS if reduce_op == kind), None)
    if op is None:
        raise ValueError(f"the mpidtensor backend reduces with sum, avg, product, min, max or premul_sum, "
                         f"got {reduce_op}")
    return op, None


def premultiplied(t: torch.Tensor, factor: Any) -> torch.Tensor:
    """``t`` times ``factor`` (in ``t``'s dtype), or ``t`` itself when there is none."""
    if factor is None:
        return t
    return t * (factor.to(t.device, t.dtype) if isinstance(factor, torch.Tensor) else factor)


def _peer(direction: str, rank: int, tag: int, tensors: list[torch.Tensor]) -> str:
    """A transfer in words for the watchdog's report."""
    return f"{sum(t.nbytes for t in tensors)} bytes {direction} rank {rank}, tag {tag}"
