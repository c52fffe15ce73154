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

Collectives: ``all_reduce`` (sum, avg, product, min, max, the bitwise band/bor/bxor on
integers, and ``PREMUL_SUM``: scaled by its factor, then summed, as NCCL does for FSDP's
gradient division), ``all_reduce_coalesced``, ``broadcast``, ``reduce``, ``all_gather``,
``all_gather_into_tensor`` (flat or stacked output), ``all_gather_coalesced``, ``gather``,
``scatter``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all`` (tensors of any
sizes) and ``all_to_all_single`` (their sizes agreed by one small ``allgather`` first: a
mismatch is a ``ValueError`` on every rank), the coalesced forms that
``_coalescing_manager`` calls, ``barrier`` and ``monitored_barrier``
(``monitored_barrier``; under the switch ``dist.monitored_barrier`` reaches it, torch's
own refuses any backend but gloo). So torch's own ``gather_object`` and
``scatter_object_list`` work too. Each writes into the caller's tensors as c10d does:
outside autograd (``dist.broadcast(param, src=0)`` on an ``nn.Parameter``), into
non-contiguous views as one process would (torch's gloo reads and writes those in
memory order: wrong values), 0-dim and empty tensors, every dtype (bfloat16 and float16
reduced in float32). Bad input raises what torch's gloo raises (``c10d_checks``), from
what each rank holds, before any data moves. Each collective runs to completion when
called (MPI blocking calls): the returned work is done. Point-to-point
``send``/``recv`` (and so ``isend``/``irecv``/``batch_isend_irecv``) are MPI
non-blocking sends and receives whose work completes them at ``wait()``.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from ..runtime import abort, watchdog
from ..comm import collectives
from ..comm.buffers import as_buffer, mpi_type, stage
from ..comm.exchange import exchange_rows
from ..runtime import effects
from . import c10d_checks as checks, monitored_barrier

__all__ = ["BACKEND", "init_process_group", "outside_autograd"]

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
        comm = watchdog.call("init_process_group: the default group's communicator (Dup)", world, world.Dup)
    else:
        comm = watchdog.call("new_group: its communicator (Create_group)", world, world.Create_group,
                             world.group.Incl(ranks))
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

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Complete the transfers; with a ``timeout`` (torch's ``timedelta``; zero: none) a
        ``RuntimeError`` once it passes, the transfers left pending (as torch's ``Work.wait``)."""
        if not self._done:
            watchdog.wait_all(self._requests, *self._what, timeout=timeout.total_seconds() if timeout else None)
            with torch.no_grad():
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


def outside_autograd(method: Callable[..., Any]) -> Callable[..., Any]:
    """A collective's body as c10d runs it: outside autograd, so that it writes into
    parameters and tensors that require grad (``dist.broadcast(param, src=0)``), after
    ``checks.devices`` of its tensors."""
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        checks.devices(method.__name__, args)
        if not torch.is_grad_enabled():
            return method(*args, **kwargs)
        torch._C._set_grad_enabled(False)  # (torch.no_grad's effect, at a fifth of its cost per call)
        try:
            return method(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(True)
    return run


def write_back(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target.copy_(value)`` leaving ``target``'s autograd version counter as it was, as
    gloo writes all-reduce, broadcast, scatter and all-to-all results: a tensor saved for
    backward may be all-reduced in place (the backward then reads the new values)."""
    if target.is_inference():  # no version counter
        target.copy_(value)
        return
    version = target._version
    target.copy_(value)
    torch._C._autograd._unsafe_set_version_counter((target,), (version,))


class MPIProcessGroup(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives are mpidtensor's on ``comm``.

    Each method writes its results into the caller's tensors outside autograd (c10d's
    contract), into non-contiguous views as the values one process would give. Argument
    errors are ``RuntimeError``s as torch's gloo raises them, from what each rank holds,
    before any data moves (``checks``)."""

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

    @outside_autograd
    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Completed:
        for t in tensors:
            write_back(t, all_reduce(t, self.comm, opts.reduceOp))
        return Completed(tensors)

    @outside_autograd
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Completed:
        """All tensors (one dtype, torch checks) reduced as one flat buffer."""
        flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]), self.comm, opts.reduceOp)
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view(t.shape))
        return Completed(tensors)

    @outside_autograd
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Completed:
        checks.root("broadcast", opts.rootRank, self.comm.size)
        for t in tensors:
            write_back(t, collectives.broadcast(t, self.comm, opts.rootRank))
        return Completed(tensors)

    @outside_autograd
    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Completed:
        for outputs, t in zip(output_lists, inputs):
            checks.same_as_input("allgather", outputs, t, self.comm.size)
            for out, piece in zip(outputs, self._gather(t.reshape(1, -1))):
                out.copy_(piece.view(t.shape))
        return Completed([t for outputs in output_lists for t in outputs])

    @outside_autograd
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any) -> Completed:
        """``output_lists[r][i]``: rank r's ``inputs[i]``; every input in one flat all-gather."""
        for outputs in output_lists:
            checks.coalesced_outputs(outputs, inputs, self.comm.size, len(output_lists))
        flat = torch.cat([t.reshape(-1).to(inputs[0].dtype) for t in inputs]) if inputs else torch.empty(0)
        rows = self._gather(flat.reshape(1, -1))
        for outputs, row in zip(output_lists, rows):
            for out, piece in zip(outputs, row.split([t.numel() for t in inputs])):
                out.copy_(piece.view(out.shape))
        return Completed([t for outputs in output_lists for t in outputs])

    @outside_autograd
    def _allgather_base(self, output: torch.Tensor, t: torch.Tensor, opts: Any) -> Completed:
        checks.flat("allgather", output, t, self.comm.size, gathered=True)
        output.copy_(self._gather(t.reshape(1, -1)).view(output.shape))
        return Completed([output])

    @outside_autograd
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any) -> Completed:
        return self._coalesced(self._allgather_base, outputs, inputs, opts)

    @outside_autograd
    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Completed:
        for out, pieces in zip(outputs, input_lists):
            checks.same_as_input("reduce_scatter", pieces, out, self.comm.size)
            stacked = torch.stack([p.reshape(-1) for p in pieces])
            out.copy_(self._scatter(stacked, opts).view(out.shape))
        return Completed(outputs)

    @outside_autograd
    def _reduce_scatter_base(self, output: torch.Tensor, t: torch.Tensor, opts: Any) -> Completed:
        checks.flat("reduce_scatter", t, output, self.comm.size, gathered=False)
        output.copy_(self._scatter(t.reshape(self.comm.size, -1), opts).view(output.shape))
        return Completed([output])

    @outside_autograd
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> Completed:
        return self._coalesced(self._reduce_scatter_base, outputs, inputs, opts)

    @staticmethod
    def _coalesced(base: Callable[..., Completed], outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                   opts: Any) -> Completed:
        """A coalesced call (``_coalescing_manager``'s) as one ``base`` call per (output, input)
        pair: each completes when called, so the result is the coalesced one."""
        for output, t in zip(outputs, inputs):
            base(output, t, opts)
        return Completed(outputs)

    @outside_autograd
    def alltoall_base(self, output: torch.Tensor, t: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any) -> Completed:
        write_back(output, agreed_exchange(t, self.comm, input_split_sizes, output_split_sizes, output))
        return Completed([output])

    @outside_autograd
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Completed:
        """``inputs[k]`` to rank k, ``outputs[k]`` from rank k: of any sizes (as NCCL's; gloo
        wants one size), the sizes agreed first as ``all_to_all_single``'s splits are."""
        checks.same_dtype("alltoall", [*inputs, *outputs], self.comm.size, len(inputs), len(outputs))
        send, recv = [t.numel() for t in inputs], [t.numel() for t in outputs]
        got = agreed_exchange(torch.cat([t.reshape(-1) for t in inputs]), self.comm, send, recv)
        for out, piece in zip(outputs, got.split(recv)):
            out.copy_(piece.view(out.shape))
        return Completed(outputs)

    @outside_autograd
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Completed:
        """An all-reduce whose result the root keeps (the others' tensors stay as they were;
        torch leaves them unspecified)."""
        checks.root("reduce", opts.rootRank, self.comm.size)
        for t in tensors:
            reduced = all_reduce(t, self.comm, opts.reduceOp)
            if self.comm.rank == opts.rootRank:
                t.copy_(reduced)
        return Completed(tensors)

    @outside_autograd
    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Completed:
        """The root's ``output_lists[0][k]``: rank k's input (an all-gather the root keeps)."""
        checks.root("gather", opts.rootRank, self.comm.size)
        is_root = self.comm.rank == opts.rootRank
        for k, t in enumerate(inputs):
            if is_root:
                checks.same_as_input("gather", output_lists[k], t, self.comm.size)
            gathered = self._gather(t.reshape(1, -1))
            if is_root:
                for out, piece in zip(output_lists[k], gathered):
                    out.copy_(piece.view(t.shape))
        return Completed([t for outputs in output_lists for t in outputs])

    @outside_autograd
    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Completed:
        """Rank k's ``outputs[0]``: the root's ``input_lists[0][k]`` (one ``Scatterv``)."""
        checks.root("scatter", opts.rootRank, self.comm.size)
        n, is_root = self.comm.size, self.comm.rank == opts.rootRank
        for k, out in enumerate(outputs):
            if is_root:
                checks.same_as_input("scatter", input_lists[k], out, n)
                whole = torch.stack([t.reshape(-1) for t in input_lists[k]])
            else:  # only the root's values are read: the others pass the shape
                whole = torch.empty((n, out.numel()), dtype=out.dtype, device=out.device)
            write_back(out, collectives.scatter(whole, self.comm, opts.rootRank, dim=0, sizes=[1] * n).view(out.shape))
        return Completed(outputs)

    # torch 2.13's Python API calls these names; the C++ functional collectives the older ones
    all_gather_single, reduce_scatter_single, all_to_all_single = _allgather_base, _reduce_scatter_base, alltoall_base

    @outside_autograd
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Pending:
        return post_send(self.comm, tensors, dst, tag)

    @outside_autograd
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Pending:
        return post_recv(self.comm, tensors, src, tag)

    def barrier(self, opts: Any = None) -> Completed:
        watchdog.call("torch.distributed barrier (Barrier)", self.comm, self.comm.Barrier)
        return Completed([])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """torch's ``monitored_barrier`` (``monitored_barrier.run``)."""
        monitored_barrier.run(self.comm, timeout, wait_all_ranks)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather(t.contiguous(), self.comm, dim=0, sizes=[t.shape[0]] * self.comm.size)

    def _scatter(self, t: torch.Tensor, opts: Any) -> torch.Tensor:
        op, factor = reduce_op_of(opts.reduceOp, t.dtype)
        return collectives.reduce_scatter(premultiplied(t, factor).contiguous(), self.comm, op, dim=0,
                                          sizes=[1] * self.comm.size)


def all_reduce(t: torch.Tensor, comm: MPI.Intracomm, reduce_op: Any) -> torch.Tensor:
    """``t`` reduced with torch's ``reduce_op`` over ``comm`` (a new tensor): the bitwise
    ops on integer and bool tensors in MPI directly, the others by ``collectives``."""
    bitwise = checks.bitwise_op(reduce_op, t.dtype)
    if bitwise is not None:
        send = stage(t, copy=True)
        watchdog.call("torch.distributed all_reduce, bitwise (Allreduce)", comm, comm.Allreduce,
                      MPI.IN_PLACE, [as_buffer(send), mpi_type(send.dtype)], bitwise)
        return send
    op, factor = reduce_op_of(reduce_op, t.dtype)
    return collectives.all_reduce(premultiplied(t, factor), comm, op)


def post_send(comm: MPI.Intracomm, tensors: list[torch.Tensor], dst: int, tag: int) -> _Pending:
    """``tensors`` sent to ``comm``'s rank ``dst`` (MPI ``Isend``s); the work completes them."""
    staged = [stage(t) for t in tensors]
    requests = [comm.Isend(as_buffer(t), dest=dst, tag=tag) for t in staged]
    return _Pending(requests, staged, [], tensors, ("torch.distributed send", comm, _peer("to", dst, tag, staged)))


def post_recv(comm: MPI.Intracomm, tensors: list[torch.Tensor], src: int, tag: int) -> _Pending:
    """``tensors`` received from ``comm``'s rank ``src`` (MPI ``Irecv``s) once the work is waited."""
    if src < 0:  # torch's recv(src=None) asks any source; it has no override for Python backends
        raise NotImplementedError("torch.distributed.recv without a source is not provided by mpidtensor's "
                                  "MPI backend: name the source rank")
    staged = [stage(t) for t in tensors]
    requests = [comm.Irecv(as_buffer(t), source=src, tag=tag) for t in staged]
    copies = [(t, s) for t, s in zip(tensors, staged) if s is not t]
    return _Pending(requests, staged, copies, tensors,
                    ("torch.distributed recv", comm, _peer("from", src, tag, staged)))


def agreed_exchange(t: torch.Tensor, comm: MPI.Intracomm, send_sizes: Sequence[int] | None,
                    recv_sizes: Sequence[int] | None, output: torch.Tensor | None = None) -> torch.Tensor:
    """``all_to_all_single``'s exchange over ``comm``: ``send_sizes[k]`` rows of ``t`` to rank
    k, the ``recv_sizes[k]`` rows from rank k back, in rank order. The process group's, a mesh
    group's under the switch (``mesh_groups``) and the functional collectives' (``funcol``).

    The sizes come as the caller got them (None or empty: even rows of ``t``, of ``output``'s
    rows); without ``output`` (the functional form) the result is made of what arrives, even
    rows of ``t`` by default. One ``allgather`` gives every rank every rank's arguments and
    every rank checks them all (:func:`_agreed_splits`) before any row moves, so bad
    arguments on one rank raise on every rank instead of leaving the others in the exchange
    (a hang or a truncated message)."""
    problem = None
    if output is not None and output.dtype != t.dtype:
        problem = f"input {t.dtype} and output {output.dtype} differ"
    mine = (list(send_sizes or ()), list(recv_sizes or ()), _rows(t), None if output is None else _rows(output),
            problem)
    table = watchdog.call("all_to_all: every rank's splits (allgather)", comm, comm.allgather, mine)
    send, recv = _agreed_splits(table)[comm.rank]
    return exchange_rows(t.contiguous(), comm, send_rows=send, recv_rows=recv)


def _rows(t: torch.Tensor) -> int | None:
    """A tensor's rows (None: 0-d, which has none to split)."""
    return t.shape[0] if t.dim() else None


def _agreed_splits(table: list[tuple]) -> list[tuple[list[int], list[int]]]:
    """Every rank's ``(send, recv)`` splits from every rank's arguments (``agreed_exchange``'s
    table), the same on every rank: the first rank's problem, torch's ``RuntimeError`` for
    splits that do not fit its tensors, or a ``ValueError`` where a rank expects other rows
    from rank k than rank k sends it."""
    n = len(table)
    agreed = []
    for r, (send, recv, rows_in, rows_out, problem) in enumerate(table):
        try:
            if problem:
                raise RuntimeError(problem)
            send = checks.splits(send, rows_in, n)
            if rows_out is None:  # the functional form: the output is what arrives
                rows_out = sum(recv) if recv else rows_in
            recv = checks.splits(recv, rows_out, n)
        except RuntimeError as error:
            raise RuntimeError(f"all_to_all_single on rank {r}: {error}") from None
        agreed.append((send, recv))
    for r, (_, recv) in enumerate(agreed):
        wrong = [k for k in range(n) if recv[k] != agreed[k][0][r]]
        if wrong:
            raise ValueError(f"all_to_all_single: rank {r} expects {[recv[k] for k in wrong]} rows from ranks "
                             f"{wrong}, which send it {[agreed[k][0][r] for k in wrong]}")
    return agreed


def reduce_op_of(reduce_op: Any, dtype: torch.dtype | None = None) -> tuple[str, Any]:
    """The collectives' name of a torch ``ReduceOp`` (it compares equal to its kind, not
    hashes) and the factor to scale by first (``PREMUL_SUM``'s, a number or a tensor; else None).
    An op torch's gloo refuses on ``dtype`` (``AVG`` of integers) raises its ``RuntimeError``."""
    if reduce_op == dist.ReduceOp.PREMUL_SUM:
        return "sum", reduce_op.factor
    op = next((name for kind, name in _OPS if reduce_op == kind), None)
    if op is None:
        raise ValueError(f"the mpidtensor backend reduces with sum, avg, product, min, max, band, bor, bxor or "
                         f"premul_sum, got {reduce_op}")
    if op == "avg" and dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"result type Float can't be cast to the desired output type {checks.type_name(dtype)}")
    return op, None


def premultiplied(t: torch.Tensor, factor: Any) -> torch.Tensor:
    """``t`` times ``factor`` (in ``t``'s dtype), or ``t`` itself when there is none."""
    if factor is None:
        return t
    return t * (factor.to(t.device, t.dtype) if isinstance(factor, torch.Tensor) else factor)


def _peer(direction: str, rank: int, tag: int, tensors: list[torch.Tensor]) -> str:
    """A transfer in words for the watchdog's report."""
    return f"{sum(t.nbytes for t in tensors)} bytes {direction} rank {rank}, tag {tag}"
