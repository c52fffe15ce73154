"""mpidtensor.tools.memory: the torch.accelerator memory API, with real CPU figures."""
import gc
import io

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor, zeros
from mpidtensor.tools import memory

WORLD = MPI.COMM_WORLD
CPU = "cpu"


def _settled_allocated() -> int:
    """``memory_allocated`` after collecting garbage other tests may have left."""
    gc.collect()
    return memory.memory_allocated(CPU)


def _local_bytes(d) -> int:
    local = d.to_local()
    return local.numel() * local.element_size()


@pytest.mark.parametrize("shape", [(10, 7), (3, 5), (64, 33)])
def test_sharded_dtensor_counts_its_local_shard(mesh1d, shape):
    base = _settled_allocated()
    d = distribute_tensor(global_tensor(shape), mesh1d, [Shard(0)])
    grown = memory.memory_allocated(CPU) - base
    expected = _local_bytes(d)
    del d
    gc.collect()
    back = memory.memory_allocated(CPU) - base
    assert_all_ranks(grown == expected, f"allocated grew by {grown}, local shard is {expected} bytes")
    assert_all_ranks(back == 0, f"{back} bytes still counted after the DTensor was freed")


def test_factory_and_views_count_storage_once(mesh1d):
    base = _settled_allocated()
    z = zeros(9, 4, device_mesh=mesh1d, placements=[Shard(0)], dtype=torch.float64)
    expected = _local_bytes(z)
    views = [z.view(-1) if WORLD.size == 1 else z.transpose(0, 1), z[:]]
    grown = memory.memory_allocated(CPU) - base
    stats = memory.memory_stats(CPU)
    assert_all_ranks(grown == expected, f"grew by {grown}, expected {expected} (views counted twice?)")
    assert_all_ranks(stats["allocated_bytes.dtensor.current"] >= expected, str(stats))
    del z, views
    gc.collect()
    assert_all_ranks(memory.memory_allocated(CPU) == base, "views kept bytes counted after being freed")


def test_peak_follows_and_resets(mesh1d):
    base = _settled_allocated()
    memory.reset_peak_memory_stats(CPU)
    assert_all_ranks(memory.max_memory_allocated(CPU) == base, "reset did not make the peak the current value")
    d = distribute_tensor(global_tensor((40, 8)), mesh1d, [Shard(0)])
    shard = _local_bytes(d)
    assert_all_ranks(memory.max_memory_allocated(CPU) >= base + shard, "peak below the live shard")
    del d
    gc.collect()
    peak = memory.max_memory_allocated(CPU)
    assert_all_ranks(memory.memory_allocated(CPU) == base and peak >= base + shard,
                     f"after free: allocated {memory.memory_allocated(CPU)}, peak {peak}, base {base}")
    memory.reset_peak_memory_stats(CPU)
    assert_all_ranks(memory.max_memory_allocated(CPU) == memory.memory_allocated(CPU), "second reset")


def test_peak_of_library_buffers_is_real_without_queries(mesh1d):
    """An all-gather's output, made and freed between two queries, is in the peak."""
    if mesh1d.size() == 1:
        pytest.skip("on one rank the redistribution moves nothing and allocates nothing")
    full = global_tensor((48, 16))
    d = distribute_tensor(full, mesh1d, [Shard(0)])
    base = _settled_allocated()
    memory.reset_peak_memory_stats(CPU)
    d.redistribute(mesh1d, [Replicate()])  # result dropped at once: only the allocation saw it
    gc.collect()
    peak = memory.max_memory_allocated(CPU)
    full_bytes = full.numel() * full.element_size()
    assert_all_ranks(memory.memory_allocated(CPU) == base, "the gathered tensor is still counted")
    assert_all_ranks(peak >= base + full_bytes, f"peak {peak} misses the {full_bytes}-byte all-gather output")


def test_2d_mesh_shards(mesh2d):
    base = _settled_allocated()
    d = distribute_tensor(global_tensor((7, 9)), mesh2d, [Shard(0), Shard(1)])
    grown = memory.memory_allocated(CPU) - base
    assert_all_ranks(grown == _local_bytes(d), f"grew by {grown}, local shard {_local_bytes(d)}")


def test_stats_counters_and_reserved(mesh1d):
    memory.reset_accumulated_memory_stats(CPU)
    zero = memory.memory_stats(CPU)
    d = distribute_tensor(global_tensor((16, 4)), mesh1d, [Replicate()])
    memory.memory_allocated(CPU)  # registers d's storage (rank 0's is not a library buffer)
    del d
    gc.collect()
    stats = memory.memory_stats(CPU)
    reserved, peak_reserved = memory.memory_reserved(CPU), memory.max_memory_reserved(CPU)
    assert_all_ranks(zero["allocated_bytes.all.allocated"] == 0 and zero["allocation.all.freed"] == 0, str(zero))
    assert_all_ranks(stats["allocated_bytes.all.allocated"] >= 16 * 4 * 4, str(stats))
    assert_all_ranks(stats["allocation.all.freed"] >= 1, str(stats))
    assert_all_ranks(0 < reserved <= peak_reserved, f"rss {reserved}, peak {peak_reserved}")
    memory.empty_cache()
    assert_all_ranks(memory.memory_reserved(CPU) > 0, "no RSS after empty_cache")


def test_device_arguments():
    torch_default = memory.memory_allocated(None) if not torch.cuda.is_available() else None
    assert_all_ranks(torch_default is None or torch_default == memory.memory_allocated(torch.device("cpu")))
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        memory.memory_allocated("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            memory.memory_allocated(0)


def test_memory_summary_table(mesh1d, capsys):
    d = distribute_tensor(global_tensor((12, 3)), mesh1d, [Shard(0)])
    out = io.StringIO()
    table = memory.memory_summary(mesh1d, CPU, file=out)
    lines = table.splitlines()
    printed = out.getvalue()
    assert_all_ranks(len(lines) == WORLD.size + 1 and "allocated MiB" in lines[0], table)
    assert_all_ranks([line.split()[0] for line in lines[1:]] == [str(r) for r in range(WORLD.size)], table)
    assert_all_ranks(printed == (table + "\n" if WORLD.rank == 0 else ""), f"printed {printed!r}")
    del d


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_reads_the_caching_allocator():
    from mpidtensor import init_device_mesh

    mesh = init_device_mesh("cuda", (WORLD.size,))
    base = memory.memory_allocated("cuda")
    d = distribute_tensor(global_tensor((256, 64)).cuda(), mesh, [Shard(0)])
    grown = memory.memory_allocated() - base  # the default is CUDA once CUDA is in use
    assert_all_ranks(grown >= _local_bytes(d) and memory.memory_allocated() == torch.cuda.memory_allocated())
    assert_all_ranks(memory.max_memory_allocated("cuda") == torch.cuda.max_memory_allocated())
