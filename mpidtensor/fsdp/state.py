"""Hooks that drive one ``fully_shard``-ed module through forward and backward.

Forward: the pre-hook all-gathers the module's group (if a prefetch has not already
started it) and starts the next group's all-gather (explicit prefetch list, else the
forward order recorded in the first iteration); the post-hook reshards when
``reshard_after_forward`` (never the root while gradients are on: backward would
gather it straight back; nor a module that the recorded order calls again later in
this forward: it stays gathered until its last call) and registers the pre-backward
hook on the outputs. Backward: the pre-backward hook gathers the group again and
prefetches the one that runs next (reverse post-forward order); an identity autograd
function on the module's inputs signals when the module's backward is done, and the
last such signal of a module called several times (every forward call with gradients
counts) starts the group's one reduce-scatter, so the gradient is the sum of all uses.
The root queues a final callback that reduces whatever is left (modules whose inputs
need no gradient), waits for every reduce-scatter (unless ``set_is_last_backward(False)``),
and reshards. A registered forward method (``register_fsdp_forward_method``) runs the
pre/post-forward hooks around itself; the module's own forward calls inside it are
nested (``method_depth``) and leave the parameters gathered. Every hook ends with
``runtime.progress.poke()`` (an ``MPI_Test`` on an in-flight collective) when
``progress.poking`` (the ``hooks`` progress mode; not called in the default ``off``).
"""
from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..fast.functions import direct_apply
from ..runtime import progress
from .group import SHARDED, UNSHARDED, ParamGroup
from .policies import MixedPrecisionPolicy, cast_floats


def _eager_only(hook: Callable) -> Callable:
    """``hook`` as ``torch.compiler.disable`` leaves it to Dynamo, without its wrapper (~8
    Python calls a hook call, the eval-frame switches): its code is marked for Dynamo's frame
    evaluation as skipped with every call it makes, and the function as disabled for a trace
    that meets it. The decorator itself where torch lacks the marks."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return torch.compiler.disable(hook)
    set_code_exec_strategy(hook.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    hook._torchdynamo_disable = True
    return hook


class FSDPState:
    """Per-module FSDP state; the root's also holds the order and pending work of all."""

    def __init__(self, modules: list[nn.Module], group: ParamGroup | None, mp: MixedPrecisionPolicy) -> None:
        self.module = modules[0]
        # fully_shard([a, b]): one group for several modules, gathered on the first forward of
        # any of them and resharded after the last (or the root's end); ids not yet run
        self.modules = modules
        self._several = len(modules) > 1
        self._to_run: set[int] = set()
        self.group = group
        self.mp = mp
        self.is_root: bool | None = None
        self.root: FSDPState = self
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self._call_index = 0  # of the running forward call in the forward order
        self._call_in_order = False  # that call is at its index of the recorded order (_pre_forward)
        self._last_index = -1  # this state's last index in the recorded forward order
        self._post_forward_indices: list[int] = []  # one per forward call since the root's
        self._uses = 0  # forward calls with gradients whose backward has not ended
        self.method_depth = 0  # inside a registered forward method (its own forward calls are nested)
        # root only
        self.states: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        self._forward_index = 0
        self._kept: list[FSDPState] = []  # gathered past a forward call for a later call
        self._recording = True
        self._callback_queued = False
        self._reducing: list[ParamGroup] = []
        self.is_last_backward = True
        self.post_optim_event: Any = None
        self.comm_ctx: object = self  # share_comm_ctx: the context these hooks share (no streams on MPI)
        self.shared_elsewhere: list[tuple[nn.Module, str]] = []  # (module, name): also in an earlier group
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward)

    # --- root -------------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        """The first state to run forward becomes the root of every state below it."""
        if len(self.modules) > 1:
            raise RuntimeError("the root fully_shard module must be one module, not a list: apply fully_shard "
                               f"to a module holding {[type(m).__name__ for m in self.modules]} as well")
        self.is_root = True
        found = {id(s): s for s in map(state_of, self.module.modules()) if s is not None}  # (a group's state once)
        self.states = list(found.values())
        for state in self.states[1:]:
            state.is_root, state.root = False, self
        names = {id(m): name for name, m in self.module.named_modules()}
        for state in self.states:
            for module, name in state.shared_elsewhere:
                fqn = ".".join(filter(None, (names.get(id(module), type(module).__name__), name)))
                raise ValueError(f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP "
                                 "group. For shared/tied parameters, use fully_shard([module_a, module_b]) to place "
                                 "them in the same FSDP group.")

    def _final_callback(self) -> None:
        """End of backward: reduce what is left (with gradient sync on, also what earlier
        backwards held for a group this one did not reach), wait for all reductions, reshard."""
        for state in self.states:  # inputs that needed no gradient, calls yet to signal, unused groups
            group = state.group
            if group is not None and (group.has_pending_grads or group.holds_grads and group.requires_gradient_sync):
                self._reduce(group)
            state._uses = 0
            state._to_run.clear()
        if self.is_last_backward:
            for group in self._reducing:
                group.finish_reduce()
            self._reducing.clear()
        for state in self.states:
            group = state.group
            if group is not None and group.reshard_after_backward and group.sharded_state is not SHARDED:
                group.reshard()
        self._callback_queued = False

    def reduce_held(self) -> None:
        """The root's end of a step whose backwards all ran with gradient sync off and no
        reshard, as a pipeline's split backward runs them (``pipelining.fsdp_sync``): with the
        switches turned on first, reduce the gradients summed over them, wait, reshard."""
        if self.is_root:
            self._final_callback()

    def _reduce(self, group: ParamGroup) -> None:
        """The root starts reducing ``group``'s gradients (summed over every call) and reshards
        it; records its reduce-scatter and completes the ones started before it but the last
        ``reduce_scatter_max_input_buffers - 1`` (default: all)."""
        group.post_backward()
        if not group.reducing:
            return
        keep = group.reduce_scatter_max_input_buffers - 1
        while len(self._reducing) > keep:
            self._reducing.pop(0).finish_reduce()
        self._reducing.append(group)

    def reset_iter_state(self) -> None:
        """The root's recovery after an exception (``FSDPModule.reset_iter_state``)."""
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        for state in self.states or [self]:
            if state.group is not None:
                state.group.reset()
            state._uses, state.method_depth, state._post_forward_indices = 0, 0, []
        self._reducing, self._kept, self.post_forward_order = [], [], []
        self._forward_index, self._callback_queued = 0, False

    # --- forward ----------------------------------------------------------------------------------
    # The hooks run eagerly when the module is compiled (``module.compile()`` per block, as
    # torchtitan does, ``fullgraph=True`` included): Dynamo breaks the graph around them, as
    # around torch's FSDP2 hooks; traced, they would hand fake tensors to MPI (``_eager_only``).
    @_eager_only
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.method_depth:  # forward called by a registered forward method: already gathered
            return args, kwargs
        if self._several:
            if self._to_run:  # a later module of the group in this pass: gathered by the first
                if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
                    args, kwargs = cast_floats((args, kwargs), self.mp.param_dtype)
                if self.group is not None:
                    self.group.finish_unshard()
                return args, kwargs
            self._to_run = {id(m) for m in self.modules}
        if self.is_root is None:
            self._lazy_init()
        root = self.root
        if self.is_root:
            if root.post_optim_event is not None:
                root.post_optim_event.synchronize()
                root.post_optim_event = None
            root.post_forward_order = []
            root._forward_index = 0
            for state in root.states:
                state._post_forward_indices = []
        self._call_index = index = root._forward_index
        root._forward_index += 1
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.mp.param_dtype)
        if self.group is not None:
            self.group.finish_unshard()
            if torch.is_grad_enabled():
                self._uses += 1
                args, kwargs = self._hook_post_backward(args, kwargs)
        order = root.forward_order
        if root._recording:
            order.append(self)
            in_order = False
        else:  # this call is where the recorded order has it (then the next in order is prefetched)
            in_order = index < len(order) and order[index] is self
        self._call_in_order = in_order
        prefetch = self.forward_prefetch
        if prefetch is None:
            prefetch = order[index + 1:index + 2] if in_order else ()
        for target in filter(_group_of, prefetch):  # (C-level: no call per state)
            target.group.start_unshard()
        if progress.poking:
            progress.poke()
        return args, kwargs

    @_eager_only
    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.method_depth:
            return output
        if self._several:
            self._to_run.discard(id(module))
            if self._to_run:  # more modules of the group to run: keep the parameters gathered
                return cast_floats(output, self.mp.output_dtype)
        if progress.poking:
            progress.poke()
        root = self.root
        grad = torch.is_grad_enabled()
        if self.group is not None and self.group.reshard_after_forward and not (self.is_root and grad):
            if self._call_in_order and self._last_index > self._call_index:
                root._kept.append(self)  # called again later in this forward
            else:
                self.group.reshard_post_forward()
        self._post_forward_indices.append(len(root.post_forward_order))
        root.post_forward_order.append(self)
        if self.is_root:
            for state in root._kept:  # a later call the recorded order promised did not come
                if state.group.sharded_state is UNSHARDED:
                    state.group.reshard()
            root._kept = []
            for state in root.states:  # groups whose forward ran some of their modules only
                if state._to_run and state is not self:
                    state._to_run.clear()
                    output = state._post_forward(state.module, (), output)
            if root._recording:
                root._recording = False
                for i, state in enumerate(root.forward_order):
                    state._last_index = i
        if grad:
            leaves = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if len(tensors) == 1:  # the common case: a tensor hook fires as a one-tensor multi-grad hook
                tensors[0].register_hook(self._pre_backward)
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        return output if self.mp.output_dtype is None else cast_floats(output, self.mp.output_dtype)

    # --- backward ---------------------------------------------------------------------------------
    def _hook_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the inputs that need gradients through ``_PostBackward``, whose backward runs
        once the module's whole backward (frozen parameters' uses included) is done."""
        # the common case without pytree; ``map`` and ``repeat``: no Python call per argument, as a generator's
        plain = not kwargs and all(map(isinstance, args, repeat(torch.Tensor)))
        flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
        index = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if index:
            for i, t in zip(index, _post_backward(self, *map(flat.__getitem__, index))):
                flat[i] = t
            args, kwargs = (tuple(flat), kwargs) if plain else tree_unflatten(flat, spec)
        return args, kwargs

    def post_backward(self) -> None:
        """The backward of one forward call is done; after the last, reduce and reshard."""
        self._uses -= 1
        if self._uses <= 0:
            self.root._reduce(self.group)
        if progress.poking:
            progress.poke()

    def _pre_backward(self, grad: torch.Tensor) -> None:
        root = self.root
        if not root._callback_queued:
            Variable._execution_engine.queue_callback(root._final_callback)
            root._callback_queued = True
        if self.group is not None and self.group.unshard_in_backward:
            self.group.finish_unshard()
        # of its last forward call not yet met: backward meets the calls in reverse
        i = self._post_forward_indices.pop() if self._post_forward_indices else 0
        prefetch = self.backward_prefetch  # (filter: C-level, no call per state)
        for target in filter(_group_of, (root.post_forward_order[i - 1:i] if i > 0 else ()) if prefetch is None
                             else prefetch):
            if target.group.unshard_in_backward:
                target.group.start_unshard()
        if progress.poking:
            progress.poke()


_group_of = attrgetter("group")  # a ParamGroup is always true, None false
_view_as = torch.Tensor.view_as


def state_of(module: nn.Module) -> FSDPState | None:
    """The ``FSDPState`` that ``fully_shard`` gave ``module`` (kept in its ``__dict__``), if any."""
    return module.__dict__.get("_fsdp_state")


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward signals the end of the module's backward."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(map(_view_as, inputs, inputs))  # (``map``: no Python call per input)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        ctx.state.post_backward()
        return (None, *grads)


# (Function.apply's Python layer is ~6 calls a module; only ``_pre_forward`` applies it, which
# ``_eager_only`` keeps out of any trace)
_post_backward = direct_apply(_PostBackward, compiling_checked=True)
