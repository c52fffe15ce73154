"""The plan kinds: what a cached dispatch decision runs on each call.

- :class:`Plan`, the general one: unwrap (redistributing where the rule says so), run
  the local op, wrap the outputs (and write back in place).
- :class:`LocalPlan`, a fast path: a plan that moves nothing, run in one frame.
- :class:`LocalViewPlan`, a fast path: a view op on one DTensor that moves nothing, its
  local view computed by the rule's own function (``view``'s local size), in one frame.
- :class:`PerMeshPlan`, a fast path: a ``_foreach_*`` op over DTensors on several meshes,
  one call per mesh; its general form is one call per list position.

The fast paths are chosen by the planner from the rule's decision and registered in
:mod:`mpidtensor.fast.registry`; with ``settings.fast_paths`` off the planner makes
plain plans and per-position calls instead (changing the setting through
``settings.update``/``override`` drops every cached plan, so the choice is made at plan
time and costs nothing per call).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..tensor.dtensor import DTensor
from ..fast import registry
from .args import is_view_op, local_of, mutated_inputs, tensors

_make_wrapper = torch.Tensor._make_wrapper_subclass  # DTensor.__new__'s constructor, called inline below

__all__ = ["Plan", "LocalPlan", "LocalViewPlan", "PerMeshPlan", "per_mesh_groups", "LOCAL", "LOCAL_VIEW", "PER_MESH"]

LOCAL = registry.register(
    "dispatch.local_plan",
    shortcuts="the general Plan (unwrap, run, wrap: four frames) of an op whose inputs all stay where they "
              "are: pointwise and foreach ops on same-placed DTensors (an optimizer's), views that move nothing",
    decided_by="the op's sharding rule: every input's target placement is its own, no custom local "
               "function, outputs wrapped with the rule's specs (LocalPlan.make)")
LOCAL_VIEW = registry.register(
    "dispatch.local_view",
    shortcuts="the general Plan (unwrap, the rule's local function, view tagging, wrap) of a view op on one "
              "DTensor whose rule moves nothing but computes the local view itself (view/reshape's local size, "
              "squeeze, expand, slice, select)",
    decided_by="the op's sharding rule: its input's target placement is its own, a local function given, one "
               "output of the rule's spec (LocalViewPlan.make)")
PER_MESH = registry.register(
    "dispatch.per_mesh",
    shortcuts="one dispatch per list position of a _foreach_* op whose DTensors live on several meshes "
              "(FSDP x TP's parameters on the (dp, tp) mesh and on the dp mesh)",
    decided_by="the meshes of the DTensor arguments' specs; each mesh's group is then planned by the "
               "dispatcher as usual")


class Plan:
    """A cached decision for one op signature; calling it runs the op."""

    __slots__ = ("unwrap", "local", "wrap")

    def __init__(self, unwrap: Callable, local: Callable, wrap: Callable) -> None:
        self.unwrap, self.local, self.wrap = unwrap, local, wrap

    def __call__(self, args, kwargs):
        largs, lkwargs = self.unwrap(args, kwargs)
        return self.wrap(self.local(largs, lkwargs), args, kwargs)


class LocalPlan:
    """A plan that moves nothing: every DTensor argument (top level, or every tensor of a
    list) is passed as its local tensor, plain tensors and scalars as they are, and the
    output is ``self`` (in place, placements kept), ``None`` (``_foreach_*_``, fused
    optimizers), new DTensors of fixed specs, or (a view op) new DTensors of fixed specs
    unless an input is itself tagged as not a view (then the general wrap tags them too).
    The same local op as :class:`Plan`'s, in one frame instead of four: an optimizer steps
    every parameter through it."""

    __slots__ = ("op", "tensors", "lists", "finish", "specs", "fallback")

    def __init__(self, op, tensors: list[int], lists: list[int], finish: str, specs: list, fallback: Callable) -> None:
        self.op, self.tensors, self.lists, self.finish, self.specs = op, tensors, lists, finish, specs
        self.fallback = fallback  # the general wrap, for the cases the fast ones do not cover

    def __call__(self, args, kwargs):
        LOCAL.hits += 1
        a = list(args)
        for i in self.tensors:
            a[i] = a[i]._local_tensor
        for i in self.lists:
            a[i] = [x._local_tensor for x in a[i]]
        out = self.op(*a, **kwargs)
        finish = self.finish
        if finish == "self":
            dst = args[0]
            # None: a subclass that returns nothing from its in-place op (torchao NF4's copy_)
            if (out is dst._local_tensor or out is None) and dst._not_a_view_of is None:
                return dst
            return self.fallback(out, args, kwargs)
        if finish == "tensor":
            spec = self.specs[0]  # DTensor(out, spec) inline: a Python call fewer per op
            r = _make_wrapper(DTensor, spec.shape, strides=spec.stride, dtype=spec.dtype, device=out.device,
                              layout=out.layout)
            r._local_tensor, r._spec = out, spec
            return r
        if finish == "list":
            return type(out)(DTensor(t, spec, requires_grad=False) for t, spec in zip(out, self.specs))
        if finish == "view" or finish == "views":
            for i in self.tensors:
                if args[i]._not_a_view_of is not None:
                    return self.fallback(out, args, kwargs)
            if finish == "view":
                spec = self.specs[0]  # DTensor(out, spec) inline
                r = _make_wrapper(DTensor, spec.shape, strides=spec.stride, dtype=spec.dtype, device=out.device,
                                  layout=out.layout)
                r._local_tensor, r._spec = out, spec
                return r
            return type(out)(DTensor(t, spec, requires_grad=False) for t, spec in zip(out, self.specs))
        return out

    @classmethod
    def make(cls, func, args, kwargs, converters, out_meta, out_specs, sharding, wrap) -> "LocalPlan | None":
        """The plan of a call whose inputs all stay where they are, else None. ``wrap`` is
        the general plan's output wrap (tagging views), for the calls the fast finish
        does not cover."""
        if (sharding.local is not None or torch.Tag.inplace_view in func.tags
                or any(c not in (None, local_of) for c in converters)):
            return None
        if any(isinstance(t, DTensor) for t in tensors(kwargs)):
            return None
        found, lists = [], []
        for i, a in enumerate(args):
            if isinstance(a, DTensor):
                found.append(i)
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
                if not all(isinstance(x, DTensor) for x in a):
                    return None
                lists.append(i)
        written = mutated_inputs(func, args)
        many = isinstance(out_meta, list) and all(isinstance(m, torch.Tensor) for m in out_meta)
        if is_view_op(func):
            if lists or written or not (isinstance(out_meta, torch.Tensor) or many):
                return None
            finish = "view" if isinstance(out_meta, torch.Tensor) else "views"
        elif out_meta is None:
            finish = "none"
        elif (written == [("pos", 0)] and isinstance(out_meta, torch.Tensor) and 0 in found
              and out_specs[0] is args[0]._spec):  # in place, self keeps its spec
            finish = "self"
        elif written:
            return None
        elif isinstance(out_meta, torch.Tensor):
            finish = "tensor"
        elif many:
            finish = "list"
        else:
            return None
        return cls(func._op, found, lists, finish, out_specs, wrap)


class LocalViewPlan:
    """A view op on one DTensor (the first argument; the rest plain values) whose rule moves
    nothing but gives a local function (``view``: the size argument becomes this rank's local
    shape): the local function on the local tensor, wrapped with the rule's fixed spec, in one
    frame instead of the general Plan's four. An input tagged as not a view takes the general
    wrap (which tags the output too)."""

    __slots__ = ("local", "spec", "fallback")

    def __init__(self, local: Callable, spec, fallback: Callable) -> None:
        self.local, self.spec, self.fallback = local, spec, fallback

    def __call__(self, args, kwargs):
        LOCAL_VIEW.hits += 1
        x = args[0]
        out = self.local([x._local_tensor, *args[1:]], kwargs)
        if x._not_a_view_of is not None:
            return self.fallback(out, args, kwargs)
        spec = self.spec  # DTensor(out, spec) inline
        r = _make_wrapper(DTensor, spec.shape, strides=spec.stride, dtype=spec.dtype, device=out.device,
                          layout=out.layout)
        r._local_tensor, r._spec = out, spec
        return r

    @classmethod
    def make(cls, func, args, kwargs, converters, out_meta, out_specs, sharding, wrap) -> "LocalViewPlan | None":
        """The plan of a view op whose one DTensor input (first) stays where it is and whose
        rule computes the local view (``sharding.local``), one tensor out; else None."""
        if (sharding.local is None or not is_view_op(func) or torch.Tag.inplace_view in func.tags
                or not isinstance(out_meta, torch.Tensor) or len(converters) != 1
                or converters[0] not in (None, local_of) or not isinstance(args[0], DTensor)
                or tensors(args[1:]) or tensors(kwargs) or mutated_inputs(func, args)):
            return None
        return cls(sharding.local, out_specs[0], wrap)


class PerMeshPlan:
    """A ``_foreach_*`` op whose lists hold DTensors on several meshes (FSDP x TP's
    parameters: the (dp, tp) mesh and the dp mesh): one call per group of list positions,
    results put back in order. Each call dispatches (and caches) as usual. The fast form
    groups the positions by mesh (``counted``); the general form calls per position."""

    __slots__ = ("func", "groups", "length", "counted")

    def __init__(self, func, groups: list[list[int]], length: int, counted: bool) -> None:
        self.func, self.groups, self.length, self.counted = func, groups, length, counted

    def __call__(self, args, kwargs):
        if self.counted:
            PER_MESH.hits += 1
        results = [None] * self.length
        returned = None
        for positions in self.groups:
            out = self.func(*(self._pick(a, positions) for a in args),
                            **{k: self._pick(v, positions) for k, v in kwargs.items()})
            if isinstance(out, (list, tuple)):
                returned = type(out)
                for i, value in zip(positions, out):
                    results[i] = value
        return None if returned is None else returned(results)

    def _pick(self, arg, positions):
        """An argument cut to ``positions`` if it is a list as long as the op's tensor lists
        (tensors or scalars per position), else as it is."""
        if isinstance(arg, (list, tuple)) and len(arg) == self.length:
            return type(arg)(arg[i] for i in positions)
        return arg


def per_mesh_groups(func, args, kwargs, by_mesh: bool) -> tuple[list[list[int]], int] | None:
    """For a ``_foreach_*`` op whose list positions hold DTensors on more than one mesh:
    the positions grouped by mesh (first appearance order; ``by_mesh`` False: one group
    per position) and the list length; else None. Positions without a DTensor go with the
    first group, as a plain tensor goes with the DTensors of a one-mesh call."""
    if not func._schema.name.startswith("aten::_foreach_"):
        return None
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a
             and isinstance(a[0], torch.Tensor)]
    if not lists:
        return None
    length = len(lists[0])
    meshes: list = []
    groups: list[list[int]] = []
    plain: list[int] = []
    for i in range(length):
        mesh = next((lst[i]._spec.mesh for lst in lists if len(lst) == length and isinstance(lst[i], DTensor)), None)
        if mesh is None:
            plain.append(i)
            continue
        index = next((k for k, m in enumerate(meshes) if m is mesh or m == mesh), None)
        if index is None:
            meshes.append(mesh)
            groups.append([])
            index = len(groups) - 1
        groups[index].append(i)
    if len(meshes) < 2:
        return None
    if not by_mesh:
        groups = [[i] for i in sorted(i for group in groups for i in group)]
    if plain:
        groups[0] = sorted(groups[0] + plain)
    return groups, length
