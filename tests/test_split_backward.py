"""The zero-bubble split (``pipelining.split_backward``) against one whole backward: on each
stage module, ``I`` then ``W`` give the same input and parameter gradients as
``torch.autograd.backward``, run no matrix product twice where the weight sides are
apart, and release the graph once ``W`` has run; a stage's ``Splitter`` plans each graph
shape once. Local: every rank runs the same and
the verdict is agreed."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_all_ranks
from mpidtensor.pipelining.split_backward import Splitter, backward_input

WIDTH = 6


class Stack(nn.Module):
    """Linear + tanh, three times (the benchmark's stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class SharedLinear(nn.Module):
    """One Linear applied at two depths (its parameters' weight sides meet; with a bias,
    both products' edges lead to the same bias: ``W`` runs the whole backward again)."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, bias=bias)
        self.other = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.lin(torch.tanh(self.other(self.lin(x))))


class SharedScale(nn.Module):
    """A scalar parameter multiplied in at two depths (the deeper multiply's weight edge
    is the shallower one's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.3))
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.lin(torch.tanh(x * self.scale)) * self.scale


class Outputs(nn.Module):
    """Several outputs: one differentiable, one integer, one detached, and one that
    depends on the parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bias2 = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        y = self.lin(x)
        return y, y.argmax(-1), y.detach() * 2, (self.bias2 * self.lin.weight.sum(0)).expand(x.shape[0], WIDTH)


class TwoInputs(nn.Module):
    """Two inputs, the second unused; a weight used through a shared transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)

    def forward(self, x, unused):
        wt = self.w.t()
        return torch.tanh(x @ wt) @ wt


CASES = {"stack": Stack, "shared_linear": SharedLinear, "shared_weight": lambda: SharedLinear(bias=False),
         "shared_scale": SharedScale, "outputs": Outputs, "two_inputs": TwoInputs}


def run(name: str, split: bool, first: bool, last: bool):
    """Input and parameter gradients of one backward of ``CASES[name]`` (the same seed)."""
    torch.manual_seed(0)
    module = CASES[name]().double()
    args = [torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=not first)]
    if name == "two_inputs":
        args.append(torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=True))
    outputs = module(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    roots = [o for o in outputs if o.requires_grad]
    if last:
        roots, grads = [sum(o.pow(2).sum() for o in roots)], None
    else:
        grads = [torch.randn_like(o) for o in roots]
    inputs = [a for a in args if a.requires_grad]
    params = list(module.parameters())
    if split:
        got, weights = backward_input(roots, grads, inputs, params)
        weights()
    else:
        torch.autograd.backward(roots, grads)
        got = [x.grad for x in inputs]
    return got, [p.grad for p in params]


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.allclose(a, b, atol=1e-12))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("where", ["middle", "first", "last"])
def test_split_equals_whole_backward(name: str, where: str) -> None:
    first, last = where == "first", where == "last"
    whole_in, whole_params = run(name, False, first, last)
    split_in, split_params = run(name, True, first, last)
    ok = len(whole_in) == len(split_in) and all(
        same(a if a is not None else None, b) for a, b in zip(whole_in, split_in))
    ok = ok and all(same(a, b) for a, b in zip(whole_params, split_params))
    assert_all_ranks(ok, f"{name} ({where}): input grads {whole_in} vs {split_in}; "
                         f"param grads {whole_params} vs {split_params}")


class CountProducts(TorchDispatchMode):
    """Counts matrix products (mm, addmm) dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["stack", "shared_weight"])
def test_no_product_runs_twice(name: str) -> None:
    """``I`` + ``W`` do the matrix products of one whole backward, none more."""
    counts = []
    for split in (False, True):
        torch.manual_seed(0)
        module = CASES[name]().double()
        x = torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=True)
        out = module(x)
        grad = torch.randn_like(out)
        with CountProducts() as mode:
            if split:
                _, weights = backward_input([out], [grad], [x], list(module.parameters()))
                weights()
            else:
                torch.autograd.backward([out], [grad])
        counts.append(mode.count)
    assert_all_ranks(counts[0] == counts[1] and counts[0] > 0, f"{name}: whole {counts[0]}, split {counts[1]}")


class Branchy(nn.Module):
    """The benchmark's stack, with one more layer when asked: two graph shapes, one module."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack()
        self.extra = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, deeper: bool):
        x = self.stack(x)
        return self.extra(x) if deeper else x


def test_splitter_plans_once_per_graph_shape() -> None:
    """A stage's :class:`Splitter` analyses each graph shape once and reuses the plan for
    the micro-batches that build it again (new tensors, new nodes), with the gradients of
    whole backwards; a micro-batch of another shape gets a plan of its own."""
    torch.manual_seed(0)
    module = Branchy().double()
    xs = [torch.randn(4, WIDTH, dtype=torch.float64) for _ in range(5)]
    deeper = [False, False, True, False, True]
    grads = [torch.randn(4, WIDTH, dtype=torch.float64) for _ in xs]
    whole_in = []
    for x, d, g in zip(xs, deeper, grads):
        x = x.clone().requires_grad_()
        torch.autograd.backward([module(x, d)], [g])
        whole_in.append(x.grad)
    whole_params = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    splitter = Splitter()
    params = list(module.parameters())
    split_in, pending = [], []
    for x, d, g in zip(xs, deeper, grads):  # every I first, the Ws later (as a schedule defers them)
        x = x.clone().requires_grad_()
        got, weights = splitter.backward_input([module(x, d)], [g], [x], params)
        split_in += got
        pending.append(weights)
    for weights in pending:
        weights()
    ok = splitter.analyses == 2 and all(same(a, b) for a, b in zip(whole_in, split_in))
    ok = ok and all(same(a, p.grad) for a, p in zip(whole_params, params))
    assert_all_ranks(ok, f"{splitter.analyses} analyses (2 shapes); input grads equal: "
                         f"{[same(a, b) for a, b in zip(whole_in, split_in)]}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_released_after_weights(name: str) -> None:
    """What the forward saved for backward lives until ``W`` has run, and not after."""
    alive: list[weakref.ref] = []

    class Saved:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t.detach()  # not t: a saved output would hold its own node (a cycle)
            alive.append(weakref.ref(self))

    torch.manual_seed(0)
    module = CASES[name]().double()
    args = [torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=True)]
    if name == "two_inputs":
        args.append(torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=True))
    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.t):
        outputs = module(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    roots = [o for o in outputs if o.requires_grad]
    splitter = Splitter()  # the plan it keeps holds no node of the graph
    _, weights = splitter.backward_input(roots, [torch.ones_like(o) for o in roots], args, list(module.parameters()))
    del outputs, roots
    gc.collect()
    kept = sum(r() is not None for r in alive)
    weights()
    del weights
    gc.collect()
    left = sum(r() is not None for r in alive)
    assert_all_ranks(kept > 0 and left == 0, f"{name}: {kept} saved tensors before W, {left} after")
