"""A sweep of torch.distributed's c10d calls, a torch-only program: every public function
of ``torch.distributed`` that takes a group, with the tensors users pass (parameters,
tensors that require grad, non-contiguous and transposed views, 0-dim and empty tensors,
every dtype), ``async_op=True`` where it exists, the default group and a ``new_group``,
and bad input. Each rank writes one json line per call to ``OUT/rank<r>.jsonl``: the
values of the call's output tensors (or objects), or the error it raised (its type and
first line). Run under torch on gloo and under ``python -m mpidtensor.run`` and compared
call by call (tests/test_c10d_sweep.py).

:data:`GLOO_CANNOT` lists the calls torch's gloo cannot do (it raises, crashes, or writes
wrong values) with why; under gloo each runs a *twin* in its place, the same values by
means gloo has (a contiguous copy, ``no_grad``, a flat view...), marked in its line.
Usage: c10d_sweep.py OUT"""
import contextlib
import fnmatch
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

dist.init_process_group("gloo")
RANK, N = dist.get_rank(), dist.get_world_size()
GLOO = dist.get_backend() == "gloo"
OUT = open(os.path.join(sys.argv[1], f"rank{RANK}.jsonl"), "w")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
       "bxor": dist.ReduceOp.BXOR}

WRONG_LAYOUT = "gloo reads or writes a non-contiguous tensor in memory order: wrong values"
AUTOGRAD = "gloo writes into the output with autograd on: a leaf that requires grad raises"
GLOO_CANNOT = {
    "all_reduce/noncontiguous*": WRONG_LAYOUT,
    "broadcast/noncontiguous*": WRONG_LAYOUT,
    "reduce_scatter/noncontiguous*": WRONG_LAYOUT,
    "reduce/noncontiguous*": WRONG_LAYOUT,
    "scatter/noncontiguous": WRONG_LAYOUT,
    "scatter/transposed": WRONG_LAYOUT,
    "all_to_all_single/noncontiguous_out": WRONG_LAYOUT,
    "all_gather/parameter*": AUTOGRAD,
    "all_gather/requires_grad*": AUTOGRAD,
    "reduce_scatter/parameter*": AUTOGRAD,
    "reduce_scatter/requires_grad*": AUTOGRAD,
    "reduce_scatter_tensor/output_parameter": AUTOGRAD,
    "reduce_scatter_tensor/output_requires_grad": AUTOGRAD,
    "all_to_all/parameter*": AUTOGRAD,
    "all_to_all/requires_grad*": AUTOGRAD,
    "gather/parameter": AUTOGRAD,
    "gather/requires_grad": AUTOGRAD,
    "all_gather_into_tensor/input_parameter": "gloo raises on an input that requires grad (a view made in no_grad)",
    "all_gather_into_tensor/input_requires_grad": "gloo raises on an input that requires grad (a view made in no_grad)",
    "all_gather_into_tensor/input_scalar": "gloo refuses a 0-dim input (NCCL takes it)",
    "all_gather_into_tensor/stacked*": "gloo refuses the stacked (N, *input) output (NCCL takes it)",
    "reduce_scatter_tensor/output_scalar": "gloo crashes (SIGSEGV) on a 0-dim output",
    "reduce_scatter_tensor/stacked": "gloo refuses the stacked (N, *output) input (NCCL takes it)",
    "all_reduce/premul_sum": "gloo has no PREMUL_SUM (NCCL's, FSDP's gradient division)",
    "reduce_scatter_tensor/premul_sum": "gloo has no PREMUL_SUM (NCCL's, FSDP's gradient division)",
    "all_to_all/uneven": "gloo wants one size for all of all_to_all's tensors (NCCL takes any)",
    "send/noncontiguous": "gloo refuses a non-contiguous tensor in send/recv",
    "send/transposed": "gloo refuses a non-contiguous tensor in send/recv",
    "isend/noncontiguous": "gloo refuses a non-contiguous tensor in send/recv",
    "isend/transposed": "gloo refuses a non-contiguous tensor in send/recv",
    "batch/noncontiguous": "gloo refuses a non-contiguous tensor in send/recv",
    "batch/transposed": "gloo refuses a non-contiguous tensor in send/recv",
}


def describe(value):
    """A tensor, a list or an object as json the two runs compare."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        values = torch.view_as_real(t).tolist() if t.is_complex() else t.float().tolist() if t.dtype in (
            torch.bfloat16, torch.float16) else t.tolist()
        return {"dtype": str(t.dtype), "shape": list(t.shape), "values": values,
                "requires_grad": value.requires_grad, "parameter": isinstance(value, nn.Parameter)}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return repr(type(value).__name__)


def call(name, fn, twin=None):
    """Run ``fn`` (returning what to report) and write its line; under gloo a call of
    :data:`GLOO_CANNOT` runs ``twin`` instead."""
    why = next((reason for pattern, reason in GLOO_CANNOT.items() if fnmatch.fnmatchcase(name, pattern)), None)
    if why is not None and twin is None:
        raise AssertionError(f"{name} is in GLOO_CANNOT without a twin")
    line = {"call": name, "gloo_cannot": why}
    try:
        line["result"] = describe((twin if GLOO and why is not None else fn)())
    except Exception as err:  # noqa: BLE001 - the error is the result
        line["error"] = type(err).__name__
        line["message"] = (str(err).strip().splitlines() or [""])[0][:160]
    OUT.write(json.dumps(line, sort_keys=True) + "\n")
    OUT.flush()


def contiguous_twin(fn, make):
    """``fn`` on a contiguous copy of ``make()``, copied back: the values one process gives."""
    def run():
        t = make()
        done = fn(t.contiguous())
        with torch.no_grad():
            t.copy_(done)
        return t
    return run


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def settle(work, async_op: bool) -> None:
    """Wait for the work an ``async_op=True`` call returned."""
    if async_op:
        work.wait()


def values(dtype, shape=(3,), base=0):
    """Small distinct values of ``dtype`` that sums and products of a few ranks keep exact."""
    numel = 1
    for s in shape:
        numel *= s
    t = (torch.arange(numel) % 3 + RANK + 1 + base).reshape(shape)
    if dtype == torch.bool:
        return (t % 2 == 0)
    if dtype.is_complex:
        return torch.complex(t.float(), -t.float()).to(dtype)
    return t.to(dtype)


def kinds(dtype=torch.float32, base=0):
    """The tensors users pass, by name: made fresh by each call (the calls write into them)."""
    return {
        "plain": lambda: values(dtype, base=base),
        "parameter": lambda: nn.Parameter(values(dtype, base=base), requires_grad=dtype.is_floating_point),
        "requires_grad": lambda: values(dtype, base=base).requires_grad_(dtype.is_floating_point),
        "noncontiguous": lambda: values(dtype, (3, 2), base)[:, 1],
        "transposed": lambda: values(dtype, (2, 3), base).t(),
        "scalar": lambda: values(dtype, (), base),
        "empty": lambda: values(dtype, (0,), base),
    }


def in_place(fn, make, async_op=False, contiguous=False):
    """Call ``fn(tensor, async_op=...)`` on a fresh tensor; report the tensor after.
    ``contiguous``: on a contiguous copy, copied back (the twin of a non-contiguous call)."""
    def run():
        t = make()
        into = t.contiguous() if contiguous else t
        work = fn(into, async_op=async_op) if async_op else fn(into)
        settle(work, async_op)
        if into is not t:
            t.copy_(into)
        return t
    return run


def in_place_call(name, fn, make, async_op=False):
    call(name, in_place(fn, make, async_op), in_place(fn, make, async_op, contiguous=True))


# --- all_reduce ------------------------------------------------------------------------------------------
for kind, make in kinds().items():
    in_place_call(f"all_reduce/{kind}", dist.all_reduce, make)
    in_place_call(f"all_reduce/{kind}/async", dist.all_reduce, make, async_op=True)
for dtype in DTYPES:
    for op_name, op in OPS.items():
        call(f"all_reduce/{dtype}/{op_name}", in_place(lambda t, op=op: dist.all_reduce(t, op=op),
                                                        lambda dtype=dtype: values(dtype)))
call("all_reduce/premul_sum", in_place(lambda t: dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5)),
                                       lambda: values(torch.float32)),
     in_place(lambda t: (t.mul_(0.5), dist.all_reduce(t)), lambda: values(torch.float32)))


def all_reduce_future():
    work = dist.all_reduce(values(torch.float32), async_op=True)
    return work.get_future().wait()


call("all_reduce/future", all_reduce_future)

# --- broadcast --------------------------------------------------------------------------------------------
for kind, make in kinds().items():
    in_place_call(f"broadcast/{kind}", lambda t: dist.broadcast(t, src=N - 1), make)
    in_place_call(f"broadcast/{kind}/async", lambda t, async_op: dist.broadcast(t, src=N - 1, async_op=True), make,
                  async_op=True)
for dtype in DTYPES:
    call(f"broadcast/{dtype}", in_place(lambda t: dist.broadcast(t, src=0), lambda dtype=dtype: values(dtype)))
call("broadcast/group_src", in_place(lambda t: dist.broadcast(t, group_src=N - 1), kinds()["plain"]))
call("broadcast/src_out_of_range", in_place(lambda t: dist.broadcast(t, src=N), kinds()["plain"]))


# --- all_gather, all_gather_into_tensor, all_gather_coalesced ----------------------------------------------
def gather_into(make_out, make_in, fn, async_op=False, out_shape=None, in_shape=None):
    """Call ``fn(out, in, async_op=...)`` on fresh tensors; report ``out`` after.
    ``out_shape``/``in_shape``: pass views of these shapes instead (a twin), ``out`` as made."""
    def run():
        out, mine = make_out(), make_in()
        into = out if out_shape is None else out.view(out_shape)
        mine = mine if in_shape is None else mine.reshape(in_shape)
        work = fn(into, mine, async_op=True) if async_op else fn(into, mine)
        settle(work, async_op)
        return out
    return run


def detached(make):
    return lambda: make().detach()


for kind, make in kinds().items():
    for suffix, async_op in (("", False), ("/async", True)):
        run = gather_into(lambda make=make: [make() for _ in range(N)], make, dist.all_gather, async_op)
        call(f"all_gather/{kind}{suffix}", run, no_grad(run))
for dtype in DTYPES:
    call(f"all_gather/{dtype}", gather_into(lambda dtype=dtype: [values(dtype).zero_() for _ in range(N)],
                                            lambda dtype=dtype: values(dtype), dist.all_gather))
call("all_gather/uneven_outputs", gather_into(lambda: [torch.zeros(3 + k) for k in range(N)], kinds()["plain"],
                                              dist.all_gather))
call("all_gather/too_few_outputs", gather_into(lambda: [torch.zeros(3)], kinds()["plain"], dist.all_gather))
for suffix, async_op in (("", False), ("/async", True)):
    call(f"all_gather_into_tensor{suffix}", gather_into(lambda: torch.zeros(3 * N), kinds()["plain"],
                                                        dist.all_gather_into_tensor, async_op))
    call(f"all_gather_into_tensor/stacked{suffix}", gather_into(lambda: torch.zeros(N, 3), kinds()["plain"],
                                                                dist.all_gather_into_tensor, async_op),
         gather_into(lambda: torch.zeros(N, 3), kinds()["plain"], dist.all_gather_into_tensor, async_op, (3 * N,)))
for kind in ("parameter", "requires_grad", "noncontiguous", "scalar", "empty"):
    make = kinds()[kind]
    out = lambda make=make: torch.zeros(N * make().numel())  # noqa: E731
    call(f"all_gather_into_tensor/input_{kind}", gather_into(out, make, dist.all_gather_into_tensor),
         gather_into(out, detached(make), dist.all_gather_into_tensor, in_shape=(-1,)))
call("all_gather_into_tensor/output_noncontiguous",
     gather_into(lambda: torch.zeros(3 * N, 2)[:, 0], kinds()["plain"], dist.all_gather_into_tensor))
call("all_gather_into_tensor/bfloat16", gather_into(lambda: torch.zeros(3 * N, dtype=torch.bfloat16),
                                                    lambda: values(torch.bfloat16), dist.all_gather_into_tensor))
call("all_gather_into_tensor/wrong_size", gather_into(lambda: torch.zeros(3 * N + 1), kinds()["plain"],
                                                      dist.all_gather_into_tensor))
call("all_gather_into_tensor/wrong_dtype", gather_into(lambda: torch.zeros(3 * N, dtype=torch.float64),
                                                       kinds()["plain"], dist.all_gather_into_tensor))
call("all_gather_single", gather_into(lambda: torch.zeros(3 * N), kinds()["plain"], dist.all_gather_single))


def all_gather_coalesced(async_op=False):
    def run():
        outs = [[torch.zeros(3), torch.zeros(2, 2)] for _ in range(N)]
        work = dist.all_gather_coalesced(outs, [values(torch.float32), values(torch.float32, (2, 2), 5)],
                                         async_op=async_op)
        settle(work, async_op)
        return outs
    return run


call("all_gather_coalesced", all_gather_coalesced())
call("all_gather_coalesced/async", all_gather_coalesced(True))


def all_reduce_coalesced(dtype, async_op=False, op=dist.ReduceOp.SUM):
    def run():
        tensors = [values(dtype), values(dtype, (2, 2), 1), values(dtype, (), 2)]
        work = dist.all_reduce_coalesced(tensors, op=op, async_op=async_op)
        settle(work, async_op)
        return tensors
    return run


call("all_reduce_coalesced", all_reduce_coalesced(torch.float32))
call("all_reduce_coalesced/async", all_reduce_coalesced(torch.float32, True))
call("all_reduce_coalesced/max", all_reduce_coalesced(torch.float32, op=dist.ReduceOp.MAX))
call("all_reduce_coalesced/bfloat16", all_reduce_coalesced(torch.bfloat16))
call("all_reduce_coalesced/int64", all_reduce_coalesced(torch.int64))


def coalescing_manager(kind, async_ops):
    def run():
        tensors = [values(torch.float32, (2,), k) for k in range(3)]
        outs = [torch.zeros(2 * N) for _ in range(3)]
        with dist._coalescing_manager(async_ops=async_ops) as manager:
            for k, t in enumerate(tensors):
                if kind == "all_reduce":
                    dist.all_reduce(t)
                elif kind == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(outs[k], t)
                else:
                    dist.reduce_scatter_tensor(t, outs[k] + values(torch.float32, (2 * N,), k))
        if async_ops:
            manager.wait()
        return outs if kind == "all_gather_into_tensor" else tensors
    return run


for kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
    call(f"_coalescing_manager/{kind}", coalescing_manager(kind, False))
    call(f"_coalescing_manager/{kind}/async", coalescing_manager(kind, True))


# --- reduce_scatter, reduce_scatter_tensor ---------------------------------------------------------------
def scatter_from(make_out, make_in, fn, async_op=False, out_shape=None, in_shape=None):
    return gather_into(make_out, make_in, fn, async_op, out_shape, in_shape)


def lists_twin(make_out, make_in, fn, async_op):
    """``fn(out, ins)`` on contiguous copies outside autograd, ``out`` copied back."""
    def run():
        out, ins = make_out(), make_in()
        ins = [t.contiguous() for t in ins] if isinstance(ins, list) else ins.contiguous()
        with torch.no_grad():
            into = [t.contiguous() for t in out] if isinstance(out, list) else out.contiguous()
            work = fn(into, ins, async_op=True) if async_op else fn(into, ins)
            settle(work, async_op)
            for t, done in zip(out, into) if isinstance(out, list) else [(out, into)]:
                t.copy_(done)
        return out
    return run


for kind, make in kinds().items():
    for suffix, async_op in (("", False), ("/async", True)):
        inputs = lambda make=make: [make() for _ in range(N)]  # noqa: E731
        call(f"reduce_scatter/{kind}{suffix}", scatter_from(make, inputs, dist.reduce_scatter, async_op),
             lists_twin(make, inputs, dist.reduce_scatter, async_op))
for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.float16):
    call(f"reduce_scatter/{dtype}", scatter_from(lambda dtype=dtype: values(dtype),
                                                 lambda dtype=dtype: [values(dtype, base=k) for k in range(N)],
                                                 dist.reduce_scatter))
call("reduce_scatter/max", scatter_from(kinds()["plain"], lambda: [values(torch.float32, base=k) for k in range(N)],
                                        lambda o, i: dist.reduce_scatter(o, i, op=dist.ReduceOp.MAX)))
for suffix, async_op in (("", False), ("/async", True)):
    call(f"reduce_scatter_tensor{suffix}", scatter_from(kinds()["plain"], lambda: values(torch.float32, (3 * N,)),
                                                        dist.reduce_scatter_tensor, async_op))
for dtype in DTYPES:
    call(f"reduce_scatter_tensor/{dtype}", scatter_from(lambda dtype=dtype: values(dtype),
                                                        lambda dtype=dtype: values(dtype, (3 * N,)),
                                                        dist.reduce_scatter_tensor))
for kind in ("parameter", "requires_grad", "noncontiguous", "scalar", "empty"):
    make = kinds()[kind]
    inputs = lambda make=make: values(torch.float32, (N * make().numel(),))  # noqa: E731
    call(f"reduce_scatter_tensor/output_{kind}", scatter_from(make, inputs, dist.reduce_scatter_tensor),
         no_grad(scatter_from(make, inputs, dist.reduce_scatter_tensor, out_shape=(-1,))))
call("reduce_scatter_tensor/stacked", scatter_from(kinds()["plain"], lambda: values(torch.float32, (N, 3)),
                                                   dist.reduce_scatter_tensor),
     scatter_from(kinds()["plain"], lambda: values(torch.float32, (N, 3)), dist.reduce_scatter_tensor,
                  in_shape=(-1,)))
call("reduce_scatter_tensor/avg", scatter_from(kinds()["plain"], lambda: values(torch.float32, (3 * N,)),
                                               lambda o, i: dist.reduce_scatter_tensor(o, i, op=dist.ReduceOp.AVG)))
call("reduce_scatter_tensor/premul_sum", scatter_from(
    kinds()["plain"], lambda: values(torch.float32, (3 * N,)),
    lambda o, i: dist.reduce_scatter_tensor(o, i, op=dist._make_nccl_premul_sum(0.5))),
    scatter_from(kinds()["plain"], lambda: values(torch.float32, (3 * N,)) * 0.5, dist.reduce_scatter_tensor))
call("reduce_scatter_tensor/wrong_size", scatter_from(kinds()["plain"], lambda: values(torch.float32, (3 * N + 1,)),
                                                      dist.reduce_scatter_tensor))
call("reduce_scatter_single", scatter_from(kinds()["plain"], lambda: values(torch.float32, (3 * N,)),
                                           dist.reduce_scatter_single))


# --- all_to_all, all_to_all_single ------------------------------------------------------------------------
for kind, make in kinds().items():
    for suffix, async_op in (("", False), ("/async", True)):
        tensors = lambda make=make: [make() for _ in range(N)]  # noqa: E731
        call(f"all_to_all/{kind}{suffix}", gather_into(tensors, tensors, dist.all_to_all, async_op),
             lists_twin(tensors, tensors, dist.all_to_all, async_op))


def all_to_all_uneven_twin():
    """all_to_all of uneven sizes as one all_to_all_single with splits."""
    flat = torch.zeros(N * (RANK + 1))
    dist.all_to_all_single(flat, torch.cat([torch.full((k + 1,), float(RANK)) for k in range(N)]), [RANK + 1] * N,
                           [k + 1 for k in range(N)])
    return list(flat.split(RANK + 1))


call("all_to_all/uneven", gather_into(lambda: [torch.zeros(RANK + 1) for _ in range(N)],
                                      lambda: [torch.full((k + 1,), float(RANK)) for k in range(N)], dist.all_to_all),
     all_to_all_uneven_twin)
call("all_to_all/bfloat16", gather_into(lambda: [torch.zeros(2, dtype=torch.bfloat16) for _ in range(N)],
                                        lambda: [values(torch.bfloat16, (2,), k) for k in range(N)], dist.all_to_all))
for suffix, async_op in (("", False), ("/async", True)):
    call(f"all_to_all_single{suffix}", gather_into(lambda: torch.zeros(2 * N), lambda: values(torch.float32, (2 * N,)),
                                                   dist.all_to_all_single, async_op))
call("all_to_all_single/splits", gather_into(
    lambda: torch.zeros(N * (RANK + 1)), lambda: torch.arange(float(N * (N + 1) // 2)) + 100 * RANK,
    lambda o, i: dist.all_to_all_single(o, i, [RANK + 1] * N, [k + 1 for k in range(N)])))
call("all_to_all_single/2d", gather_into(lambda: torch.zeros(N, 2), lambda: values(torch.float32, (N, 2)),
                                         dist.all_to_all_single))
call("all_to_all_single/noncontiguous_out", gather_into(lambda: torch.zeros(2 * N, 2)[:, 0],
                                                        lambda: values(torch.float32, (2 * N,)),
                                                        dist.all_to_all_single),
     lists_twin(lambda: torch.zeros(2 * N, 2)[:, 0], lambda: values(torch.float32, (2 * N,)), dist.all_to_all_single,
                False))
call("all_to_all_single/parameter_out", gather_into(lambda: nn.Parameter(torch.zeros(2 * N)),
                                                     lambda: values(torch.float32, (2 * N,)), dist.all_to_all_single))
call("all_to_all_single/bfloat16", gather_into(lambda: torch.zeros(2 * N, dtype=torch.bfloat16),
                                               lambda: values(torch.bfloat16, (2 * N,)), dist.all_to_all_single))
call("all_to_all_single/wrong_splits", gather_into(lambda: torch.zeros(2 * N), lambda: values(torch.float32, (2 * N,)),
                                                   lambda o, i: dist.all_to_all_single(o, i, [1] * N, [1] * N)))


# --- rooted: reduce, gather, scatter ---------------------------------------------------------------------
def at_root(fn, root):
    """``fn()``'s result on ``root``; elsewhere "unspecified" (torch leaves reduce's other
    tensors unspecified: gloo writes partial sums there)."""
    def run():
        got = fn()
        return got if RANK == root else "unspecified"
    return run


def reduce_to(root, op=dist.ReduceOp.SUM):
    return lambda t, async_op=False: dist.reduce(t, dst=root, op=op, async_op=async_op)


for kind, make in kinds().items():
    for suffix, async_op in (("", False), ("/async", True)):
        call(f"reduce/{kind}{suffix}", at_root(in_place(reduce_to(0), make, async_op), 0),
             at_root(in_place(reduce_to(0), make, async_op, contiguous=True), 0))
for op_name in ("max", "product", "avg"):
    call(f"reduce/{op_name}", at_root(in_place(reduce_to(N - 1, OPS[op_name]), kinds()["plain"]), N - 1))
call("reduce/bfloat16", at_root(in_place(reduce_to(0), lambda: values(torch.bfloat16)), 0))


def rooted_gather(make, root, async_op=False):
    def run():
        pieces = [make() for _ in range(N)] if RANK == root else None
        work = dist.gather(make(), pieces, dst=root, async_op=async_op)
        settle(work, async_op)
        return pieces
    return run


for kind, make in kinds().items():
    call(f"gather/{kind}", rooted_gather(make, N - 1), no_grad(rooted_gather(make, N - 1)))
call("gather/async", rooted_gather(kinds()["plain"], 0, True))
call("gather/bfloat16", rooted_gather(lambda: values(torch.bfloat16), 0))


def rooted_scatter(make, root, async_op=False, twin=False):
    """``twin``: into a contiguous copy outside autograd, copied back."""
    def run():
        mine = make()
        with torch.no_grad():
            mine.zero_()
        pieces = [values(mine.dtype, tuple(mine.shape), 10 * k) for k in range(N)] if RANK == root else None
        with torch.no_grad() if twin else contextlib.nullcontext():
            into = mine.contiguous() if twin else mine
            work = dist.scatter(into, pieces, src=root, async_op=async_op)
            settle(work, async_op)
            if into is not mine:
                mine.copy_(into)
        return mine
    return run


for kind, make in kinds().items():
    call(f"scatter/{kind}", rooted_scatter(make, N - 1), rooted_scatter(make, N - 1, twin=True))
call("scatter/async", rooted_scatter(kinds()["plain"], 0, True))
call("scatter/bfloat16", rooted_scatter(lambda: values(torch.bfloat16), 0))


# --- objects ----------------------------------------------------------------------------------------------
def objects(name):
    def run():
        mine = {"rank": RANK, "tensor": torch.arange(RANK + 1), "text": "x" * RANK}
        if name == "all_gather_object":
            out = [None] * N
            dist.all_gather_object(out, mine)
            return out
        if name == "gather_object":
            out = [None] * N if RANK == N - 1 else None
            dist.gather_object(mine, out, dst=N - 1)
            return out
        if name == "broadcast_object_list":
            out = [mine, RANK]
            dist.broadcast_object_list(out, src=N - 1)
            return out
        if name == "scatter_object_list":
            out = [None]
            dist.scatter_object_list(out, [{"to": k, "from": RANK} for k in range(N)] if RANK == 0 else None, src=0)
            return out
        out = [None, None]  # send_object_list / recv_object_list in a ring
        if RANK % 2 == 0:
            dist.send_object_list([mine, RANK], dst=(RANK + 1) % N)
            dist.recv_object_list(out, src=(RANK - 1) % N)
        else:
            dist.recv_object_list(out, src=(RANK - 1) % N)
            dist.send_object_list([mine, RANK], dst=(RANK + 1) % N)
        return out
    return run


for name in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
             "send_object_list/recv_object_list"):
    call(name, objects(name))


# --- point-to-point ---------------------------------------------------------------------------------------
def ring(make, how, contiguous=False):
    """Each rank sends to the next and receives from the one before (even ranks send first).
    ``contiguous``: from and into contiguous copies (the twin of a non-contiguous call)."""
    def run():
        got = make()
        into, send = (got.contiguous(), make().contiguous()) if contiguous else (got, make())
        if N == 1:
            return into
        nxt, prev = (RANK + 1) % N, (RANK - 1) % N
        if how == "batch":
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, into, prev)]):
                work.wait()
        elif how == "isend":
            works = [dist.isend(send, nxt), dist.irecv(into, prev)]
            for work in works:
                work.wait()
        elif RANK % 2 == 0:
            dist.send(send, nxt)
            dist.recv(into, prev)
        else:
            dist.recv(into, prev)
            dist.send(send, nxt)
        if into is not got:
            got.copy_(into)
        return got
    return run


for kind, make in kinds().items():
    for how in ("send", "isend", "batch"):
        call(f"{how}/{kind}", ring(make, how), ring(make, how, contiguous=True))
call("send/bfloat16", ring(lambda: values(torch.bfloat16), "send"))


# --- barriers ---------------------------------------------------------------------------------------------
def barrier(async_op=False):
    def run():
        work = dist.barrier(async_op=async_op)
        settle(work, async_op)
        return None
    return run


call("barrier", barrier())
call("barrier/async", barrier(True))
call("monitored_barrier", lambda: dist.monitored_barrier(timeout=timedelta(seconds=60)))
call("monitored_barrier/wait_all_ranks", lambda: dist.monitored_barrier(timeout=timedelta(seconds=60),
                                                                        wait_all_ranks=True))


# --- groups -----------------------------------------------------------------------------------------------
call("get_rank", lambda: dist.get_rank())
call("get_world_size", lambda: dist.get_world_size())
call("get_process_group_ranks", lambda: dist.get_process_group_ranks(dist.group.WORLD))
call("get_global_rank", lambda: dist.get_global_rank(dist.group.WORLD, N - 1))
call("get_group_rank", lambda: dist.get_group_rank(dist.group.WORLD, N - 1))
SUB = list(range(1, N)) if N > 1 else [0]  # every rank but 0
sub = dist.new_group(SUB)
inside = RANK in SUB
call("new_group/get_rank", lambda: dist.get_rank(sub))
call("new_group/get_world_size", lambda: dist.get_world_size(sub) if inside else None)
call("new_group/get_process_group_ranks", lambda: dist.get_process_group_ranks(sub) if inside else None)
call("new_group/get_global_rank", lambda: dist.get_global_rank(sub, 0) if inside else None)
call("new_group/get_group_rank", lambda: dist.get_group_rank(sub, SUB[-1]) if inside else None)
call("new_group/all_reduce", in_place(lambda t: dist.all_reduce(t, group=sub), kinds()["parameter"]))
call("new_group/broadcast", in_place(lambda t: dist.broadcast(t, src=SUB[-1], group=sub), kinds()["plain"]))
call("new_group/broadcast_group_src", in_place(lambda t: dist.broadcast(t, group=sub, group_src=0), kinds()["plain"]))
call("new_group/all_gather_into_tensor", gather_into(lambda: torch.zeros(3 * len(SUB)), kinds()["plain"],
                                                     lambda o, i: dist.all_gather_into_tensor(o, i, group=sub)))
call("new_group/reduce", at_root(in_place(lambda t: dist.reduce(t, dst=SUB[0], group=sub), kinds()["plain"]), SUB[0]))
call("new_group/reduce_group_dst", at_root(in_place(lambda t: dist.reduce(t, group=sub, group_dst=0),
                                                    kinds()["plain"]), SUB[0]))


def sub_all_reduce_coalesced():
    tensors = [values(torch.float32), values(torch.float32, (2,))]
    dist.all_reduce_coalesced(tensors, group=sub)
    return tensors


call("new_group/all_reduce_coalesced", sub_all_reduce_coalesced)
call("new_group/monitored_barrier", lambda: dist.monitored_barrier(group=sub, timeout=timedelta(seconds=60)))
call("new_group/barrier", lambda: dist.barrier(group=sub))
call("new_group/all_gather_object", lambda: [dist.all_gather_object(out := [None] * len(SUB), RANK, group=sub),
                                             out][1] if inside else None)
call("new_group/destroy_process_group", lambda: dist.destroy_process_group(sub))
call("new_subgroups", lambda: (lambda made: (dist.get_process_group_ranks(made[0]),
                                             len(made[1])))(dist.new_subgroups(1)))
call("get_backend", lambda: dist.get_backend())
call("get_backend_config", lambda: dist.get_backend_config())
call("shrink_group", lambda: dist.shrink_group([N - 1]) and None)

# --- bad input --------------------------------------------------------------------------------------------
call("bad/meta_tensor", in_place(dist.all_reduce, lambda: torch.zeros(3, device="meta")))
call("bad/mixed_dtypes", gather_into(lambda: [torch.zeros(3, dtype=torch.float64) for _ in range(N)],
                                     kinds()["plain"], dist.all_gather))
call("bad/not_a_tensor", lambda: dist.all_reduce([1.0, 2.0]))
call("bad/unknown_op", in_place(lambda t: dist.all_reduce(t, op="sum"), kinds()["plain"]))
call("bad/complex_max", in_place(lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX), lambda: values(torch.complex64)))
call("done", lambda: dist.barrier())
OUT.close()
dist.destroy_process_group()
