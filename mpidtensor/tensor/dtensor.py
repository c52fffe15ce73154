"""``DTensor``: a ``torch.Tensor`` subclass whose shape, stride and dtype are global.

It holds this rank's local tensor and a :class:`DTensorSpec`. Every aten op on it
goes through :func:`mpidtensor.dispatch.dispatch`: that package installs the class's
``__torch_dispatch__`` when imported (this module does not import it). The conversions
to and from local tensors and between placements are autograd functions, so gradients
flow through them with the placements PyTorch documents.

Under ``torch.compile`` a DTensor is a traceable wrapper subclass (``__tensor_flatten__``
/ ``__tensor_unflatten__``; the spec is interned and copies to itself); the collectives
of dispatch are traced as custom ops (:mod:`mpidtensor.runtime.dynamo_hook`), and ``from_local``,
``redistribute`` and ``full_tensor`` are graph breaks.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from .layout import global_strides
from ..fast.functions import direct_apply
from . import pickling, torch_format, validate
from ..mesh import DeviceMesh
from ..mesh.foreign import refuse_torch_dtensor, require_mesh
from .placements import Partial, Placement, Replicate, normalize_placements, shard_dim
from .redistribute import redistribute_local
from ..runtime import caches
from ..runtime.effects import effect
from .spec import DTensorSpec, from_torch_spec


_INCONSISTENT_GRAD = ("To construct DTensor from torch.Tensor, it's recommended to use local_tensor.detach() "
                      "and make requires_grad consistent.")  # torch's warning, word for word


class DTensor(torch.Tensor):
    """A tensor distributed over a :class:`DeviceMesh` (API of ``torch.distributed.tensor.DTensor``)."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    __slots__ = ("_local_tensor", "_spec")
    # The op whose result this DTensor is when mpidtensor computed a view op on a copy (set per
    # instance by ``dispatch.writeback``); the class default lets dispatch read it as an attribute.
    _not_a_view_of = None

    @staticmethod
    def __new__(
        cls,
        local_tensor: torch.Tensor,
        spec: DTensorSpec | DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        requires_grad: bool = False,
        device_mesh: DeviceMesh | None = None,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> "DTensor":
        """``DTensor(local, spec, requires_grad=...)`` wraps ``local`` as it is (internal);
        ``spec`` may be torch's ``DTensorSpec(mesh, placements, tensor_meta=...)`` over
        mpidtensor's mesh and placements, as torch's tests build it.

        ``DTensor(local_tensor, device_mesh=..., placements=...)``, or with the mesh and
        placements positionally, is :meth:`from_local` (``requires_grad=True`` then makes
        the result a leaf that requires grad).
        """
        if spec.__class__ is not DTensorSpec and hasattr(spec, "tensor_meta"):  # torch's DTensorSpec
            if local_tensor.requires_grad and not requires_grad:
                warnings.warn(_INCONSISTENT_GRAD, UserWarning, stacklevel=2)
            spec = from_torch_spec(spec)
        if spec.__class__ is not DTensorSpec:
            if spec is not None and device_mesh is not None:
                raise TypeError("DTensor(): device_mesh given both positionally and by keyword")
            out = DTensor.from_local(local_tensor, device_mesh if spec is None else spec, placements,
                                     run_check=run_check, shape=shape, stride=stride)
            return out.requires_grad_() if requires_grad else out
        # ``local_tensor`` wrapped as it is: the hot path of dispatch, redistribute and the local
        # paths, inline (a helper function here was a Python call per DTensor made)
        r = _make_wrapper(cls, spec.shape, strides=spec.stride, dtype=spec.dtype, device=local_tensor.device,
                          layout=local_tensor.layout)
        r._local_tensor = local_tensor
        r._spec = spec
        return r.requires_grad_() if requires_grad else r

    __torch_function__ = torch._C._disabled_torch_function_impl
    # __torch_dispatch__: set by mpidtensor.dispatch (which imports this module)

    def __repr__(self) -> str:
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    def __reduce_ex__(self, protocol: int):
        """Pickled as its local tensor and spec; unpickled on the live mesh (:mod:`.pickling`)."""
        return pickling.reduce_dtensor(self)

    def __setstate__(self, state) -> None:
        """Finishes a DTensor unpickled from torch's format (:func:`.torch_format.set_state`)."""
        torch_format.set_state(self, state)

    def __tensor_flatten__(self):
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner_tensors, spec, outer_size, outer_stride):
        local = inner_tensors["_local_tensor"]
        return DTensor(local, spec, requires_grad=local.requires_grad)

    def __coerce_tangent_metadata__(self) -> "DTensor":
        """A compiled backward's incoming gradient: Partial is settled, as eager's would be."""
        if not any(p.is_partial() for p in self._spec.placements):
            return self
        return redistribute_dtensor(self, self._spec.with_placements(_settled(self._spec.placements)))

    def __coerce_same_metadata_as_tangent__(self, spec: DTensorSpec, expected_type=None) -> "DTensor | None":
        """This gradient moved to the placements the compiled backward was traced for."""
        if expected_type is not None or spec.mesh is not self._spec.mesh or spec.shape != self._spec.shape:
            return None
        return redistribute_dtensor(self, self._spec.with_placements(spec.placements))

    # --- public API --------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: torch.Size | Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> "DTensor":
        """Wrap each rank's ``local_tensor`` as the shard it holds of one global tensor.

        ``shape`` and ``stride`` are given together or not at all (torch's
        ``RuntimeError`` otherwise). Without them, a sharded global shape is found by
        gathering the local shapes (one small collective) and checked against the
        ``torch.chunk`` layout, and the global strides follow the local tensor's layout.
        ``run_check=True`` also checks that dtypes and unsharded sizes agree across
        ranks and that replicas hold equal values. Differentiable. On a rank outside a
        sub-mesh (``get_coordinate() is None``) nothing is checked or exchanged: the local
        tensor is empty and the global shape is the local one times the sharding mesh
        dims' sizes, as torch's.

        Every error is raised on every rank, except one no rank can see without
        communicating: with ``shape=`` and no ``run_check``, a rank whose local tensor
        is not the shard the layout gives it raises a ValueError alone; the other ranks
        end at their next collective through the abort hook (``MPIDTENSOR_ABORT_ON_EXCEPTION``).
        """
        key = None
        if not run_check and isinstance(placements, (list, tuple)) and (
                isinstance(shape, (list, tuple)) or shape is None and stride is None):
            # Without ``shape``, only placements that shard nothing are cached (below): their
            # global shape is the local one, which the cache hit checks; a sharded one is
            # gathered from every rank each time.
            key = (id(device_mesh), tuple(placements), None if shape is None else tuple(shape),
                   None if stride is None else tuple(stride), local_tensor.dtype)
            known = _FROM_LOCAL.get(key)
            if known is not None and local_tensor.shape == known[1] and local_tensor.stride() == known[2]:
                # a cache hit: checked before
                if torch.is_grad_enabled() and local_tensor.requires_grad:
                    return _from_local_apply(local_tensor, known[0])
                return DTensor(local_tensor, known[0])
        if (shape is None) != (stride is None):  # torch's error, word for word
            raise RuntimeError(f"Found shape:{shape}, stride:{stride}.",
                               "Please pass both shape and stride at the same time.")
        device_mesh = require_mesh(device_mesh, "DTensor.from_local")
        refuse_torch_dtensor(local_tensor, "DTensor.from_local")
        placements = [Replicate()] * device_mesh.ndim if placements is None else placements
        if device_mesh._coord is None:
            return _from_local_outside(local_tensor, device_mesh, placements, shape, stride)
        if run_check:
            validate.check_local_tensors(local_tensor, device_mesh, placements, shape)
        if shape is None:
            shape = validate.global_shape_from_locals(local_tensor, device_mesh, placements)
        shape = torch.Size(shape)
        # Shard(-1) means the same dim on every rank: the global rank decides, never a local one.
        placements = normalize_placements(placements, device_mesh.ndim, len(shape))
        if stride is None:  # the global tensor laid out as the local one (as torch infers it)
            stride = global_strides(shape, local_tensor)
        spec = DTensorSpec(device_mesh, placements, shape, tuple(stride), local_tensor.dtype)
        validate.check_local_shape(local_tensor, spec)
        if key is not None and (key[2] is not None or all(shard_dim(p) is None for p in placements)):
            _FROM_LOCAL[key] = (spec, local_tensor.shape, local_tensor.stride())
        return _from_local_apply(local_tensor, spec)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's local tensor. In backward, the gradient is taken to have
        ``grad_placements`` (default: this DTensor's placements)."""
        if not (self.requires_grad and torch.is_grad_enabled()):  # nothing to differentiate
            return self._local_tensor
        if grad_placements is not None:
            grad_placements = normalize_placements(grad_placements, self._spec.mesh.ndim, self.ndim)
        return _to_local_apply(self, grad_placements)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> "DTensor":
        """This DTensor with ``placements`` on the same mesh, moving the least data needed.

        Redistributing *into* ``Partial`` from another placement is refused with torch's
        ``RuntimeError``: it is internal (gradients).
        ``forward_dtype``: the data moves (and the result is) in that dtype; ``backward_dtype``:
        the gradient moves in that dtype and comes back in this DTensor's (torch's options for
        moving less). ``async_op=True``: the result's local tensor is an
        ``AsyncCollectiveTensor`` as torch's is (mpidtensor's collective has completed, so
        waiting on it costs nothing)."""
        if forward_dtype is not None or backward_dtype is not None or async_op:
            return _redistribute_with_options(self, self._target_spec(device_mesh, placements), async_op,
                                              forward_dtype, backward_dtype)
        spec = self._spec
        cacheable = isinstance(placements, (list, tuple)) and (device_mesh is None or device_mesh is spec.mesh)
        if cacheable:
            target = _TARGETS.get((spec, *placements))
            if target is not None:  # a cache hit: validated before
                return redistribute_dtensor(self, target, same_ok=True)
        target = self._target_spec(device_mesh, placements)
        if cacheable:
            _TARGETS[(spec, *placements)] = target
        return redistribute_dtensor(self, target, same_ok=True)

    def _target_spec(self, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None) -> DTensorSpec:
        """The spec :meth:`redistribute` moves to; a ValueError for a bad target."""
        mesh = self._spec.mesh if device_mesh is None else device_mesh
        self._spec.mesh._require_live()
        if mesh != self._spec.mesh:
            raise ValueError(
                f"redistribute to another mesh is not supported: {self._spec.mesh} -> {mesh}"
            )
        if placements is None:
            raise RuntimeError("placements is needed for redistribute!")  # torch's error
        placements = normalize_placements(placements, mesh.ndim, self.ndim)
        for current, target in zip(self._spec.placements, placements):
            if isinstance(target, Partial) and target != current:  # torch's error, word for word
                raise RuntimeError(f"Can not redistribute from {current} to {target}, "
                                   "redistributing to Partial is for internal use only!")
        return self._spec.with_placements(placements)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (an all-gather/all-reduce)."""
        return redistribute_dtensor(self, _replicated(self._spec), same_ok=True).to_local(
            grad_placements=grad_placements)


def to_dtensor(
    self: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = False,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
) -> DTensor:
    """``tensor.to_dtensor(device_mesh=..., placements=...)``: this rank's tensor as its
    shard of a DTensor, i.e. :meth:`DTensor.from_local` (installed on ``torch.Tensor``)."""
    if isinstance(self, DTensor):
        raise TypeError("to_dtensor: the tensor is a DTensor already; use .redistribute() to change placements")
    return DTensor.from_local(self, device_mesh, placements, run_check=run_check, shape=shape, stride=stride)


def _from_local_outside(local: torch.Tensor, mesh: DeviceMesh, placements, shape, stride) -> DTensor:
    """``from_local`` on a rank outside ``mesh`` (a sub-mesh), as torch's: no check, no
    collective, an empty local tensor; the global shape (unless given) is the local one with
    each sharded dim times its mesh dims' sizes, as torch infers it without communicating."""
    if shape is None:
        shape = list(local.shape)
        for m, p in enumerate(normalize_placements(placements, mesh.ndim, local.ndim)):
            if shard_dim(p) is not None:
                shape[p.dim] *= mesh.shape[m]
    shape = torch.Size(shape)
    placements = normalize_placements(placements, mesh.ndim, len(shape))
    stride = global_strides(shape, local) if stride is None else tuple(stride)
    spec = DTensorSpec(mesh, placements, shape, stride, local.dtype)
    return _from_local_apply(local.new_empty(0, requires_grad=local.requires_grad), spec)


def _settled(placements) -> list[Placement]:
    """``placements`` with every Partial replaced by Replicate."""
    return [Replicate() if p.is_partial() else p for p in placements]


# Cache-hit paths of the public entry points: every key is checked once, on its first use
# (a freed mesh's specs miss them all: freeing a mesh clears them).
_TARGETS: dict[tuple, DTensorSpec] = caches.cache("dtensor.redistribute_targets", 4096)  # (spec, *placements)
_REPLICATED: dict[DTensorSpec, DTensorSpec] = caches.cache("dtensor.replicated", 4096)  # spec -> all-Replicate
_FROM_LOCAL: dict[tuple, tuple] = caches.cache("dtensor.from_local", 4096)  # from_local(shape=...), or of placements sharding nothing -> (spec, local shape, local stride)
# The gradient specs of the autograd Functions below, by (Function, forward spec, what else decides
# it): a gradient's spec follows from these alone, so each step's backward looks it up once.
_GRAD_SPECS: dict[tuple, DTensorSpec] = caches.cache("dtensor.grad_specs", 4096)


def _replicated(spec: DTensorSpec) -> DTensorSpec:
    """``spec`` with every placement Replicate (cached per spec)."""
    target = _REPLICATED.get(spec)
    if target is None:
        spec.mesh._require_live()
        target = _REPLICATED[spec] = spec.with_placements([Replicate()] * spec.mesh.ndim)
    return target


def redistribute_dtensor(x: DTensor, spec: DTensorSpec, *, same_ok: bool = False) -> DTensor:
    """``x`` moved to ``spec``'s placements (any, Partial included); differentiable.

    ``x`` itself when already there, unless ``same_ok`` (the public API returns a new
    DTensor). Without autograd to record, the step plan runs without an autograd Function."""
    if x._spec is spec and not same_ok:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _redistribute_apply(x, spec)
    return DTensor(redistribute_local(x._local_tensor, x._spec, spec), spec)


def _redistribute_with_options(x: DTensor, target: DTensorSpec, async_op: bool, forward_dtype: torch.dtype | None,
                               backward_dtype: torch.dtype | None) -> DTensor:
    """:meth:`DTensor.redistribute` with torch's dtype options and ``async_op``."""
    if forward_dtype is not None and forward_dtype != x.dtype:
        x = x.to(forward_dtype)  # differentiable: the gradient comes back in the input's dtype
        target = DTensorSpec(target.mesh, target.placements, target.shape, target.stride, forward_dtype)
    if backward_dtype is not None and x.requires_grad and torch.is_grad_enabled():
        out = _redistribute_apply(x, target, backward_dtype)
    else:
        out = redistribute_dtensor(x, target, same_ok=True)
    if async_op and out._local_tensor is not x._local_tensor:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        out._local_tensor = AsyncCollectiveTensor(out._local_tensor)
    return out


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _wrap(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """``DTensor(local, spec, requires_grad=...)`` for the autograd Functions below: the
    wrapper made directly (``DTensor.__new__`` first tells its public forms apart)."""
    out = _make_wrapper(DTensor, spec.shape, strides=spec.stride, dtype=spec.dtype, device=local.device,
                        layout=local.layout)
    out._local_tensor, out._spec = local, spec
    return out.requires_grad_() if requires_grad else out


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec) -> DTensor:
        ctx.spec = spec
        return _wrap(local.view_as(local), spec, local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec = ctx.spec
        if not isinstance(grad, DTensor):
            return grad, None
        # The local gradient has the forward's layout, a Partial one settled to Replicate even
        # when the gradient arrives as that Partial (as torch 2.13): a local term of a Partial
        # sum has the whole gradient as its gradient; one rank's term of it would be wrong.
        key = (_FromLocal, spec, grad._spec)
        try:
            target = _GRAD_SPECS[key]  # a subscript, not ``get``: every backward but the first hits
        except KeyError:
            target = _GRAD_SPECS[key] = grad._spec.with_placements(_settled(spec.placements))
        if target is grad._spec:
            return grad._local_tensor, None
        if grad.requires_grad and torch.is_grad_enabled():  # a double backward records the move
            return redistribute_dtensor(grad, target)._local_tensor, None
        return redistribute_local(grad._local_tensor, grad._spec, target), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, grad_placements) -> torch.Tensor:
        ctx.spec = x._spec
        ctx.grad_placements = grad_placements
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        if grad.__class__ is torch.Tensor and grad.is_contiguous():  # the common case: a spec per forward spec
            key = (_ToLocal, spec, ctx.grad_placements, grad.dtype)
            try:
                grad_spec = _GRAD_SPECS[key]
            except KeyError:
                grad_spec = _GRAD_SPECS[key] = _to_local_grad_spec(spec, ctx.grad_placements, grad)
            return _wrap(grad, grad_spec, False), None
        if isinstance(grad, DTensor):
            # The local tensor met DTensors in an op, which took it as Replicate: its gradient
            # is that DTensor gradient's whole value (reduced where Partial; a collective decided
            # by the gradient's spec, which every rank shares), not a DTensor nested in one.
            target = _replicated(grad._spec)
            if grad.requires_grad and torch.is_grad_enabled():  # a double backward records the move
                grad = redistribute_dtensor(grad, target, same_ok=True).to_local()
            else:
                grad = redistribute_local(grad._local_tensor, grad._spec, target)
        # Autograd may hand a transposed gradient: the global strides follow it. An expanded
        # one (a sum's backward) is made whole first, as a leaf's ``.grad`` would be copied
        # anyway (AccumulateGrad's layout contract) and an in-place update needs it whole.
        if not grad.is_contiguous() and not is_non_overlapping_and_dense_or_false(grad):
            grad = grad.contiguous()
        return DTensor(grad, _to_local_grad_spec(spec, ctx.grad_placements, grad), requires_grad=False), None


def _to_local_grad_spec(spec: DTensorSpec, grad_placements, grad: torch.Tensor) -> DTensorSpec:
    """The spec of ``to_local``'s gradient ``grad``: ``grad_placements``, by default the
    forward's with a Partial's local term's gradient the whole gradient, Replicate (as torch
    2.13; from_local's backward hands it so); the global strides laid out as ``grad``."""
    placements = grad_placements or _settled(spec.placements)
    return DTensorSpec(spec.mesh, placements, spec.shape, global_strides(spec.shape, grad), grad.dtype)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, spec: DTensorSpec, backward_dtype: torch.dtype | None = None) -> DTensor:
        ctx.src = x._spec
        ctx.target = spec  # interned: the backward's key hashes it in C (placements hash in Python)
        ctx.backward_dtype = backward_dtype
        return _wrap(redistribute_local(x._local_tensor, x._spec, spec), spec, x.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        src = ctx.src
        local, spec = grad._local_tensor, grad._spec
        moved = ctx.backward_dtype
        if moved is None and spec.dtype is src.dtype:  # the common case: the spec looked up, the result wrapped inline
            key = (_Redistribute, src, spec, ctx.target)
            try:
                out_spec = _GRAD_SPECS[key]
            except KeyError:
                placements = _backward_placements(src, spec, ctx.target.placements)
                out_spec = _GRAD_SPECS[key] = spec.with_placements(placements)
            if out_spec is spec:  # the gradient stays where it is (a Partial -> Replicate's Replicate gradient):
                # a new wrapper of the same local tensor, not ``grad`` itself, which AccumulateGrad could not
                # steal (it would copy it, through a collective for a Partial gradient: torch's runs none)
                return _wrap(local, spec, False), None, None
            return _wrap(redistribute_local(local, spec, out_spec), out_spec, False), None, None
        target = _backward_placements(src, spec, ctx.target.placements)
        if moved is not None and moved != spec.dtype:  # the gradient moves in backward_dtype
            local = local.to(moved)
            spec = DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, moved)
        out_spec = spec.with_placements(target)
        local = redistribute_local(local, spec, out_spec)
        if local.dtype != src.dtype:
            local = local.to(src.dtype)
            out_spec = DTensorSpec(out_spec.mesh, out_spec.placements, out_spec.shape, out_spec.stride, src.dtype)
        return DTensor(local, out_spec, requires_grad=False), None, None


# The Functions' ``apply`` without ``Function.apply``'s Python layer (:func:`direct_apply`): each
# runs in every program that converts a tensor. ``_FromLocal`` runs only inside ``from_local``,
# a graph break under torch.compile, so it is never traced.
_from_local_apply = direct_apply(_FromLocal, compiling_checked=True)
_to_local_apply = direct_apply(_ToLocal)
_redistribute_apply = direct_apply(_Redistribute)


def _backward_placements(src: DTensorSpec, grad: DTensorSpec, target: tuple) -> list[Placement]:
    """Where redistribute's gradient goes: a Partial input whose gradient arrives as the same
    Partial keeps it (no collective, as torch's) where the forward kept it too (Partial to the
    same Partial); any other Partial input's gradient is settled to Replicate: after a Partial
    -> Replicate the producer's backward (a contraction over a sharded dim) needs it whole,
    once for all its matrix products (torchtitan's TP step: 19 collectives a step where
    keeping it Partial took 25); other placements are the input's own."""
    return [p if p.is_partial() and g == p == f else Replicate() if p.is_partial() else p
            for p, g, f in zip(src.placements, grad.placements, target)]

from ..runtime import dynamo_hook as traceable  # noqa: E402  (collectives torch.compile can trace)


def _graph_breaks() -> None:
    """The entry points that communicate outside dispatch run eagerly under torch.compile:
    Dynamo stops its graph before them and resumes after (a graph break)."""
    for name in ("from_local", "redistribute", "full_tensor"):
        attr = DTensor.__dict__[name]
        if isinstance(attr, staticmethod):
            setattr(DTensor, name, staticmethod(torch.compiler.disable(attr.__func__)))
        else:
            setattr(DTensor, name, torch.compiler.disable(attr))


@effect("graph breaks under torch.compile", "first mesh",
        "sys.meta_path: a finder that marks DTensor.from_local/redistribute/full_tensor as graph "
        "breaks once torch.compile imports torch._dynamo, then removes itself (at once if loaded)")
def _install_graph_breaks() -> None:
    traceable.when_dynamo_loads(_graph_breaks)


@effect("Tensor.to_dtensor", "first mesh",
        "torch.Tensor.to_dtensor(device_mesh, placements): DTensor.from_local as a tensor method")
def _install_to_dtensor() -> None:
    torch.Tensor.to_dtensor = to_dtensor


@effect("safe globals for torch.load", "first mesh",
        "torch.serialization.add_safe_globals: DTensor, DeviceMesh, the spec, the placements and their "
        "rebuild functions, so torch.load(weights_only=True) loads DTensors (torch registers its own alike)")
def _install_safe_globals() -> None:
    torch.serialization.add_safe_globals(pickling.safe_globals(DTensor))
