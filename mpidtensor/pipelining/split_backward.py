"""The zero-bubble split of one backward into ``I`` and ``W`` over one walk of its graph.

``I`` computes the gradients of a stage's inputs; ``W``, later, those of its parameters.
Every node of the backward graph that leads to an input runs in ``I`` (the *input
side*). A node of the input side whose other edges lead to parameters (a matrix product:
one edge to its input, one to its weight) is an *intermediate*: ``I`` runs it computing
only its input-side gradients (autograd computes only the outputs an edge needs) and
keeps the gradient it received (a hook before the node runs). ``W`` runs each
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

The graph is retained between ``I`` and ``W`` (``W`` needs the intermediates' saved
tensors) and released once ``W`` has run: :class:`WeightPass` drops every reference.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightPass", "backward_input"]

_Edges = list[GradientEdge]


class WeightPass:
    """The ``W`` of one micro-batch: call it once. ``calls`` are the autograd calls to make,
    each ``(outputs, grads, targets, accumulate)``: with ``accumulate`` a
    ``torch.autograd.backward`` into the parameters' ``.grad``, else a
    ``torch.autograd.grad`` whose results (the gradients at the weight side's first edges)
    feed the final accumulating call ``final``."""

    def __init__(self, calls: list[tuple[list, list, list, bool]], final: tuple[list, list] | None,
                 params: list[torch.Tensor]) -> None:
        self.calls, self.final, self.params = calls, final, params

    def __call__(self) -> None:
        calls, final, params = self.calls, self.final, self.params
        self.calls, self.final, self.params = [], None, []  # the graph goes with the last reference
        roots, grads = final if final is not None else ([], [])
        roots, grads = list(roots), list(grads)
        for outputs, out_grads, targets, accumulate in calls:
            if accumulate:
                torch.autograd.backward(outputs, out_grads, inputs=targets)
                continue
            got = torch.autograd.grad(outputs, targets, out_grads, allow_unused=True)
            for edge, g in zip(targets, got):
                if g is not None:
                    roots.append(edge)
                    grads.append(g)
        if roots:
            torch.autograd.backward(roots, grads, inputs=params)


def _edge(t: torch.Tensor) -> GradientEdge:
    return get_gradient_edge(t)


def _walk(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``roots`` and each one's parents (nodes with an edge to it)."""
    stack = list(dict.fromkeys(roots))
    parents: dict[Node, list[Node]] = {r: [] for r in stack}
    order: list[Node] = []
    seen = set(stack)
    while stack:
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return order, parents


def _ancestors(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node with a path to one of them."""
    found = {s for s in starts if s in parents}
    stack = list(found)
    while stack:
        for p in parents[stack.pop()]:
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def backward_input(roots: list[torch.Tensor], root_grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], Callable[[], None]]:
    """``I``: the gradients of ``inputs`` (``None`` where unused) from ``roots`` (with
    ``root_grads``, ``None`` for a scalar loss), and the ``W`` that later accumulates the
    gradients of ``params`` into their ``.grad`` (:class:`WeightPass`)."""
    if not roots:
        return [None] * len(inputs), WeightPass([], None, [])
    if not inputs:  # the first stage: the whole backward is W's
        return [], WeightPass([(roots, root_grads, params, True)] if params else [], None, [])
    if not params:
        return list(torch.autograd.grad(roots, inputs, root_grads, allow_unused=True)), WeightPass([], None, [])
    root_edges = [_edge(r) for r in roots]
    order, parents = _walk([e.node for e in root_edges])
    input_side = _ancestors([_edge(x).node for x in inputs], parents)
    weight_bound = _ancestors([_edge(p).node for p in params], parents)
    # the first weight-side edges below each intermediate, in the walk's order: the same on
    # every rank (a set's order is not), so ranks whose weight sides communicate (tensor
    # parallel) run W's calls in the same order
    entries: dict[Node, _Edges] = {}
    for node in order:
        if node not in input_side or node not in weight_bound:
            continue
        below = [GradientEdge(child, nr) for child, nr in node.next_functions
                 if child is not None and child not in input_side and child in weight_bound]
        if below:
            entries[node] = below
    # weight-only outputs (a root that leads to parameters and not to inputs) start W as given
    given = [(r, g) for r, e, g in zip(roots, root_edges, root_grads or [None] * len(roots))
             if e.node not in input_side and e.node in weight_bound]
    captured: dict[Node, tuple] = {}
    handles = [node.register_prehook(_keep(captured, node)) for node in entries]
    try:
        got = torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return list(got), _plan(entries, captured, given, roots, root_grads, params)


def _keep(captured: dict, node: Node) -> Callable[[tuple], None]:
    def hook(grad_outputs: tuple) -> None:
        captured[node] = grad_outputs
    return hook


def _plan(entries: dict[Node, _Edges], captured: dict[Node, tuple], given: list, roots: list,
          root_grads: list | None, params: list[torch.Tensor]) -> WeightPass:
    """The autograd calls of ``W`` (see the module's docstring for the three cases)."""
    owner: dict[Node, Node] = {}  # weight-side node -> the one start (intermediate or root) reaching it
    shared = overlapping = False
    starts = [(n, [e.node for e in below]) for n, below in entries.items()] + [(_edge(r).node, [_edge(r).node])
                                                                                for r, _ in given]
    entry_nodes = [e.node for below in entries.values() for e in below]
    for start, firsts in starts:
        stack, mine = list(firsts), set(firsts)
        while stack:
            node = stack.pop()
            if owner.setdefault(node, start) is not start:
                shared = True
            for child, _ in node.next_functions:
                if child is not None and child not in mine:
                    mine.add(child)
                    stack.append(child)
        if any(n in mine for n in entry_nodes if n not in firsts):
            overlapping = True
    if len(set(entry_nodes)) != len(entry_nodes):
        overlapping = True
    if overlapping:  # W as a whole backward over the retained graph, restricted to the parameters
        return WeightPass([(roots, root_grads, params, True)], None, [])
    calls = []
    for node, below in entries.items():
        grads = captured.get(node)
        if grads is None:  # did not run in I: nothing reached it
            continue
        outs = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
        if not outs:
            continue
        outputs, out_grads = [o for o, _ in outs], [g for _, g in outs]
        if shared:
            calls.append((outputs, out_grads, below, False))
        else:
            mine = [p for p in params if owner.get(_edge(p).node) is node]
            if mine:
                calls.append((outputs, out_grads, mine, True))
    if not shared:
        for r, g in given:
            mine = [p for p in params if owner.get(_edge(p).node) is _edge(r).node]
            if mine:
                calls.append(([r], None if g is None else [g], mine, True))
        return WeightPass(calls, None, [])
    final = ([r for r, _ in given], [g for _, g in given])
    return WeightPass(calls, final, params)
