"""``Function.apply`` of the local paths' autograd Functions without its Python layer.

``torch.autograd.Function.apply`` runs a Python frame per call before the C++ one: it
checks for a ``setup_context``, asks whether functorch transforms are active and then
unwraps dead functorch wrappers through a generator (``_functorch.utils.unwrap_dead_wrappers``);
about a third of a small Function's call cost on CPU. A TP + SP step calls a Function
per Linear, norm and gather (about 26 per step of the demo's Llama). The Functions
here define ``forward`` / ``backward`` only (no ``setup_context``), so the same call is
the C++ ``apply`` on the arguments with dead wrappers unwrapped, as ``Function.apply``
does (looking at the plain tensors only: functorch's wrappers are never a subclass); under
functorch transforms and ``torch.compile`` (whose tracer knows ``Function.apply`` and not
this) the public ``apply`` runs, and so it does everywhere if this torch's
``Function`` lacks the C++ ``apply`` it relies on. A caller that takes its local path only
outside ``torch.compile`` (it asked ``torch.compiler.is_compiling()`` itself, as the
tensor-parallel Linears, norms, embeddings and gathers do) says so
(``compiling_checked=True``) and the apply does not ask again. Such a caller asks in one
Python call, not ``torch.compiler.is_compiling()``'s two (it asks ``torch.jit.is_scripting()``
first, False outside TorchScript): ``dynamo_compiling() or compiler._is_compiling_flag`` is
the same answer (Dynamo folds ``is_dynamo_compiling`` to True while it traces, so the flag is
not read there; the flag is True through a compile session and ``torch.export``). A
Function's forward here sets ``ctx.to_save`` itself: that is all ``ctx.save_for_backward``
does, a Python call each.

:func:`once_differentiable_backward` is torch's ``once_differentiable`` for such a
Function's backward without its cost where it has nothing to do: in a backward that builds
no graph (grad mode off, as the engine runs it unless ``create_graph=True``) its
``no_grad`` block and output check are about seven Python calls that change nothing.
The engine runs such a Function's backward node straight into its ``backward``
(:func:`_direct_backward`), not through ``BackwardCFunction.apply``'s choice each time.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.function import once_differentiable

_C_APPLY = torch._C._FunctionBase.__dict__.get("apply")  # the classmethod ``Function.apply`` ends in
_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
compiler = torch.compiler  # ``compiler._is_compiling_flag``: see the module docstring
dynamo_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled


def direct_apply(cls: type[torch.autograd.Function], compiling_checked: bool = False) -> Callable[..., Any]:
    """``cls.apply``, the same call without ``Function.apply``'s Python frame and generator.
    ``cls`` must not define ``setup_context`` (its forward takes ``ctx``). With
    ``compiling_checked``, every caller has ruled out ``torch.compile`` before calling."""
    if torch.autograd.function._is_setup_context_defined(cls.setup_context):
        raise TypeError(f"{cls.__name__} defines setup_context: use its apply")
    _direct_backward(cls)
    if _C_APPLY is None:
        return cls.apply
    c_apply, public = _C_APPLY.__get__(None, cls), cls.apply
    tensor = torch.Tensor

    def apply(*args: Any) -> Any:
        if _transforms_active() or not compiling_checked and (dynamo_compiling() or compiler._is_compiling_flag):
            return public(*args)
        # functorch's wrappers reach Python as plain ``torch.Tensor`` objects (a subclass such as
        # DTensor is never one), so only those are looked at: ``map(type, ...)`` and ``in`` are no
        # Python calls; the list (a call) is made only when there is a plain tensor to look at
        if tensor not in map(type, args):
            return c_apply(*args)
        return c_apply(*[_unwrap_if_dead(a) if type(a) is tensor else a for a in args])

    apply.__doc__ = f"``{cls.__name__}.apply`` (see :func:`direct_apply`)."
    return apply


def _direct_backward(cls: type[torch.autograd.Function]) -> None:
    """The autograd engine runs ``cls``'s node by its ``apply`` attribute: torch's
    ``BackwardCFunction.apply`` picks ``backward`` (or ``vjp``) through ``_get_user_fn`` and a
    ``getattr`` each time (three Python calls a node). The same choice is made here once and
    the node class's ``apply`` is that function, called as torch's calls it (``fn(ctx, *grads)``).
    Left as torch's for a class that implements both, or boxes its gradients
    (``boxed_grads_call``), or where this torch's node class has no such ``apply``."""
    backward_cls = getattr(cls, "_backward_cls", None)
    base = torch.autograd.function.BackwardCFunction
    if (backward_cls is None or "apply" not in base.__dict__ or getattr(cls, "boxed_grads_call", False)
            or "apply" in backward_cls.__dict__):
        return
    plain = torch.autograd.Function
    backward, vjp = cls.backward, cls.vjp
    if backward is not plain.backward and vjp is not plain.vjp:
        return  # torch's apply raises its error for this
    backward_cls.apply = vjp if vjp is not plain.vjp else backward


def once_differentiable_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``once_differentiable(backward)`` where the backward runs in grad mode (a backward with
    ``create_graph=True``: its outputs then refuse a second backward, as torch's decorator
    makes them), else ``backward`` itself (grad mode is off: no graph is built, the decorator
    would only enter ``no_grad`` and return the outputs). A ``staticmethod``'s function."""
    guarded = once_differentiable(backward)

    def wrapper(ctx: Any, *grads: Any) -> Any:
        if _grad_enabled():
            return guarded(ctx, *grads)
        return backward(ctx, *grads)

    wrapper.__doc__, wrapper.__name__, wrapper.__qualname__ = backward.__doc__, backward.__name__, backward.__qualname__
    return wrapper
