"""``FSDPModule``: the methods a ``fully_shard``-ed module gains (its class becomes
``FSDP<Cls>``, a subclass of both), as torch's: unshard / reshard, prefetch lists, and the
settings frameworks call, each stored on the module's ``ParamGroup`` or root ``FSDPState``."""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from .collectives import check_comm
from .group import ParamGroup
from .state import FSDPState


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` completes the all-gather and
    puts the unsharded parameters on the module."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.finish_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every ``fully_shard``-ed module (as torch's ``FSDPModule``)."""

    _fsdp_state: FSDPState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (the handle's ``wait()`` finishes it if
        ``async_op``); forward will then find them gathered."""
        group = self._fsdp_state.group
        if group is not None:
            group.start_unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather ``modules``' groups (non-blocking) right after this module's, in forward."""
        self._fsdp_state.forward_prefetch = [_prefetch_state(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather ``modules``' groups (non-blocking) when this module's backward starts."""
        self._fsdp_state.backward_prefetch = [_prefetch_state(m) for m in modules]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With ``False``, backward accumulates unsharded gradients locally (no reduce-scatter)
        until a backward with ``True`` reduces the sum."""
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the unsharded parameters (``False`` keeps them for the next forward)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether forward frees the unsharded parameters (then backward gathers them again);
        replaces an int ``reshard_after_forward`` given to ``fully_shard``."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward).__name__}")
        for group in self._groups(recurse):
            group.reshard_after_forward, group.post_forward_comm = reshard_after_forward, None

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with ``False``, gradients are reduce-scattered but not all-reduced over the
        replicate dim; the reduce-scattered sums are kept (summed over backwards) and
        all-reduced, then added to ``.grad``, by the next backward with ``True`` (gradient
        accumulation that communicates within the shard group only). No effect on FSDP."""
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the iteration (default ``True``). With
        ``False`` its end does not wait for the last reduce-scatter (it completes during
        the next backward, or its end); read ``.grad`` or step after a last backward."""
        self._fsdp_state.root.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With ``False``, backward does not all-gather this module's parameters (an expert
        setting for groups whose backward needs no parameter values, e.g. an embedding);
        their gradients are still reduce-scattered."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.unshard_in_backward = unshard_in_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size, split
        as torch's FSDP2 splits it (``collectives.divide_factors``)."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: use ``set_gradient_divide_factor``."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """With ``True`` the collectives only sum; the division by the divide factor runs
        after the all-reduce hook (in float32/bfloat16; other dtypes split it around the
        sum either way). MPI reductions here always sum: this moves where FSDP divides."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.force_sum_reduction = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: object | None = None) -> None:
        """``hook(reduced)`` runs on each reduced flat gradient buffer of this module's group
        before it becomes ``.grad`` (in ``reduce_dtype``): the reduce-scatter output (after
        the replicate all-reduce under HSDP), and the all-reduced gradients of parameters
        FSDP leaves replicated (TP-sharded on every dim). It may change them in place.
        ``stream``: accepted as in torch; there are no streams on MPI, the hook runs inline."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}")
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.all_reduce_hook = hook

    def set_post_optim_event(self, event: object) -> None:
        """torch: the root's all-gathers wait on ``event`` (recorded after the optimizer step)
        instead of the whole current stream. mpidtensor issues its collectives from the host
        after the step returned, so there is nothing to wait for on CPU: the root's next
        forward calls ``event.synchronize()`` (a no-op for a finished step) and drops it."""
        if not callable(getattr(event, "synchronize", None)):
            raise TypeError(f"set_post_optim_event expects an event with synchronize(), got {type(event).__name__}")
        self._fsdp_state.root.post_optim_event = event

    def set_custom_all_gather(self, comm: object) -> None:
        """Run this group's all-gathers through ``comm`` (torch's ``AllGather`` shape; its
        ``group`` is the mpi4py communicator of the shard dim: see ``fsdp.collectives``)."""
        check_comm(comm, "AllGather")
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: object) -> None:
        """Run this group's gradient reduce-scatters through ``comm`` (torch's
        ``ReduceScatter`` shape, ``op="sum"``: see ``fsdp.collectives``)."""
        check_comm(comm, "ReduceScatter")
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.custom_reduce_scatter = comm

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """With ``True``, a parameter that took part in forward but got no gradient in backward
        (conditional control flow, unrouted experts) sends zeros to the reduce-scatter, so
        that every rank reduce-scatters the same parameters (as DDP's
        ``find_unused_parameters``); on MPI ranks that sent different parameters would mix
        up their buffers."""
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reduce-scatters (each with its input buffer) may be in flight at
        once (torch: ``>= 1``, default 1): the next group's reduce-scatter starts without
        waiting for the previous ones until this many are running; more overlap, more
        memory. With MPI progress ``off`` (the default) a reduce-scatter is done when it
        returns, so only the ``hooks`` and ``thread`` modes see a difference."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """With ``True`` gradient reduce-scatters run on their own communicator, a duplicate
        (``MPI_Comm_dup``) of the shard communicator, one per mesh, so that they never queue
        behind an all-gather on the same communicator; ``False`` goes back to the shard
        communicator. Collective over the shard ranks, as torch's: call it on every rank."""
        for group in self._groups(recurse):
            group.use_separate_reduce_scatter(enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """torch: allocate the collectives' staging buffers with the ProcessGroup's own
        allocator (NCCL's zero-copy transfers over SHARP). Stored and otherwise a no-op on
        MPI: the buffers come from mpidtensor's pool (``MPIDTENSOR_BUFFER_POOL_MB``) either
        way. Like torch, refused with a custom all-gather or reduce-scatter."""
        group = self._fsdp_state.group
        if group is not None:
            if enable and (group.custom_all_gather is not None or group.custom_reduce_scatter is not None):
                raise ValueError("set_allocate_memory_from_process_group_for_comm cannot be combined with "
                                 "set_custom_all_gather / set_custom_reduce_scatter")
            group.allocate_from_process_group = enable

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """torch: allocate the all-gather staging buffers in NCCL symmetric memory (copy-engine
        or symmetric-kernel all-gathers). Stored and otherwise a no-op on MPI, which has no
        symmetric memory: the all-gathers run as before. ``backend`` must be ``"NCCL"``, as
        in torch."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports the backend 'NCCL' only, got {backend!r}")
        group = self._fsdp_state.group
        if group is not None:
            group.symm_mem_backend = backend

    def reset_iter_state(self) -> None:
        """After an exception interrupted forward or backward: finish and drop every
        collective in flight, reshard every group and clear the iteration's bookkeeping, so
        that the next iteration runs normally. The interrupted iteration's gradients
        (including no_sync and HSDP partial sums) are lost. Call it on the root module."""
        self._fsdp_state.reset_iter_state()

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        modules = self.modules() if recurse else [self]
        groups = {id(m._fsdp_state.group): m._fsdp_state.group for m in modules
                  if isinstance(m, FSDPModule) and m._fsdp_state.group is not None}
        return list(groups.values())  # (a list fully_shard's group once)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """torch: let several FSDP roots (pipeline stages' model chunks) share one set of CUDA
    streams for their collectives. MPI collectives have no streams: the modules are
    checked, as torch checks them, and the shared context is recorded (``comm_ctx``) and
    changes nothing else."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
    if modules:
        shared = modules[0]._fsdp_state.comm_ctx
        for module in modules[1:]:
            module._fsdp_state.comm_ctx = shared


def _prefetch_state(module: nn.Module) -> FSDPState:
    """The state of a module named in a prefetch list, which must be ``fully_shard``-ed."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"expected a fully_shard-ed module, got {type(module).__name__}")
    return module._fsdp_state
