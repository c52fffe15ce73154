"""Running torch's OpInfo samples (``op_db``) on DTensors and comparing with plain torch.

A *case* is one sample input of one op under one *layout*: a rule that gives each
tensor argument its placements (``S0``: ``Shard(0)``; ``S-1``: ``Shard(-1)``;
``R``: ``Replicate()``; ``P``: the first floating tensor ``Partial`` (rank 0 holds
it, the others zeros), the rest ``Shard(0)``; ``2d``: ``[Shard(0), Shard(1)]`` on a
2x2 mesh). A 0-d tensor, or one too small for the dim, stays ``Replicate()`` there.
``run_case`` returns an error message or ``None``; the verdict is agreed by every
rank (one small allgather), so one rank's failure cannot leave the others waiting.
References (outputs and gradients of plain torch) are computed once per process.

Besides values, layouts: a DTensor result's global strides must be torch's (run on plain
inputs with the DTensor arguments' global strides), and its local tensor must be laid out
as torch lays out the op's result on the local inputs (``layout_mismatch``), since a later
op decides from the global strides what it may do (a ``view`` above all), then runs on the
local tensor. A layout verdict is a rank's own: it is taken after every collective of the case.
"""
from __future__ import annotations

import functools
import math
import os
import traceback
import warnings

import torch
from mpi4py import MPI
from torch.utils._python_dispatch import TorchDispatchMode

from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor

WORLD = MPI.COMM_WORLD
DTYPE = torch.float32
DEBUG = bool(os.environ.get("OPINFO_DEBUG"))

# Ops whose values are random by nature: checked for shape, dtype, layout invariance
# (same seed, same global tensor whatever the placements) and rough statistics.
RANDOM = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "normal.in_place", "normal.number_mean", "rand_like", "randint", "randint_like", "randn",
    "randn_like", "uniform", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.rrelu", "nn.functional.multi_head_attention_forward", "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
}
# Ops returning uninitialised memory: checked for shape and dtype only.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
# The one list of ops the sweeps (test_opinfo.py, opinfo_all_samples.py) do not check, with the reason.
NOT_CHECKED = {
    "sparse.sampled_addmm": "sparse CSR arguments: DTensor is strided only",
    "sparse.mm.reduce": "sparse CSR arguments: DTensor is strided only",
    "to_sparse": "returns a sparse tensor: DTensor is strided only",
    "jiterator_unary": "CUDA only (no sample inputs on CPU)",
    "jiterator_binary": "CUDA only (no sample inputs on CPU)",
    "jiterator_4inputs_with_extra_args": "CUDA only (no sample inputs on CPU)",
    "jiterator_binary_return_by_ref": "CUDA only (no sample inputs on CPU)",
    "jiterator_2inputs_2outputs": "CUDA only (no sample inputs on CPU)",
    "linalg.eig": "the reference gradient itself is ill-defined (eigenvector phase) and raises",
}
# Distributed reductions sum in another order: float32 rounding differs slightly.
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def op_key(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _no_unittest_frames() -> None:
    """``None``, at once: what ``extract_test_fn`` finds for a pytest function."""
    return None


@functools.lru_cache(maxsize=None)
def sweep_ops() -> tuple:
    """Every op of ``op_db`` that supports float32 on CPU, in ``op_db`` order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal import common_utils
        from torch.testing._internal.common_methods_invocations import op_db
        from torch.testing._internal.opinfo import core
    # OpInfo.sample_inputs walks the whole call stack (inspect.stack, twice per op) looking
    # for a unittest.TestCase to tag; these tests are pytest functions, so the walk finds
    # none, and it took a third of the sweep's CPU time under pytest.
    common_utils.extract_test_fn = core.extract_test_fn = _no_unittest_frames
    return tuple(op for op in op_db if DTYPE in op.supported_dtypes("cpu"))


@functools.lru_cache(maxsize=None)
def samples(key: str, n: int) -> tuple:
    """The first ``n`` sample inputs of op ``key`` (with ``requires_grad`` where the op
    supports autograd), plus the reference for each: ``(sample, outputs, grads)``."""
    return tuple(sample_list(key, n))


def sample_list(key: str, n: int | None = None) -> list:
    """``samples`` uncached (``n=None``: every sample). All are drawn before any case
    runs, so random ops in the cases cannot change the later samples."""
    op = next(o for o in sweep_ops() if op_key(o) == key)
    grad = op.supports_autograd and key not in RANDOM
    out = []
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, s in enumerate(op.sample_inputs("cpu", DTYPE, requires_grad=grad)):
            if i == n:
                break
            _snapshot(s)
            try:
                out.append((s, *_reference(op, s, grad)))
            except Exception as err:  # noqa: BLE001 - torch refuses this sample: so must DTensor
                out.append((s, RefusedByTorch(f"{type(err).__name__}: {err}"), None))
    return out


def _snapshot(sample) -> None:
    """Give ``sample`` its own copies of its tensors: some generators build later samples
    by writing into a tensor an earlier sample holds (a NaN into masked.argmax's input)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(t.requires_grad)

    sample.input, sample.args, sample.kwargs = (_map(x, copy) for x in (sample.input, sample.args, sample.kwargs))


class RefusedByTorch(str):
    """The reference outputs of a sample torch itself raises on (the DTensor run must raise too)."""


# --- structure helpers -------------------------------------------------------------------------


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = [_map(x, fn) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuples too
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _flat(obj) -> list:
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return [x for item in obj for x in _flat(item)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _flat(v)]
    return [obj]


def _call(op, sample, convert):
    """Run ``op`` on the sample with every tensor passed through ``convert``."""
    inp = _map(sample.input, convert)
    args = _map(sample.args, convert)
    kwargs = _map(sample.kwargs, convert)
    return op(inp, *args, **kwargs)


def _loss_terms(outputs) -> list[torch.Tensor]:
    """A fixed real weighting of every differentiable output (same on every rank)."""
    terms = []
    for i, o in enumerate(outputs):
        if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex()):
            gen = torch.Generator().manual_seed(7 + i)
            w = torch.randn(o.shape, generator=gen)
            if o.is_complex():
                terms.append((torch.real(o) * w).sum() + (torch.imag(o) * w.flip(0) if o.ndim else torch.imag(o) * w).sum())
            else:
                terms.append((o * w.to(o.dtype)).sum())
    return terms


class _SubclassPath(TorchDispatchMode):
    """Runs every op as is. Under a dispatch mode torch takes the code paths it takes for
    tensor subclasses such as DTensor (some backward formulas, e.g. ormqr's, then build
    their result out of place, in another layout), so the reference layouts are those
    torch gives a subclass."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _reference(op, sample, grad: bool, inputs: list | None = None):
    """Outputs and input gradients of plain torch on the sample (on ``inputs``, the sample's
    tensors in ``_call`` order, when given)."""
    leaves = []
    given = iter(inputs) if inputs is not None else None

    def fresh(t):
        c = (t if given is None else next(given)).detach().clone()
        if t.requires_grad:
            c.requires_grad_(True)
            leaves.append(c)
        return c

    with _SubclassPath():
        outputs = _flat(_call(op, sample, fresh))
        grads = None
        if grad and leaves:
            terms = _loss_terms(outputs)
            if terms:
                grads = torch.autograd.grad(sum(terms), leaves, allow_unused=True)
    outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
    return outputs, grads


# --- layouts ------------------------------------------------------------------------------------


def placements_for(layout: str, t: torch.Tensor, mesh_ndim: int) -> list:
    if layout == "2d":
        return [Shard(0) if t.ndim >= 1 else Replicate(), Shard(1) if t.ndim >= 2 else Replicate()]
    if layout == "R" or t.ndim == 0:
        return [Replicate()] * mesh_ndim
    if layout == "S-1":
        return [Shard(t.ndim - 1)]
    return [Shard(0)]


def _distribute(layout: str, mesh, leaves: list, twins: list | None = None):
    """A converter from sample tensors to DTensors (recording the gradient leaves, and in
    ``twins`` each DTensor's global value as a plain tensor with the DTensor's strides)."""
    state = {"first": True}

    def convert(t: torch.Tensor):
        if t.layout != torch.strided:
            raise _Unsupported(f"{t.layout} argument")
        wants_grad = t.requires_grad
        data = t.detach().clone()
        if layout == "P" and state["first"] and t.is_floating_point():
            state["first"] = False
            local = data if WORLD.rank == 0 else torch.zeros_like(data)
            d = DTensor.from_local(local, mesh, [Partial()], shape=data.shape, stride=data.stride())
        else:
            d = distribute_tensor(data, mesh, placements_for(layout, t, mesh.ndim))
        if twins is not None:
            twins.append(torch.empty_strided(data.shape, d.stride(), dtype=data.dtype).copy_(data))
        if wants_grad:
            d.requires_grad_(True)
            leaves.append(d)
        return d

    return convert


class _Unsupported(Exception):
    pass


# --- one case -----------------------------------------------------------------------------------


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


# --- layouts of local results ---------------------------------------------------------------


def _dense_order(shape, stride) -> list[int] | None:
    """The dims of size > 1, outermost first, when the layout is non-overlapping and dense
    (a permutation of a contiguous one); None otherwise."""
    dims = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: -stride[d])
    step = 1
    for d in reversed(dims):
        if stride[d] != step:
            return None
        step *= shape[d]
    return dims


def _differing_strides(shape, stride, expected) -> bool:
    """torch's ``check_significant_strides``: only dims of size > 1 count."""
    return any(n > 1 and s != e for n, s, e in zip(shape, stride, expected))


def layout_mismatch(local: torch.Tensor, shape, stride) -> str | None:
    """Why ``local``, this rank's block of a result plain torch lays out as ``(shape, stride)``,
    is laid out unlike torch's result, or None.

    A block of a dense result (the whole result included) must be dense in the same dim
    order: torch's strides on every dim of size > 1 (``check_significant_strides``), what
    torch gives for the op on the local inputs. A block of a strided view (gaps, overlaps,
    zero strides), whose stride values depend on the base it views, must behave alike for
    every later op: the same dim order in memory, the same zero-stride dims, contiguous
    where the whole is, and each pair of neighbouring dims that merges in the whole (so a
    ``view`` may flatten them) merges in the block."""
    lshape, lstride = tuple(local.shape), local.stride()
    if local.numel() <= 1:
        return None
    order = _dense_order(shape, stride)
    if order is None:
        return _view_mismatch(local, shape, stride)
    expected, step = list(lstride), 1
    for d in reversed(order):
        expected[d] = step
        step *= lshape[d]
    if _differing_strides(lshape, lstride, expected):
        return f"local strides {lstride} of shape {lshape}, torch's {tuple(expected)}"
    return None


def _view_mismatch(local: torch.Tensor, shape, stride) -> str | None:
    lshape, lstride = local.shape, local.stride()
    where = f"local strides {tuple(lstride)} of shape {tuple(lshape)}, whole {tuple(stride)} of {tuple(shape)}"
    both = [d for d in range(len(shape)) if lshape[d] > 1]
    if any((stride[d] == 0) != (lstride[d] == 0) for d in both):
        return f"{where}: other zero-stride (expanded) dims"
    if sorted(both, key=lambda d: (-stride[d], d)) != sorted(both, key=lambda d: (-lstride[d], d)):
        return f"{where}: other dim order in memory"
    if torch.empty_strided(shape, stride, device="meta").is_contiguous() and not local.is_contiguous():
        return f"{where}: not contiguous"
    dims = [d for d in range(len(shape)) if shape[d] > 1]
    for a, b in zip(dims, dims[1:]):
        if stride[a] == stride[b] * shape[b] and lshape[a] > 1 and lshape[b] > 1 \
                and lstride[a] != lstride[b] * lshape[b]:
            return f"{where}: dims {a} and {b} do not merge"
    return None


def _layout_problem(got: torch.Tensor, laid_out: torch.Tensor) -> str | None:
    """A DTensor's global strides and local layout, or a plain result's strides, against torch's."""
    if isinstance(got, DTensor):
        if _differing_strides(got.shape, got.stride(), laid_out.stride()) and laid_out.numel() > 1:
            return f"global strides {got.stride()}, torch's {laid_out.stride()}"
        return layout_mismatch(got._local_tensor, laid_out.shape, laid_out.stride())
    return layout_mismatch(got, laid_out.shape, laid_out.stride())


def _layouts(results, laid_out, what: str) -> str | None:
    """The first result whose layout differs from torch's (``_layout_problem``), or None."""
    for i, (got, lay) in enumerate(zip(results, laid_out)):
        if isinstance(got, torch.Tensor) and isinstance(lay, torch.Tensor) and got.shape == lay.shape:
            msg = _layout_problem(got, lay)
            if msg:
                return f"{what} {i}: {msg}"
    return None


def _laid_out_reference(op, sample, twins: list, ref_out, ref_grads):
    """torch's outputs and gradients on plain inputs with the DTensor arguments' global
    strides (``twins``): the cached reference when those are the strides it ran on."""
    fresh: list = []
    _map((sample.input, sample.args, sample.kwargs), lambda t: fresh.append(t.detach().clone().stride()))
    if all(s == t.stride() for s, t in zip(fresh, twins)):
        return ref_out, ref_grads
    return _reference(op, sample, ref_grads is not None, twins)


def _compare(key: str, ref, got, what: str) -> str | None:
    """Why ``got`` differs from ``ref`` (values), or None. The same on every rank."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{what}: got {type(got).__name__}, expected a tensor"
        got = _full(got).detach()
        if got.shape != ref.shape or got.dtype != ref.dtype:
            return f"{what}: shape/dtype {tuple(got.shape)}/{got.dtype}, expected {tuple(ref.shape)}/{ref.dtype}"
        if key in UNINITIALISED:
            return None
        try:
            torch.testing.assert_close(got, ref, equal_nan=True, **TOLERANCE)
        except AssertionError as err:
            return f"{what}: {str(err)[:300]}"
        return None
    if isinstance(got, DTensor) or got != ref:
        return f"{what}: {got!r} != {ref!r}"
    return None


def _random_check(op, sample, ref_out, mesh, layout) -> str | None:
    """Shape, dtype, the same global values under two layouts, and rough statistics."""
    results, twins = [], []
    for lay in (layout, "R"):
        torch.manual_seed(5)
        out = _flat(_call(op, sample, _distribute(lay, mesh, [], twins if lay == layout else None)))
        if lay == layout:
            laid_out, raw = _laid_out_reference(op, sample, twins, ref_out, None)[0], out
        results.append([_full(o).detach() if isinstance(o, torch.Tensor) else o for o in out])
    for i, (r, a, b) in enumerate(zip(ref_out, *results)):
        if not isinstance(r, torch.Tensor):
            continue
        if a.shape != r.shape or a.dtype != r.dtype:
            return f"output {i}: shape/dtype {tuple(a.shape)}/{a.dtype}, expected {tuple(r.shape)}/{r.dtype}"
        if not torch.equal(a, b) and not (a.isnan() == b.isnan()).all():
            return f"output {i}: differs between layouts {layout} and R"
        if a.is_floating_point() and a.numel() >= 200:
            rm, am = r.float().mean().item(), a.float().mean().item()
            spread = r.float().std().item() + 1e-3
            if math.isfinite(rm) and abs(rm - am) > 0.5 * spread:
                return f"output {i}: mean {am:.3g} far from the reference's {rm:.3g}"
    return _layouts(raw, laid_out, "output")


def run_case(op, key: str, sample, ref_out, ref_grads, mesh, layout: str) -> str | None:
    """This rank's verdict on one case: None when it matches plain torch."""
    try:
        leaves: list = []
        if isinstance(ref_out, RefusedByTorch):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _call(op, sample, _distribute(layout, mesh, leaves))
            except Exception:  # noqa: BLE001 - the expected outcome
                return None
            return f"torch raised ({ref_out[:200]}), DTensor did not"
        if key in RANDOM or sample.kwargs.get("dropout_p", 0) > 0:  # SDPA's dropout samples are random
            return _random_check(op, sample, ref_out, mesh, layout)
        twins: list = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _flat(_call(op, sample, _distribute(layout, mesh, leaves, twins)))
            laid_out, laid_out_grads = _laid_out_reference(op, sample, twins, ref_out, ref_grads)
        if len(out) != len(ref_out):
            return f"{len(out)} outputs, expected {len(ref_out)}"
        for i, (r, g) in enumerate(zip(ref_out, out)):
            msg = _compare(key, r, g, f"output {i}")
            if msg:
                return msg
        out_layout = _layouts(out, laid_out, "output")  # this rank's own verdict: after every collective
        if ref_grads is None:
            return out_layout
        terms = _loss_terms([_full(o) for o in out])
        if not terms:
            return "no differentiable output"
        grads = torch.autograd.grad(sum(terms), leaves, allow_unused=True)
        for i, (r, g) in enumerate(zip(ref_grads, grads)):
            if r is None and g is None:
                continue
            if r is None or g is None:
                return f"grad {i}: {'missing' if g is None else 'unexpected'}"
            msg = _compare(key, r, g, f"grad {i}")
            if msg:
                return msg
        return out_layout or _layouts(grads, laid_out_grads or (), "grad")
    except _Unsupported as err:
        return f"unsupported: {err}"
    except Exception as err:  # noqa: BLE001 - any error is a verdict
        if DEBUG:
            traceback.print_exc()
        return f"{type(err).__name__}: {str(err)[:300]}"


def agreed(message: str | None) -> str | None:
    """The verdict of every rank together: None only if all ranks passed."""
    msgs = WORLD.allgather(message)
    bad = sorted({m for m in msgs if m is not None})
    return "; ".join(bad) if bad else None

