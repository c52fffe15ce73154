"""torch.optim steps on the local tensors of DTensor parameters (the fast path
``optim.local_step``).

An elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam)
updates each element of a parameter from the same element of its gradient and state,
so where the dispatcher would run every op of the step as the local op on the local
tensors (a :class:`~mpidtensor.dispatch.kinds.LocalPlan`: nothing moves, the results
keep the parameter's spec) the update is the local update of every rank, and dispatch
would only unwrap every list and wrap every result. On CPU that cost 0.5-0.7 ms of a
2-2.5 ms AdamW step over the demo's 21 FSDP parameters (docs/performance.md, "the
optimizer on local tensors and flat runs"). A global step pre-hook therefore runs such a
step on the local tensors themselves: for the step, each qualifying parameter group
holds the parameters' local tensors (their ``.grad`` the gradients' local tensors) and
``optimizer.state`` a shadow whose entries hold the states' local tensors; the post-hook
puts the groups and the state back and wraps any state the step created (first step,
SGD's momentum buffer) as DTensors of the parameter's spec. Same ops on the same values,
so bit for bit the DTensor path's result. The choice of kernels (``foreach``) is left to
:mod:`mpidtensor.fast.foreach`, whose pre-hook is installed first and sees the DTensor
parameters. Parameters whose local tensors, gradients and states lie back to back step
as one tensor (:mod:`mpidtensor.fast.flat_runs`; ``COALESCE``). How each group steps is
cached (``_Layout``) while its parameters, local tensors and state objects stay the
same, so a step checks identities and gradient specs, not every layout; and while the
whole ``optimizer.state`` holds the same entries, keys and values as when the layouts were
last checked (one identity snapshot of it, ``_snapshot``: no per-parameter look-up, which
hashes a tensor in Python), only the parameters and their local tensors are checked.

What decides it: per parameter spec, the dispatcher's plans for an in-place elementwise
op and a ``_foreach_`` op whose operands all have that spec (the pointwise and foreach
rules every op of these optimizers uses, fused ones included) are LocalPlans
(:func:`_steps_locally`, asked once per spec); the step then checks that the gradient
and every tensor state are DTensors of that very spec (or 0-d step counts), so the
verdict applies to them. Beyond that a group needs ``differentiable`` and ``capturable``
off and plain local tensors (a quantized local tensor steps through its own ops).
Anything else (a Replicate gradient of a Shard parameter, a Partial parameter, a
subclass of these optimizers, ``torch.compile``, ``step(closure)``, whose closure makes
the gradients inside the step, an optimizer with step hooks of its own or a global step
pre-hook registered after this one, which would see the local tensors) takes the
DTensor path.

A step that raises leaves the swap in place until the next step, ``state_dict()`` or
``load_state_dict()``, which restore it first (and a ``zero_grad()`` run in between
reaches the parameters). ``settings.local_optim_step = False``
(``MPIDTENSOR_LOCAL_OPTIM_STEP=0``) or ``settings.fast_paths = False`` turns the path off.
The hooks are the process-wide effect ``"optimizer local step"``, installed at the first
mesh.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import chain, repeat
from operator import attrgetter, is_, is_not, itemgetter, methodcaller

import torch
from torch.optim.optimizer import (
    _global_optimizer_pre_hooks as _global_pre_hooks,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..dispatch import moves_nothing
from ..tensor.dtensor import DTensor
from ..runtime import caches, effects
from ..runtime.settings import settings
from . import flat_runs, foreach, registry
from .flat_runs import Run, candidate_runs, rehome

__all__ = ["ELEMENTWISE", "COALESCE", "PATH", "restore"]

PATH = registry.register(
    "optim.local_step",
    shortcuts="an elementwise torch.optim step through DTensor dispatch (a plan lookup, unwrap and wrap "
              "per op and parameter): the same step on the local tensors",
    decided_by="the dispatcher's plans for an in-place pointwise op and a _foreach_ op on operands of the "
               "parameter's spec are LocalPlans (_steps_locally, once per spec); gradient and states "
               "checked to have that spec each step")
COALESCE = True  # step runs of back-to-back parameters as one tensor (fast.flat_runs): a measuring knob

# torch's elementwise optimizers, by exact type: a subclass may add non-elementwise work
ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
})

_aten = torch.ops.aten
_VERDICTS = caches.cache("fast.optim_step.specs", maxsize=16384)  # spec -> the dispatcher moves nothing
_SWAP = "_mpidtensor_local_step"  # optimizer attribute: the _Swap in place
_HOOKED = "_mpidtensor_local_step_hooks"  # optimizer attribute: its state_dict hooks are registered
_LAYOUTS = "_mpidtensor_local_step_layouts"  # optimizer attribute: id(group) -> _Layout or None
_CHECKED = "_mpidtensor_local_step_checked"  # optimizer attribute: _snapshot of the state the layouts hold for
_local_of, _grad_of, _spec_of = attrgetter("_local_tensor"), attrgetter("grad"), attrgetter("_spec")
_DTENSOR = {DTensor}
_keys, _values = methodcaller("keys"), methodcaller("values")


class _Layout:
    """How one parameter group steps on local tensors, built once and kept while its
    parameters, their local tensors and their state objects stay the same (checked each
    step): ``locals`` (None for a plain parameter), ``order`` (what the step runs on, one
    item per run or parameter outside a run, so that a step's bookkeeping goes by runs, not
    parameters: ``(group index, index in dtensors or None for a plain parameter, run)``, a run
    as (its members as (group index, index in dtensors) pairs, Run, getter of its gradients
    from the dtensors' ones) or None) and the chains whose states are to be put back to
    back after the step (``rehome``, group indices)."""

    __slots__ = ("params", "locals", "dtensors", "dlocals", "values", "order", "rehome")

    def __init__(self, params: list, state) -> None:
        self.params = tuple(params)
        self.locals = tuple(p._local_tensor if type(p) is DTensor else None for p in params)
        self.dtensors = tuple(p for p in params if type(p) is DTensor)
        self.dlocals = tuple(local for local in self.locals if local is not None)
        entries = [state.get(p) if type(p) is DTensor else None for p in params]
        self.values = _state_values(params, self.locals, state)
        at = dict(zip((i for i, local in enumerate(self.locals) if local is not None), range(len(self.dtensors))))
        runs, self.rehome = {}, []
        for members in candidate_runs(params, self.locals) if COALESCE else ():
            run = Run.make([params[i] for i in members], [entries[i] for i in members])
            if run is None:
                self.rehome.append(members)
            else:
                runs[min(members)] = (tuple((i, at[i]) for i in members), run, itemgetter(*(at[i] for i in members)))
        covered = {i for members, _, _ in runs.values() for i, _ in members}
        self.order = tuple((i, at.get(i), runs.get(i)) for i in range(len(params)) if i in runs or i not in covered)

    def holds(self, params: list, state) -> bool:
        """Whether the group still has these parameters, local tensors and state objects."""
        if len(params) != len(self.params) or not all(map(is_, params, self.params)):
            return False
        if not all(local is None or p._local_tensor is local for p, local in zip(params, self.locals)):
            return False
        values = _state_values(params, self.locals, state)
        return len(values) == len(self.values) and all(map(is_, values, self.values))

    def holds_params(self, params: list) -> bool:
        """Whether the group still has these parameters and local tensors (the state
        checked by the caller, ``_snapshot``)."""
        return (len(params) == len(self.params) and all(map(is_, params, self.params))
                and all(map(is_, map(_local_of, self.dtensors), self.dlocals)))


def _snapshot(state) -> list:
    """Every key, entry, entry key and entry value of ``optimizer.state``, in order, for an
    identity comparison (C-level iteration: no tensor is hashed)."""
    entries = list(state.values())
    return [*state, *entries, *chain.from_iterable(map(_keys, entries)),
            *chain.from_iterable(map(_values, entries))]


def _state_values(params: list, locals_: tuple, state) -> list:
    """Every DTensor parameter's state keys and values, in order (for identity checks)."""
    values = []
    for p, local in zip(params, locals_):
        if local is not None:
            entry = state.get(p)
            values.append(p)
            if entry:
                values += entry.keys()
                values += entry.values()
    return values


def _steps_locally(p: DTensor) -> bool:
    """Whether the dispatcher runs an optimizer's elementwise ops on operands of ``p``'s
    spec without moving anything: its plans for ``addcmul_`` (the pointwise rule) and
    ``_foreach_addcmul_`` (the foreach rule, also the fused steps') are LocalPlans.
    Asked once per spec."""
    spec = p._spec
    verdict = _VERDICTS.get(spec)
    if verdict is None:
        verdict = _VERDICTS[spec] = (moves_nothing(_aten.addcmul_.default, (p, p, p))
                                     and moves_nothing(_aten._foreach_addcmul_.Scalar, ([p], [p], [p])))
    return verdict


def _static_ok(group: dict, state) -> bool:
    """What qualifies a group while its layout holds: ``differentiable`` and ``capturable``
    off, some DTensor parameter, and for each: a plain local tensor, a spec the dispatcher
    steps locally (:func:`_steps_locally`), DTensor states of that spec, other tensor
    states 0-d."""
    if group.get("differentiable") or group.get("capturable"):
        return False
    found = False
    for p in group["params"]:
        if type(p) is not DTensor:
            continue
        if type(p._local_tensor) is not torch.Tensor or not _steps_locally(p):
            return False
        for v in state.get(p, {}).values():
            if type(v) is DTensor:
                if v._spec is not p._spec:
                    return False
            elif isinstance(v, torch.Tensor) and v.dim():
                return False
        found = True
    return found


def _grad_locals(layout: _Layout) -> list | None:
    """The local tensors of the DTensor parameters' gradients (None for a missing one), in
    the order of ``layout.dtensors``; None unless each gradient is None or a DTensor of its
    parameter's spec, the spec :func:`_steps_locally` vouched for (checked each step)."""
    params = layout.dtensors
    grads = list(map(_grad_of, params))
    try:  # the common case, every gradient a DTensor: C-level maps, no Python call per parameter
        specs = list(map(_spec_of, grads))
    except AttributeError:  # a missing or plain gradient
        out = []
        for p, g in zip(params, grads):
            if g is not None and (type(g) is not DTensor or g._spec is not p._spec):
                return None
            out.append(None if g is None else g._local_tensor)
        return out
    if set(map(type, grads)) != _DTENSOR or not all(map(is_, specs, map(_spec_of, params))):
        return None
    return list(map(_local_of, grads))


class _Shadow(dict):
    """``optimizer.state`` during a swapped step: the swapped tensors' entries, and any
    other parameter's entry taken from (or made in) the real state when first asked for."""

    __slots__ = ("real",)

    def __init__(self, real: defaultdict) -> None:
        super().__init__()
        self.real = real

    def __missing__(self, key):
        entry = self[key] = self.real[key]
        return entry


class _Swap:
    """What a swapped step changed: ``(group, params)`` per group, the real state,
    ``(parameter, local tensor)`` of every DTensor parameter stepped alone, ``(run, its
    shadow entry)`` of the runs stepped flat (torch's optimizers update an entry in place),
    and the parameter stretches whose states are to be rehomed."""

    __slots__ = ("groups", "state", "pairs", "flat", "rehome")

    def __init__(self, state: defaultdict) -> None:
        self.groups, self.state, self.pairs, self.flat, self.rehome = [], state, [], [], []


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if _SWAP in optimizer.__dict__:  # a step that raised left its swap in place
        restore(optimizer)
    if (not registry.enabled() or not settings.local_optim_step or type(optimizer) not in ELEMENTWISE
            or torch.compiler.is_compiling()):
        return
    if any(map(is_not, args[1:], repeat(None))) or kwargs.get("closure") is not None:  # args[0]: the optimizer
        return  # a closure makes the gradients inside the step, on the DTensor parameters
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or next(reversed(_global_pre_hooks.values())) is not _before_step):
        return  # another step hook would run while the swap is in place and see local tensors
    state = optimizer.state
    layouts = optimizer.__dict__.setdefault(_LAYOUTS, {})
    snapshot = _snapshot(state)
    checked = optimizer.__dict__.get(_CHECKED)
    same_state = (checked is not None and checked[0] is state and len(checked[1]) == len(snapshot)
                  and all(map(is_, snapshot, checked[1])))
    swap = _Swap(state)
    shadow = None
    for group in optimizer.param_groups:
        params = group["params"]
        layout = layouts.get(id(group))
        if layout is None or not (layout.holds_params(params) if same_state else layout.holds(params, state)):
            layout = layouts[id(group)] = _Layout(params, state) if _static_ok(group, state) else None
        grads = None if layout is None else _grad_locals(layout)
        if grads is None:
            continue
        if shadow is None:
            shadow = _Shadow(state)
        swap.groups.append((group, params))
        group["params"] = _swap_group(layout, params, grads, state, shadow, swap)
        PATH.hits += 1
    optimizer.__dict__[_CHECKED] = (state, snapshot)  # every layout above holds for this state
    if shadow is None:
        return
    if not getattr(optimizer, _HOOKED, False):
        optimizer.register_state_dict_pre_hook(restore)
        optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: restore(opt))
        setattr(optimizer, _HOOKED, True)
    optimizer.state = shadow
    setattr(optimizer, _SWAP, swap)


def _swap_group(layout: _Layout, params: list, grads: list, state, shadow: _Shadow, swap: _Swap) -> list:
    """The tensors one group's step runs on (filling ``shadow`` and ``swap``); ``grads``:
    :func:`_grad_locals`."""
    out = []
    for i, at, found in layout.order:
        if found is not None:
            members, run, pick = found
            grad = run.grad(pick(grads))
            entry = None if grad is None else run.entry()
            if entry is not None:
                run.flat.grad = grad
                shadow[run.flat] = entry
                swap.flat.append((run, entry))
                flat_runs.PATH.hits += 1
                out.append(run.flat)
            else:  # the run's members one at a time
                out += [_swap_one(params[m], layout.locals[m], grads[a], state, shadow, swap) for m, a in members]
        elif at is None:
            out.append(params[i])
        else:
            out.append(_swap_one(params[i], layout.locals[i], grads[at], state, shadow, swap))
    swap.rehome.extend([params[i] for i in members] for members in layout.rehome)
    return out


def _swap_one(p: DTensor, local: torch.Tensor, grad: torch.Tensor | None, state, shadow: _Shadow,
              swap: _Swap) -> torch.Tensor:
    """Step DTensor parameter ``p`` alone, on its local tensor (its gradient's: ``grad``)."""
    local.grad = grad
    entry = state.get(p)
    shadow[local] = {k: v._local_tensor if type(v) is DTensor else v for k, v in entry.items()} if entry else {}
    swap.pairs.append((p, local))
    return local


def restore(optimizer: torch.optim.Optimizer, *_) -> None:
    """Put back what a swapped step changed (no-op without one); the step's new or
    replaced states become DTensors of their parameter's spec."""
    swap = optimizer.__dict__.pop(_SWAP, None)
    if swap is None:
        return
    shadow, state = optimizer.state, swap.state
    for group, params in swap.groups:
        group["params"] = params
    for p, local in swap.pairs:
        if local.grad is None and p.grad is not None:  # a zero_grad() ran on the swapped groups
            p.grad = None
        local.grad = None
        new = shadow.get(local)
        if not new:
            continue
        entry = state[p]
        for k, v in new.items():
            old = entry.get(k)
            if type(old) is DTensor and old._local_tensor is v:
                continue
            if isinstance(v, torch.Tensor) and v.dim() and v.shape == local.shape and v.dtype == p.dtype:
                v = DTensor(v, p._spec)
            entry[k] = v
    for run, entry in swap.flat:  # (the entry kept: no tensor hashed to find it in the shadow)
        flat = run.flat
        if flat.grad is None:  # a zero_grad() ran on the swapped groups
            for p in run.params:
                p.grad = None
        flat.grad = None
        run.write_back(entry, state)
    for params in swap.rehome:
        rehome(params, [state.get(p) for p in params])
    optimizer.state = state


@effects.effect("optimizer local step", "first mesh",
                "a global optimizer step pre-hook and post-hook: elementwise torch.optim optimizers step "
                "DTensor parameters on their local tensors (mpidtensor.fast.optim_step)")
def _install_hooks() -> tuple:
    effects.install(foreach.HOOKS)  # its pre-hook must run first, on the DTensor parameters
    return register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(restore)
