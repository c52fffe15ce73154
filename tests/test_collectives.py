"""Collectives against plain torch: every rank builds the global tensor, derives its
own piece with torch.split, runs the collective and compares collectively."""
from __future__ import annotations

import functools

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor.comm import alltoall, base, buffers, collectives, recorders
from mpidtensor.runtime.settings import settings
from mpidtensor.comm.collectives import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter, scatter

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.complex32, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]
OPS = ["sum", "avg", "min", "max", "product"]
SIZE_KINDS = ["even", "uneven", "one_rank"]
LAYOUTS = ["contiguous", "fortran", "strided"]
HAS_CUDA = torch.cuda.is_available()
assert_equal = functools.partial(assert_close, rtol=0, atol=0)


def sizes_of(kind: str) -> list[int]:
    """Piece lengths per rank: equal, uneven with empty pieces, all on the last rank, or
    torch.chunk's layout (full pieces, one short, then empty: a padded gather's prefix)."""
    return {"even": [2] * SIZE, "uneven": [(3, 0, 2, 1)[r % 4] for r in range(SIZE)],
            "one_rank": [0] * (SIZE - 1) + [3],
            "tail": {1: [3], 2: [3, 1], 3: [3, 3, 1]}.get(SIZE, [3] * (SIZE - 2) + [1, 0])}[kind]


def make(shape, dtype=torch.float32, seed: int = 1234) -> torch.Tensor:
    """``global_tensor`` extended to dtypes it cannot draw directly."""
    if dtype == torch.complex32:
        return global_tensor(shape, torch.complex64, seed).to(dtype)
    if dtype == torch.uint8:
        return global_tensor(shape, torch.int16, seed).to(dtype)
    return global_tensor(shape, dtype, seed)


def layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values in another memory layout (F-contiguous, or strided inside a bigger buffer)."""
    if kind == "fortran":
        order = list(reversed(range(t.ndim)))
        return t.permute(order).contiguous().permute(order)
    if kind == "strided":
        big = torch.zeros(*t.shape, 2, dtype=t.dtype)
        big[..., 0] = t
        return big[..., 0]
    return t.clone()


def piece(t: torch.Tensor, dim: int, sizes: list[int], rank: int = RANK) -> torch.Tensor:
    return torch.split(t, sizes, dim)[rank]


def torch_reduce(stacked: torch.Tensor, op: str) -> torch.Tensor:
    """What torch gives for ``op`` over dim 0 of the stacked per-rank tensors."""
    dtype = stacked.dtype
    if dtype == torch.bool:
        return stacked.any(0) if op in ("sum", "max") else stacked.all(0)
    if dtype == torch.complex32:  # torch has no complex32 reductions on CPU
        return torch_reduce(stacked.to(torch.complex64), op).to(dtype)
    reduce = {"sum": torch.sum, "avg": torch.mean, "min": torch.amin, "max": torch.amax, "product": torch.prod}[op]
    return reduce(stacked, 0).to(dtype)  # integer sum/prod promote to int64; MPI wraps in the dtype


def valid(dtype: torch.dtype, op: str) -> bool:
    if op == "avg":
        return dtype.is_floating_point or dtype.is_complex
    return not (op in ("min", "max") and dtype.is_complex)


def rank_tensors(shape, dtype) -> list[torch.Tensor]:
    return [make(shape, dtype, seed=100 + r) for r in range(SIZE)]


# ---------------------------------------------------------------- all_gather


@pytest.fixture(params=["padded", "allgatherv"])
def gather_method(request, monkeypatch):
    """Both uneven all-gathers (padded Allgather, Allgatherv), whatever the threshold picks."""
    monkeypatch.setattr(base, "ALLGATHER_PADDED_MIN", ((1, 0),) if request.param == "padded" else ((1, 1 << 62),))
    return request.param


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("kind", SIZE_KINDS + ["tail"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather(dim, kind, lay, gather_method):
    sizes = sizes_of(kind)
    shape = [2, 3, 4]
    shape[dim] = sum(sizes)
    full = make(shape)
    out = all_gather(layout(piece(full, dim, sizes), lay), WORLD, dim=dim, sizes=sizes)
    assert_equal(out, full)
    assert_all_ranks(out.is_contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_dtypes(dtype, gather_method):
    sizes = sizes_of("uneven")
    full = make((3, sum(sizes), 2), dtype)
    assert_equal(all_gather(piece(full, 1, sizes), WORLD, dim=1, sizes=sizes), full)


# ---------------------------------------------------------------- all_to_all


@pytest.fixture(params=["packed", "alltoallw"])
def a2a_method(request, monkeypatch):
    """Both all-to-all implementations, whatever size threshold chooses between them."""
    threshold = ((1, 0),) if request.param == "packed" else ((1, 1 << 62),)
    monkeypatch.setattr(base, "ALLTOALL_PACKED_MIN", threshold)
    monkeypatch.setattr(base, "ALLTOALL_PACK_SEND_MIN", threshold)
    return request.param


@pytest.mark.parametrize("lay", ["contiguous", "fortran"])
@pytest.mark.parametrize("kinds", [("uneven", "even"), ("even", "even"), ("even", "one_rank")])
@pytest.mark.parametrize("split_dim,concat_dim", [(0, 1), (1, 0), (2, 0), (0, 2), (1, -1)])
def test_all_to_all(split_dim, concat_dim, lay, kinds, a2a_method):
    split_sizes, concat_sizes = sizes_of(kinds[0]), sizes_of(kinds[1])
    shape = [2, 3, 4]
    shape[split_dim], shape[concat_dim] = sum(split_sizes), sum(concat_sizes)
    full = make(shape)  # sharded along concat_dim before, along split_dim after
    out = all_to_all(layout(piece(full, concat_dim, concat_sizes), lay), WORLD, split_dim=split_dim,
                     concat_dim=concat_dim, split_sizes=split_sizes, concat_sizes=concat_sizes)
    assert_equal(out, piece(full, split_dim, split_sizes))
    assert_all_ranks(out.is_contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_dtypes(dtype, a2a_method):
    split_sizes, concat_sizes = sizes_of("even"), sizes_of("one_rank")
    full = make((sum(concat_sizes), 3, sum(split_sizes)), dtype)
    out = all_to_all(piece(full, 0, concat_sizes), WORLD, split_dim=2, concat_dim=0,
                     split_sizes=split_sizes, concat_sizes=concat_sizes)
    assert_equal(out, piece(full, 2, split_sizes))


# ---------------------------------------------------------------- all_reduce


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(dtype, op):
    tensors = rank_tensors((3, 4), dtype)
    if not valid(dtype, op):
        with pytest.raises(TypeError):
            all_reduce(tensors[RANK], WORLD, op)
        return
    mine = layout(tensors[RANK], "fortran")
    before = mine.clone()
    out = all_reduce(mine, WORLD, op)
    assert_close(out, torch_reduce(torch.stack(tensors), op))
    assert_equal(mine, before)  # input untouched
    assert_all_ranks(out.dtype == dtype and out.is_contiguous())


def test_all_reduce_scalar_and_grad():
    x = torch.tensor(float(RANK + 1), requires_grad=True)
    out = all_reduce(x * 1, WORLD, "max")
    assert_equal(out, torch.tensor(float(SIZE)))
    assert_all_ranks(not out.requires_grad and out.ndim == 0)


def test_all_reduce_unknown_op():
    with pytest.raises(ValueError):
        all_reduce(torch.ones(2), WORLD, "mean")


# ---------------------------------------------------------------- reduce_scatter


@pytest.mark.parametrize("lay", ["contiguous", "strided"])
@pytest.mark.parametrize("kind", SIZE_KINDS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter(dim, kind, lay):
    sizes = sizes_of(kind)
    shape = [2, 3, 4]
    shape[dim] = sum(sizes)
    tensors = rank_tensors(shape, torch.float64)
    out = reduce_scatter(layout(tensors[RANK], lay), WORLD, "sum", dim=dim, sizes=sizes)
    assert_close(out, piece(torch.stack(tensors).sum(0), dim, sizes))
    assert_all_ranks(out.is_contiguous())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_dtypes(dtype, op):
    sizes = sizes_of("uneven")
    tensors = rank_tensors((2, sum(sizes)), dtype)
    if not valid(dtype, op):
        with pytest.raises(TypeError):
            reduce_scatter(tensors[RANK], WORLD, op, dim=1, sizes=sizes)
        return
    out = reduce_scatter(tensors[RANK], WORLD, op, dim=1, sizes=sizes)
    assert_close(out, piece(torch_reduce(torch.stack(tensors), op), 1, sizes))


# ---------------------------------------------------------------- broadcast


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(dtype):
    root = SIZE - 1
    tensors = rank_tensors((3, 5), dtype)
    out = broadcast(layout(tensors[RANK], "fortran"), WORLD, root)
    assert_equal(out, tensors[root])
    assert_all_ranks(out.is_contiguous())


def test_broadcast_is_a_new_tensor():
    x = torch.full((2,), float(RANK))
    out = broadcast(x, WORLD, 0)
    out += 1
    assert_equal(x, torch.full((2,), float(RANK)))


# ---------------------------------------------------------------- scatter


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("kind", SIZE_KINDS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter(dim, kind, lay):
    sizes, root = sizes_of(kind), SIZE // 2
    shape = [2, 3, 4]
    shape[dim] = sum(sizes)
    full = make(shape)
    mine = layout(full if RANK == root else torch.zeros_like(full), lay)
    out = scatter(mine, WORLD, root, dim=dim, sizes=sizes)
    assert_equal(out, piece(full, dim, sizes))
    assert_all_ranks(out.is_contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_dtypes(dtype):
    sizes = sizes_of("uneven")
    full = make((sum(sizes), 3), dtype)
    assert_equal(scatter(full, WORLD, 0, dim=0, sizes=sizes), piece(full, 0, sizes))


# ---------------------------------------------------------------- odd inputs


@pytest.mark.parametrize("shape", [(0, 3), (SIZE, 0)])
def test_empty_tensors(shape):
    sizes = [shape[0] // SIZE] * SIZE
    x = torch.ones(shape)
    part = piece(x, 0, sizes)
    assert_equal(all_gather(part, WORLD, dim=0, sizes=sizes), x)
    assert_equal(all_gather(part, WORLD, dim=1, sizes=[shape[1]] * SIZE),
                 torch.cat([part] * SIZE, 1))
    assert_equal(all_to_all(x, WORLD, split_dim=0, concat_dim=1, split_sizes=sizes,
                            concat_sizes=[shape[1]] * SIZE), torch.cat([part] * SIZE, 1)[: sizes[RANK]])
    assert_equal(all_reduce(x, WORLD), x * SIZE)
    assert_equal(reduce_scatter(x, WORLD, "sum", dim=0, sizes=sizes), part * SIZE)
    assert_equal(broadcast(x, WORLD), x)
    assert_equal(scatter(x, WORLD, 0, dim=0, sizes=sizes), part)


def test_zero_dim_tensors():
    x = torch.tensor(2.5 + RANK)
    assert_equal(broadcast(x, WORLD, 0), torch.tensor(2.5))
    assert_equal(all_reduce(x, WORLD, "min"), torch.tensor(2.5))
    with pytest.raises(IndexError):
        all_gather(x, WORLD, dim=0, sizes=[1] * SIZE)


def test_expanded_conj_neg_and_grad_inputs():
    sizes = [1] * SIZE
    base = make((SIZE, 3), torch.complex64)
    expanded = base[RANK:RANK + 1, :1].expand(1, 3)  # stride 0
    assert_equal(all_gather(expanded, WORLD, dim=0, sizes=sizes), base[:, :1].expand(SIZE, 3))
    assert_equal(all_gather(base[RANK:RANK + 1].conj(), WORLD, dim=0, sizes=sizes), base.conj().resolve_conj())
    negated = base[RANK:RANK + 1].conj().imag  # a lazily negated view
    assert_equal(all_gather(negated, WORLD, dim=0, sizes=sizes), -base.imag)
    grad = base.real.clone().requires_grad_()
    out = all_gather(grad[RANK:RANK + 1].t(), WORLD, dim=1, sizes=sizes)
    assert_equal(out, base.real.t())
    assert_all_ranks(not out.requires_grad)


def test_prepared_all_reduce_resolves_conj_and_neg_views():
    """A prepared collective stages a conjugated complex view and a lazily negated real view
    (the conjugate bit is asked of complex signatures only) rather than sending the raw memory."""
    full = make((2, 3), torch.complex64)
    complex_sum = collectives.prepare_all_reduce((2, 3), torch.complex64, WORLD)
    real_sum = collectives.prepare_all_reduce((2, 3), torch.float32, WORLD)
    for _ in range(2):  # the first call and a later one
        assert_equal(complex_sum(full.conj()), full.conj().resolve_conj() * SIZE)
        assert_equal(real_sum(full.conj().imag), -full.imag * SIZE)


@pytest.mark.parametrize("name", ["MAX_COUNT", "ALLGATHER_PADDED_MIN", "ALLTOALL_PACKED_MIN",
                                  "ALLTOALL_PACK_SEND_MIN", "GATHER_TYPED_MAX"])
def test_prepared_collective_takes_general_path_after_a_tunable_changes(name):
    """A prepared collective compares every tunable of ``base.limits()`` (read inline) with
    those it was made under: one changed sends its calls to the general function, with the
    same result; restored, the prepared call runs again."""
    full = make((SIZE * 2, 3))
    prepared = collectives.prepare_all_gather((2, 3), torch.float32, WORLD, dim=0, sizes=[2] * SIZE)
    taken = []
    fast, general = prepared.fast, prepared.general
    prepared.fast = lambda t: (taken.append("fast"), fast(t))[1]
    prepared.general = lambda t: (taken.append("general"), general(t))[1]
    mine = full[2 * RANK:2 * RANK + 2].clone()
    saved = getattr(base, name)
    try:
        assert_equal(prepared(mine), full)
        changed = {"MAX_COUNT": 1 << 20, "GATHER_TYPED_MAX": base.GATHER_TYPED_MAX + 1}
        setattr(base, name, changed.get(name, ((SIZE + 1, 1 << 40),)))  # (thresholds no call reaches)
        assert_all_ranks(base.limits() != prepared.limits)
        assert_equal(prepared(mine), full)
    finally:
        setattr(base, name, saved)
    assert_equal(prepared(mine), full)
    assert_all_ranks(taken == ["fast", "general", "fast"], f"{taken}")


def test_bad_sizes_raise_before_communicating():
    calls = []

    def recorder(kind: str, nbytes: int) -> None:
        calls.append(kind)

    recorders.push(recorder)
    try:
        with pytest.raises(ValueError):
            all_gather(torch.ones(2, 3), WORLD, dim=0, sizes=[1] * SIZE)
        with pytest.raises(ValueError):
            scatter(torch.ones(2, 3), WORLD, 0, dim=1, sizes=[1] * (SIZE + 1))
        with pytest.raises(TypeError):
            reduce_scatter(torch.ones(SIZE, dtype=torch.int32), WORLD, "avg", dim=0, sizes=[1] * SIZE)
        with pytest.raises(ValueError):
            all_to_all(torch.ones(SIZE, 2), WORLD, split_dim=0, concat_dim=-2, split_sizes=[1] * SIZE,
                       concat_sizes=[2] * SIZE)
    finally:
        recorders.pop(recorder)
    assert_all_ranks(calls == [], f"recorded {calls}")


# ---------------------------------------------------------------- tracing and buffers


def test_tracing_records_each_collective():
    outer, inner = [], []
    outer_rec = lambda kind, nbytes: outer.append((kind, nbytes))  # noqa: E731
    inner_rec = lambda kind, nbytes: inner.append((kind, nbytes))  # noqa: E731
    recorders.push(outer_rec)
    x = torch.ones(SIZE, 2)
    all_reduce(x, WORLD)
    recorders.push(inner_rec)
    all_gather(x, WORLD, dim=0, sizes=[SIZE] * SIZE)
    broadcast(x, WORLD, 0)
    recorders.pop(inner_rec)
    recorders.pop(outer_rec)
    all_reduce(x, WORLD)
    assert_all_ranks(inner == [("all_gather", x.nbytes), ("broadcast", x.nbytes if RANK == 0 else 0)], str(inner))
    assert_all_ranks(outer == [("all_reduce", x.nbytes)] + inner, str(outer))
    with pytest.raises(ValueError):
        recorders.pop(outer_rec)


def test_buffers_stage_and_types():
    x = torch.arange(6.0).reshape(2, 3)
    assert buffers.stage(x).data_ptr() == x.data_ptr()  # a view when nothing changes
    staged = buffers.stage(x.t())
    assert staged.is_contiguous() and torch.equal(staged, x.t())
    assert buffers.stage(x, copy=True).data_ptr() != x.data_ptr()
    with pytest.raises(ValueError):
        buffers.as_buffer(x.t())
    assert buffers.mpi_type(torch.float32) == MPI.FLOAT
    assert buffers.mpi_type(torch.bfloat16).Get_size() == 2
    assert buffers.mpi_type(torch.complex32).Get_size() == 4


def test_cuda_aware_override():
    with settings.override(cuda_aware=True):  # MPIDTENSOR_CUDA_AWARE=1
        assert buffers.cuda_aware()
    with settings.override(cuda_aware=False):
        assert not buffers.cuda_aware()


def test_type_cache_frees_evicted_types():
    cache = buffers._TypeCache(maxsize=2)
    first = cache("a", lambda: MPI.INT.Create_contiguous(2))
    assert cache("a", lambda: MPI.INT.Create_contiguous(2)) is first
    cache("b", lambda: MPI.INT.Create_contiguous(3))
    cache("c", lambda: MPI.INT.Create_contiguous(4))
    assert first == MPI.DATATYPE_NULL  # freed on eviction


# ---------------------------------------------------------------- CUDA


def _every_collective_on(device: str) -> list[torch.Tensor]:
    sizes = sizes_of("uneven")
    full = make((3, sum(sizes)), torch.bfloat16).to(device)
    mine = make((3, sum(sizes)), torch.float32, seed=RANK).to(device)
    part = piece(full, 1, sizes)
    thirds = [len(t) for t in torch.arange(3).tensor_split(SIZE)]
    return [
        all_gather(part, WORLD, dim=1, sizes=sizes),
        all_to_all(part.t(), WORLD, split_dim=1, concat_dim=0, split_sizes=thirds, concat_sizes=sizes),
        all_reduce(mine.t(), WORLD, "avg"),
        reduce_scatter(mine, WORLD, "sum", dim=1, sizes=sizes),
        broadcast(mine, WORLD, 0),
        scatter(full, WORLD, 0, dim=1, sizes=sizes),
    ]


def _check_cuda_matches_cpu() -> None:
    on_gpu, on_cpu = _every_collective_on("cuda"), _every_collective_on("cpu")
    for gpu, cpu in zip(on_gpu, on_cpu):
        assert_all_ranks(gpu.is_cuda and gpu.is_contiguous(), "result left the GPU")
        assert_close(gpu.cpu(), cpu)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_host_staging():
    with settings.override(cuda_aware=False):  # MPIDTENSOR_CUDA_AWARE=0
        _check_cuda_matches_cpu()


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_aware_cupy_path():
    pytest.importorskip("cupy")
    with settings.override(cuda_aware=None):  # unset: ask MPI
        if not all(WORLD.allgather(buffers.cuda_aware())):
            pytest.skip("MPI is not CUDA-aware")
        _check_cuda_matches_cpu()


# ---------------------------------------------------------------- thresholds per MPI library


def test_thresholds_follow_the_loaded_library():
    """The regular-form thresholds are the loaded library's (MPICH's where a library was
    not measured); Open MPI never packs or pads; MPICH pads and packs at large sizes."""
    from mpidtensor.runtime.mpi_library import collective_thresholds

    loaded = collective_thresholds()
    assert_all_ranks((base.ALLTOALL_PACKED_MIN, base.ALLTOALL_PACK_SEND_MIN,
                      base.ALLGATHER_PADDED_MIN)
                     == (loaded["alltoall_packed"], loaded["alltoall_pack_send"], loaded["allgather_padded"]))
    assert_all_ranks(collective_thresholds("Intel MPI") == collective_thresholds("MPICH"))
    big = 32 << 20
    assert_all_ranks(not any(base.beyond(t, 4, 4 * big) for t in collective_thresholds("Open MPI").values()))
    assert_all_ranks(all(base.beyond(t, 4, 4 * big) for t in collective_thresholds("MPICH").values()))


@pytest.mark.parametrize("shape,split_dim,concat_dim,split_sizes,concat_sizes,packed", [
    ((8, 3), 0, 1, (4, 4), (3, 3), "both"),  # even pieces along a later dim
    ((7, 3), 0, 1, (4, 3), (3, 2), "never"),  # uneven along a later dim: Alltoallw
    ((7, 4), 0, 1, (4, 3), (2, 2), "never"),
    ((3, 8), 1, 0, (4, 4), (3, 3), "send"),  # strided in the input only: S(0) -> S(1)
    ((3, 7), 1, 0, (4, 3), (3, 2), "send"),
    ((1, 3, 7), 2, 1, (4, 3), (3, 2), "send"),  # the dims before the concat dim are of length 1
    ((2, 8, 3), 0, 1, (1, 1), (4, 4), "both"),  # strided on both sides
])
def test_packed_all_to_all_choice(monkeypatch, shape, split_dim, concat_dim, split_sizes, concat_sizes, packed):
    """Which threshold applies: the send-side one where only the input's pieces are strided,
    the general one where the received pieces land along a later dim too, none for uneven
    pieces landing along a later dim (Alltoallw's receive datatypes place them in place)."""
    shape = base.resized(shape, concat_dim, concat_sizes[0])
    chosen = []
    for general, send in (((1, 0),), ((1, 1 << 62),)), (((1, 1 << 62),), ((1, 0),)):
        monkeypatch.setattr(base, "ALLTOALL_PACKED_MIN", general)
        monkeypatch.setattr(base, "ALLTOALL_PACK_SEND_MIN", send)
        chosen.append(alltoall._layout(torch.Size(shape), 4, split_dim, concat_dim, split_sizes,
                                       concat_sizes, 2, 0, base.limits())[3])
    want = {"both": [True, False], "send": [False, True], "never": [False, False]}[packed]
    assert_all_ranks(chosen == want, f"packed {chosen} for {shape} {split_sizes} {concat_sizes}")
