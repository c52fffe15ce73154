"""The zero-bubble split of one backward into ``I`` and ``W`` over one walk of its graph.

``I`` computes the gradients of a stage's inputs; ``W``, later, those of its parameters.
Every node of the backward graph that leads to an input runs in ``I`` (the *input
side*). A node of the input side whose other edges lead to parameters (a matrix product:
one edge to its input, one to its weight) is an *intermediate*: ``I`` runs it computing
only its input-side gradients (autograd computes only the outputs an edge needs) and
keeps the gradient it received (the same autograd call returns it: the node's output
edges are among the call's targets, which costs no Python hook). ``W`` runs each
intermediate again from that gradient, this time computing only the edges into the
weight side (the nodes that lead to parameters and not to inputs), then the weight side
itself. No node's work is done twice: for a stack of Linear layers ``I`` does the input
products and ``W`` the weight products, a whole backward between them.

When weight-side subgraphs of different intermediates overlap (a parameter used at two
depths of the stage), re-running the deeper intermediate would reach into the other's
input side: ``W`` then stops at the first weight-side edges (one autograd call per
intermediate) and accumulates the parameters' gradients from all of them in one more
call. When an edge into the weight side is itself reachable from another such edge, no
target can exclude the input side and ``W`` runs the whole backward again over the
retained graph, restricted to the parameters (correct; the old cost).

Which nodes are intermediates, and which parameters each one's ``W`` call reaches, depend
only on the graph's structure. A stage builds the same graph for every micro-batch, so a
:class:`Splitter` (one per stage) keeps that plan per *graph shape*: the walk that finds
the nodes also writes the shape down (each node's type and the walk positions of its
children, with the positions of roots, inputs and parameters), and a shape met before
reuses its plan; only the walk and the autograd calls run per micro-batch. A
plan holds positions, never nodes, so it keeps no graph alive. (On the benchmark's stage
of two Linear layers the analysis of a graph took ~120 us and the walk alone ~10 us.)

The graph is retained between ``I`` and ``W`` (``W`` needs the intermediates' saved
tensors) and released once ``W`` has run: :class:`WeightPass` drops every reference.
``I``'s and ``W``'s calls go straight to autograd's engine (``_engine_run_backward``, what
``torch.autograd.backward`` and ``grad`` end in) where every root has its gradient (the
stage checked their shapes): the argument handling they skip cost 10-25 us per call.
"""
from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, _engine_run_backward, get_gradient_edge

__all__ = ["Splitter", "WeightPass", "backward_input"]

_WHOLE, _OWN, _SHARED = "whole", "own", "shared"  # how W runs (module docstring, in order)
_edge = tuple.__new__  # _edge(GradientEdge, (node, nr)): the named tuple without its Python-level __new__
_child, _input_nr = itemgetter(0), itemgetter(1)  # of an edge in Node.next_functions


class WeightPass:
    """The ``W`` of one micro-batch: call it once. ``calls`` are the autograd calls to make,
    each ``(outputs, grads, targets, accumulate)``: with ``accumulate`` a backward into the
    targets' ``.grad``, else a gradient computation whose results (the gradients at the
    weight side's first edges) feed the final accumulating call ``final``."""

    def __init__(self, calls: list[tuple[list, list | None, list, bool]], final: tuple[list, list] | None,
                 params: list[torch.Tensor]) -> None:
        self.calls, self.final, self.params = calls, final, params

    def __call__(self) -> None:
        calls, final, params = self.calls, self.final, self.params
        self.calls, self.final, self.params = [], None, []  # the graph goes with the last reference
        roots, grads = final if final is not None else ([], [])
        roots, grads = list(roots), list(grads)
        for outputs, out_grads, targets, accumulate in calls:
            if accumulate:
                if out_grads is None:  # a scalar loss: autograd makes its gradient
                    torch.autograd.backward(outputs, out_grads, inputs=targets)
                else:
                    _engine_run_backward(tuple(outputs), tuple(out_grads), False, False, tuple(targets), True, True)
                continue
            got = _engine_run_backward(tuple(outputs), tuple(out_grads), False, False, tuple(targets), True, False)
            for edge, g in zip(targets, got):
                if g is not None:
                    roots.append(edge)
                    grads.append(g)
        if roots:
            torch.autograd.backward(roots, grads, inputs=params)


class _Plan(NamedTuple):
    """How ``W`` runs for one graph shape, in walk positions: ``entries`` are the
    intermediates as ``(node, first weight-side edges as (child, input_nr), parameters
    whose gradients its call accumulates, the node's outputs that receive a gradient)``;
    ``given`` the roots that lead to parameters and not to inputs, as ``(root, parameters)``."""

    mode: str
    entries: tuple[tuple[int, tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...]], ...]
    given: tuple[tuple[int, tuple[int, ...]], ...]


class _Graph(NamedTuple):
    """One walk of a backward graph: its nodes by position, and its shape (the plan's key)."""

    nodes: list[Node]
    shape: tuple


def _walk(roots: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]) -> _Graph:
    """Every node reachable from ``roots``, in discovery order, and the graph's shape: each
    node's type and its children's positions (``-1`` for none) with their input numbers,
    then where each root, input and parameter sits (position, output number; ``-1`` when
    unreachable). A leaf is found by its ``AccumulateGrad`` node's ``variable``: asking
    autograd for a leaf's edge makes a view, ~20 us each under load."""
    nodes: list[Node] = []
    index: dict[Node, int] = {}
    root_places = []
    for r in roots:
        node, nr = (r.grad_fn, r.output_nr) if r.grad_fn is not None else get_gradient_edge(r)
        at = index.get(node)
        if at is None:
            at = index[node] = len(nodes)
            nodes.append(node)
        root_places.append((at, nr))
    index[None] = -1  # a missing child's position
    position = index.__getitem__
    found = len(nodes)  # nodes discovered so far
    shape = []
    leaves: dict[int, tuple[int, torch.Tensor]] = {}  # id of a leaf -> (position of its AccumulateGrad, the leaf)
    for i, node in enumerate(nodes):  # the list grows as the walk discovers nodes
        edges = node.next_functions
        for child, _ in edges:
            if child not in index:
                index[child] = found
                found += 1
                nodes.append(child)
        if edges:  # the children's positions and input numbers, mapped in C (no bytecode per child)
            shape.append((type(node), tuple(zip(map(position, map(_child, edges)), map(_input_nr, edges)))))
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves[id(variable)] = (i, variable)
        shape.append((type(node), ()))
    places = [tuple(root_places)]
    for tensors in (inputs, params):  # where each sits (a leaf by its AccumulateGrad: see above)
        at = []
        for t in tensors:
            if t.grad_fn is not None:
                at.append((index.get(t.grad_fn, -1), t.output_nr))
                continue
            leaf = leaves.get(id(t))
            if leaf is not None and leaf[1] is t:
                at.append((leaf[0], 0))
            else:  # not reached (unused), or a leaf seen under another Python object
                at.append((index.get(get_gradient_edge(t).node, -1), 0))
        places.append(tuple(at))
    return _Graph(nodes, (tuple(shape), tuple(places)))


def _ancestors(starts: Sequence[int], parents: list[list[int]]) -> set[int]:
    """``starts`` (reached positions) and every position with a path to one of them."""
    found = {s for s in starts if s >= 0}
    stack = list(found)
    while stack:
        for p in parents[stack.pop()]:
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def _analyse(shape: tuple) -> _Plan:
    """The plan of ``W`` for a graph of ``shape`` (see the module's docstring)."""
    structure, (root_places, input_places, param_places) = shape
    parents: list[list[int]] = [[] for _ in structure]
    for i, (_, kids) in enumerate(structure):
        for child, _ in kids:
            if child >= 0:
                parents[child].append(i)
    input_side = _ancestors([at for at, _ in input_places], parents)
    weight_bound = _ancestors([at for at, _ in param_places], parents)
    # the first weight-side edges below each intermediate, in the walk's order: the same on
    # every rank, so ranks whose weight sides communicate (tensor parallel) run W's calls
    # in the same order
    entries = []
    for i, (_, kids) in enumerate(structure):
        if i in input_side and i in weight_bound:
            below = tuple((c, nr) for c, nr in kids if c >= 0 and c not in input_side and c in weight_bound)
            if below:
                entries.append((i, below))
    fed: dict[int, set[int]] = {i: set() for i, _ in entries}  # each intermediate's outputs that edges reach
    for at, nr in [*root_places, *(kid for _, kids in structure for kid in kids)]:
        if at in fed:
            fed[at].add(nr)
    given = [k for k, (at, _) in enumerate(root_places) if at not in input_side and at in weight_bound]
    owner: dict[int, int] = {}  # weight-side position -> the one start (intermediate or root) reaching it
    shared = overlapping = False
    starts = [(i, [c for c, _ in below]) for i, below in entries] + [(root_places[k][0], [root_places[k][0]])
                                                                     for k in given]
    entry_nodes = [c for _, below in entries for c, _ in below]
    for start, firsts in starts:
        stack, mine = list(firsts), set(firsts)
        while stack:
            node = stack.pop()
            if owner.setdefault(node, start) != start:
                shared = True
            for child, _ in structure[node][1]:
                if child >= 0 and child not in mine:
                    mine.add(child)
                    stack.append(child)
        if any(n in mine for n in entry_nodes if n not in firsts):
            overlapping = True
    if overlapping or len(set(entry_nodes)) != len(entry_nodes):
        return _Plan(_WHOLE, (), ())
    owned: dict[int, list[int]] = {}
    for j, (at, _) in enumerate(param_places):
        if at in owner:
            owned.setdefault(owner[at], []).append(j)
    return _Plan(_SHARED if shared else _OWN,
                 tuple((i, below, tuple(owned.get(i, ())), tuple(sorted(fed[i]))) for i, below in entries),
                 tuple((k, tuple(owned.get(root_places[k][0], ()))) for k in given))


class Splitter:
    """Splits the backwards of one stage (:meth:`backward_input`), keeping the plan of each
    graph shape it met; ``capacity`` shapes at most (the oldest is forgotten first).
    ``analyses`` counts the plans it made."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.analyses = 0
        self._plans: dict[tuple, _Plan] = {}

    def _plan(self, shape: tuple) -> _Plan:
        plan = self._plans.get(shape)
        if plan is None:
            plan = _analyse(shape)
            self.analyses += 1
            if self.capacity > 0:
                if len(self._plans) >= self.capacity:
                    del self._plans[next(iter(self._plans))]
                self._plans[shape] = plan
        return plan

    def backward_input(self, roots: list[torch.Tensor], root_grads: list[torch.Tensor] | None,
                       inputs: list[torch.Tensor], params: list[torch.Tensor]
                       ) -> tuple[list[torch.Tensor | None], WeightPass]:
        """``I``: the gradients of ``inputs`` (``None`` where unused) from ``roots`` (with
        ``root_grads``, ``None`` for a scalar loss), and the ``W`` that later accumulates
        the gradients of ``params`` into their ``.grad`` (:class:`WeightPass`)."""
        if not roots:
            return [None] * len(inputs), WeightPass([], None, [])
        if not inputs:  # the first stage: the whole backward is W's
            return [], WeightPass([(roots, root_grads, params, True)] if params else [], None, [])
        if not params:
            return list(torch.autograd.grad(roots, inputs, root_grads, allow_unused=True)), WeightPass([], None, [])
        if root_grads is None and len(roots) == 1 and roots[0].numel() == 1 and roots[0].dtype.is_floating_point:
            # a scalar loss: its gradient as autograd makes it, so that the calls below go
            # straight to the engine (autograd.grad's argument handling cost ~25 Python calls)
            root_grads = [torch.ones_like(roots[0], memory_format=torch.preserve_format)]
        graph = _walk(roots, inputs, params)
        plan = self._plan(graph.shape)
        if plan.mode == _WHOLE:  # W as a whole backward over the retained graph, restricted to the parameters
            got = torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
            return list(got), WeightPass([(roots, root_grads, params, True)], None, [])
        nodes = graph.nodes
        # the gradients the intermediates receive, returned by I's call with the inputs'
        # (autograd captures them as the node runs: no hook; tensor hooks on an
        # intermediate's output then apply once, in W, which runs the node)
        targets = (*inputs, *[_edge(GradientEdge, (nodes[i], k)) for i, _, _, outs in plan.entries for k in outs])
        if root_grads is None or any([g is None for g in root_grads]):  # autograd makes a scalar's gradient
            got = torch.autograd.grad(roots, targets, root_grads, retain_graph=True, allow_unused=True)
        else:
            got = _engine_run_backward(tuple(roots), tuple(root_grads), True, False, targets, True, False)
        n = len(inputs)
        return list(got[:n]), _weight_pass(plan, nodes, got[n:], roots, root_grads, params)


def backward_input(roots: list[torch.Tensor], root_grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightPass]:
    """:meth:`Splitter.backward_input` with no plan kept (a one-off split)."""
    return Splitter(capacity=0).backward_input(roots, root_grads, inputs, params)


def _weight_pass(plan: _Plan, nodes: list[Node], captured: Sequence[torch.Tensor | None], roots: list,
                 root_grads: list | None, params: list[torch.Tensor]) -> WeightPass:
    """The autograd calls of ``W`` for this micro-batch's graph, following ``plan``;
    ``captured``: the gradient each intermediate's outputs received in ``I``, in the
    plan's order (``None`` where none came)."""
    calls = []
    at = 0
    for i, below, mine, fed in plan.entries:
        outputs, out_grads = [], []
        for k in fed:
            g = captured[at]
            at += 1
            if g is not None:
                outputs.append(_edge(GradientEdge, (nodes[i], k)))
                out_grads.append(g)
        if not outputs:  # nothing reached it in I
            continue
        if plan.mode == _SHARED:
            calls.append((outputs, out_grads, [_edge(GradientEdge, (nodes[c], nr)) for c, nr in below], False))
        elif mine:
            calls.append((outputs, out_grads, [params[j] for j in mine], True))
    given_grads = root_grads or [None] * len(roots)
    if plan.mode == _OWN:
        for k, mine in plan.given:
            if mine:
                g = given_grads[k]
                calls.append(([roots[k]], None if g is None else [g], [params[j] for j in mine], True))
        return WeightPass(calls, None, [])
    final = ([roots[k] for k, _ in plan.given], [given_grads[k] for k, _ in plan.given])
    return WeightPass(calls, final, params)
