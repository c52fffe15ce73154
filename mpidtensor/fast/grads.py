"""A local path's parameter gradient put on the parameter's ``.grad`` by the Function itself.

A Function's DTensor gradient for a leaf parameter goes to autograd's ``AccumulateGrad``,
which, the first time (``.grad`` unset), stores ``gradient.detach()``: an ``aten.detach``
through ``__torch_dispatch__`` (torch's dispatch-rule look-up, the cache key, a new
wrapper; ~10 Python calls). Where that is all it would do, the Function's backward sets
``.grad`` to the DTensor itself and hands autograd ``None`` for that input (whose
``AccumulateGrad`` then does nothing): the same ``.grad``, the same storage. That is so
when fast paths are on, grad mode is off (no ``create_graph``), the parameter is a leaf
without ``.grad``, without tensor hooks (``register_hook``, post-accumulate-grad hooks),
and this backward runs its ``AccumulateGrad`` (``torch.autograd.grad`` and
``backward(inputs=...)`` without it capture the gradient instead). Anything else takes
autograd's way. Hooks registered on the ``AccumulateGrad`` node itself
(``Node.register_hook``) cannot be seen from Python and are not run on this path.
"""
from __future__ import annotations

import torch

from ..tensor.dtensor import DTensor
from ..tensor.spec import DTensorSpec
from ..runtime.settings import settings
from .registry import register

PARAM_GRAD = register(
    "autograd.param_grad",
    shortcuts="AccumulateGrad's first gradient of a DTensor parameter: aten.detach through __torch_dispatch__",
    decided_by="autograd's state at the backward: a leaf without .grad or tensor hooks whose AccumulateGrad "
               "node this backward runs (torch._C._will_engine_execute_node), grad mode off",
)
_grad_enabled, _will_run = torch.is_grad_enabled, torch._C._will_engine_execute_node


def param_grad(ctx, index: int, param: DTensor, local: torch.Tensor, spec: DTensorSpec) -> DTensor | None:
    """The gradient to return for ``param``, the Function's ``index``-th tensor input, whose
    gradient is the DTensor of ``spec`` around ``local``: ``None`` once it is on ``param.grad``."""
    grad = DTensor(local, spec)
    if (settings.fast_paths and param.grad_fn is None and param.grad is None and param._backward_hooks is None
            and param._post_accumulate_grad_hooks is None and not _grad_enabled()):
        node = ctx.next_functions[index][0]
        try:
            runs = node.variable is param and _will_run(node)
        except RuntimeError:  # torch.autograd.grad of the leaf itself: it captures the gradient
            runs = False
        if runs:
            PARAM_GRAD.hits += 1
            param.grad = grad
            return None
    return grad
