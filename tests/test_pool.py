"""comm.pool: communication buffers are reused, but never while a tensor still refers to them."""
import gc

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor
from mpidtensor.comm import collectives
from mpidtensor.comm.pool import BufferPool

WORLD = MPI.COMM_WORLD


def test_a_held_result_is_never_overwritten(mesh1d):
    full = global_tensor((4 * WORLD.size, 3))
    d = distribute_tensor(full, mesh1d, [Shard(0)])
    held = [d.full_tensor() for _ in range(6)]  # more than the pool keeps of one size
    view = d.full_tensor()[1:]  # only a view of the result survives
    again = [(d * 2).full_tensor() for _ in range(3)]
    for r in held:
        assert_close(r, full)
    assert_close(view, full[1:])
    for r in again:
        assert_close(r, full * 2)


def test_a_dropped_result_is_reused(mesh1d):
    if WORLD.size == 1:
        pytest.skip("nothing is gathered on one rank")
    d = distribute_tensor(global_tensor((8 * WORLD.size, 5)), mesh1d, [Shard(0)])
    first = d.full_tensor().data_ptr()
    gc.collect()
    second = d.full_tensor().data_ptr()
    assert_all_ranks(first == second, "the second gather did not reuse the first's buffer")


def test_autograd_saved_results_survive(mesh1d):
    full = global_tensor((2 * WORLD.size + 1, 4))
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
    d = distribute_tensor(full, mesh1d, [Shard(0)]).requires_grad_()
    gathered = d.redistribute(mesh1d, [Replicate()])
    loss = (gathered.to_local() @ w).pow(2).sum()  # saves the gathered local for backward
    for _ in range(6):
        d.detach().full_tensor()  # would overwrite a buffer that autograd still holds
    loss.backward()
    ref = full.clone().requires_grad_()
    (ref @ w).pow(2).sum().backward()
    assert_close(d.grad.full_tensor(), ref.grad)


def test_all_reduce_in_place_keeps_what_it_must(mesh1d):
    comm = mesh1d.comm
    x = global_tensor((7, 3)) + WORLD.rank
    out = collectives.all_reduce(x.clone(), comm, "sum", inplace=True)
    want = sum(global_tensor((7, 3)) + r for r in range(WORLD.size))
    assert_close(out, want)
    y = x.t()  # not C-contiguous: staged through a copy, so ``y`` is left alone
    collectives.all_reduce(y, comm, "sum", inplace=True)
    assert_all_ranks(torch.equal(y, x.t()), "a non-contiguous input was overwritten")


def test_pool_limits():
    pool = BufferPool(limit_bytes=1000)
    a = pool.take((100,), torch.float32)  # 400 bytes: pooled
    b = pool.take((100,), torch.float32)  # 800 in all
    c = pool.take((100,), torch.float32)  # would pass the limit while a and b are out: not pooled
    assert_all_ranks(pool.pooled_bytes == 800, f"pooled {pool.pooled_bytes}")
    a_ptr = a.data_ptr()
    del a, c
    d = pool.take((100,), torch.float32)
    assert_all_ranks(d.data_ptr() == a_ptr and d.data_ptr() != b.data_ptr(), "idle buffer not reused")
    big = pool.take((300,), torch.float32)  # 1200 bytes > limit: never pooled
    assert_all_ranks(pool.pooled_bytes == 800 and big.numel() == 300)
    del b, d
    pool.take((200,), torch.float64)  # 1600 bytes: too big even after dropping idle buffers
    e = pool.take((50,), torch.float64)  # 400 bytes: fits after dropping the idle float32 buffers
    assert_all_ranks(pool.pooled_bytes <= 1000 and e.numel() == 50, f"pooled {pool.pooled_bytes}")


def test_pool_drops_the_least_recently_requested_size_first():
    """Room is made by dropping idle sizes in the order they were last asked for (a reuse
    counts as a request), not the order they were first made."""
    pool = BufferPool(limit_bytes=1200)
    first = pool.take((100,), torch.float32)  # 400 bytes each: three sizes fill the pool
    second = pool.take((100,), torch.int32)
    third = pool.take((50,), torch.float64)
    first_ptr, third_ptr = first.data_ptr(), third.data_ptr()
    del first, second, third  # all idle
    again = pool.take((100,), torch.float32)  # the first size, asked for again: now the most recent
    del again
    pool.take((200,), torch.int16)  # 400 bytes more: one idle size must go, the int32 one
    kept_first = pool.take((100,), torch.float32).data_ptr() == first_ptr
    kept_third = pool.take((50,), torch.float64).data_ptr() == third_ptr
    assert_all_ranks(kept_first and kept_third and pool.pooled_bytes <= 1200,
                     f"first kept {kept_first}, third kept {kept_third}, pooled {pool.pooled_bytes}")

def test_large_new_buffers_ask_for_huge_pages(monkeypatch):
    """``host_empty`` advises a buffer of HUGE_PAGES_MIN bytes or more, from the first page
    boundary inside it to its end, and leaves smaller ones alone."""
    import mmap

    from mpidtensor.comm import pool as pool_module

    calls = []
    monkeypatch.setattr(pool_module, "_MADVISE", lambda start, length, advice: calls.append((start, length, advice)))
    small = pool_module.host_empty((1000,), torch.float32)
    big = pool_module.host_empty((pool_module.HUGE_PAGES_MIN // 4 + 3,), torch.float32)
    ok = len(calls) == 1 and small.shape == (1000,) and big.dtype == torch.float32
    if ok:
        start, length, advice = calls[0]
        end = big.data_ptr() + big.nbytes
        ok = (start % mmap.PAGESIZE == 0 and big.data_ptr() <= start < big.data_ptr() + mmap.PAGESIZE
              and start + length == end and advice == 14)
    assert_all_ranks(ok, f"madvise calls {calls} for buffers at {big.data_ptr()} ({big.nbytes} bytes)")


def test_pool_off_buffers_ask_for_huge_pages(monkeypatch):
    """With pooling off, a collective's new host buffer is advised as a pooled one would be."""
    from mpidtensor.comm import buffers
    from mpidtensor.comm import pool as pool_module

    calls = []
    monkeypatch.setattr(pool_module, "_MADVISE", lambda start, length, advice: calls.append((start, length)))
    monkeypatch.setattr(pool_module.pool, "limit_bytes", 0)
    like = torch.empty(0)
    big = buffers.empty((pool_module.HUGE_PAGES_MIN // 4,), like)
    buffers.empty((16,), like)
    end = big.data_ptr() + big.nbytes
    assert_all_ranks(len(calls) == 1 and calls[0][0] + calls[0][1] == end, f"madvise calls {calls}")


def test_reuse_hands_its_buffer_out_again_only_when_idle():
    """``Reuse`` (a prepared collective's outputs) hands the buffer it gave last out again,
    with the MPI buffer of its address, once nothing refers to it; never while a tensor still
    does, and never one the pool has dropped; with pooling off it gives fresh buffers."""
    from mpidtensor.comm.buffers import host_buffer
    from mpidtensor.comm.pool import Reuse

    pool = BufferPool(limit_bytes=4000)
    reuse = Reuse(pool, (100,), torch.float32, host_buffer)
    first, first_mpi = reuse.take()
    ptr = first.data_ptr()
    problems = []
    if first_mpi.address != ptr or first_mpi.nbytes != first.nbytes:
        problems.append("the MPI buffer is not the tensor's memory")
    first.fill_(1.0)
    held_view = first[10:]  # a view keeps the buffer in use
    del first
    second, second_mpi = reuse.take()
    if second.data_ptr() == ptr or second_mpi.address != second.data_ptr():
        problems.append("a buffer still referred to by a view was handed out again")
    if not torch.all(held_view == 1.0):
        problems.append("the held view was overwritten")
    del held_view
    third, third_mpi = reuse.take()  # the last hand-out (second) is still held
    if third.data_ptr() in (second.data_ptr(),):
        problems.append("a held buffer was handed out again")
    third_ptr = third.data_ptr()
    del third, third_mpi
    fourth, _ = reuse.take()
    if fourth.data_ptr() != third_ptr:
        problems.append("an idle last buffer was not handed out again")
    del fourth
    pool.clear()  # the pool drops every buffer: the Reuse must not keep using one
    fifth, fifth_mpi = reuse.take()
    if reuse.buffer is None or not reuse.buffer.pooled or fifth_mpi.address != fifth.data_ptr():
        problems.append("after the pool dropped its buffer the Reuse did not take a pooled one")
    fifth_ptr = fifth.data_ptr()
    del fifth, fifth_mpi
    pool.limit_bytes = 0  # pooling off: fresh buffers each time, the idle pooled one not handed out again
    sixth, _ = reuse.take()
    if sixth.data_ptr() == fifth_ptr:
        problems.append("with pooling off the last pooled buffer was handed out again")
    off = Reuse(pool, (10,), torch.float32, host_buffer)
    a, a_mpi = off.take()
    b, _ = off.take()
    if a.data_ptr() == b.data_ptr() or a_mpi.address != a.data_ptr() or off.buffer is not None:
        problems.append("with pooling off a buffer was reused")
    assert_all_ranks(not problems, "; ".join(problems))


@pytest.mark.parametrize("kind", ["all_gather_dim0", "all_gather_dim1", "reduce_scatter"])
def test_prepared_results_held_are_never_overwritten(kind):
    """A prepared collective reuses its output buffer from call to call only once nothing
    refers to it: results held (more than the pool keeps of one size) keep their values,
    a dropped one's buffer is handed out again, and all are the general function's results."""
    size = WORLD.size
    if kind == "reduce_scatter":
        shape = (2 * size, 3)
        prepared = collectives.prepare_reduce_scatter(shape, torch.float32, WORLD, "sum", dim=0, sizes=[2] * size)
        general = lambda t: collectives.reduce_scatter(t, WORLD, "sum", dim=0, sizes=[2] * size)  # noqa: E731
    else:
        dim = 0 if kind == "all_gather_dim0" else 1
        shape = (3, 2) if dim else (2, 3)
        prepared = collectives.prepare_all_gather(shape, torch.float32, WORLD, dim=dim, sizes=[2] * size)
        general = lambda t: collectives.all_gather(t, WORLD, dim=dim, sizes=[2] * size)  # noqa: E731
    inputs = [global_tensor(shape, seed=i) + WORLD.rank for i in range(7)]
    want = [general(x).clone() for x in inputs]
    first = prepared(inputs[0])
    last = first.data_ptr()
    del first
    again = prepared(inputs[1])  # the first result was dropped: its buffer comes back
    reused = again.data_ptr() == last
    ok = torch.equal(again, want[1])
    held = [again] + [prepared(x) for x in inputs[2:]]
    ok = ok and all(torch.equal(h, w) for h, w in zip(held, want[1:]))
    ok = ok and len({h.data_ptr() for h in held}) == len(held)
    assert_all_ranks(ok and (size == 1 or reused), f"{kind}: results {ok}, last buffer reused {reused}")
