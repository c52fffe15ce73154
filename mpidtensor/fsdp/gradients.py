"""The gradient side of an FSDP parameter group (``group.ParamGroup``, which inherits it).

``post_backward`` takes the unsharded gradients (summed over backwards held with gradient
sync off) and starts their reduction; ``finish_reduce`` completes it. Packed in
``reduce_dtype``, one reduce-scatter (blocking unless MPI progress is on, see
``collectives.start_reduce_scatter``; then an all-reduce over the replicate dim for HSDP)
and a division by the data-parallel size (or ``set_gradient_divide_factor``'s, split as
``collectives.divide_factors`` says around the all-reduce hook); the sharded ``.grad``s are
made from the result, and each sharded parameter's post-accumulate-grad hooks run once its
``.grad`` is in, as torch's FSDP2 runs them. Replicated parameters' gradients are all-reduced
over the data-parallel mesh. ``CPUOffloadPolicy``: the ``.grad`` shards go back to the host.
"""
from __future__ import annotations

from itertools import accumulate, repeat
from operator import attrgetter, is_, itemgetter

import torch

from ..fast.registry import register
from ..runtime import progress
from ..runtime.settings import settings
from ..tensor.dtensor import DTensor
from . import collectives, packing
from .param import FSDPParam

_unsharded_grad_of, _requires_grad_of, _grad_acc_of = attrgetter("unsharded.grad"), attrgetter("requires_grad"), \
    attrgetter("grad_acc")
_PLAIN = {torch.Tensor}
_first, _shard_numel_of, _numel_of = itemgetter(0), attrgetter("shard_numel"), attrgetter("numel")
_local_shape_of, _local_stride_of = attrgetter("local_shape"), attrgetter("local_stride")
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled
_make_wrapper = torch.Tensor._make_wrapper_subclass

PREPARED_SCATTER = register(
    "fsdp.prepared_scatter",
    shortcuts="FSDP's reduce-scatter of a group's gradients through collectives.allocate, packing.pack_ranks' "
              "checks and start_reduce_scatter (buffer, signature look-up and MPI arguments every backward)",
    decided_by="the group's settings (GradientReduction.prepare_scatter): host gradients, 2+ shard ranks, "
               "torch's default collective, MPI progress off; and the backward reducing every sharded parameter",
)


class GradientReduction:
    """``post_backward``, ``finish_reduce`` and their state; the fields (``params``, ``info``,
    ``_pending``, ``_scatters``, the ``set_*`` switches...) are ``ParamGroup.__init__``'s."""

    def post_backward(self) -> None:
        """Start reduce-scattering the unsharded gradients (or keep them while gradient
        sync is off); reshard if ``reshard_after_backward``."""
        params = self.params
        try:  # the common case without a Python call per parameter (C-level maps): every parameter
            # trainable with a plain gradient, none held from earlier backwards, nothing replicated
            grads = list(map(_unsharded_grad_of, params))
        except AttributeError:  # a parameter not unsharded
            grads = None
        if (grads is not None and set(map(type, grads)) == _PLAIN and not self._replicated
                and all(map(_requires_grad_of, params)) and all(map(is_, map(_grad_acc_of, params), repeat(None)))):
            for p in params:
                p.unsharded.grad = None
        else:
            params, grads = self._take_grads()
        # HSDP without the all-reduce: replicated parameters' gradients wait unreduced
        skip_all_reduce = not self.requires_all_reduce and self.info.replicate_comm is not None
        hold = not self.requires_gradient_sync or skip_all_reduce
        if hold:
            for p, g in zip(params, grads):
                if p.replicated or not self.requires_gradient_sync:
                    p.grad_acc = g
        if self.requires_gradient_sync and params:
            if self._pending is not None:  # a reduction left running (set_is_last_backward(False)) ends first
                self.finish_reduce()
            self._start_reduce([(p, g) for p, g in zip(params, grads) if not (p.replicated and hold)]
                               if hold and self._replicated else list(zip(params, grads)))
        if self.reshard_after_backward:
            self.reshard()

    def _take_grads(self) -> tuple[list[FSDPParam], list[torch.Tensor]]:
        """The parameters with a gradient to reduce and their plain gradients (this backward's,
        plus what earlier ones held), taken off the unsharded parameters."""
        params, grads = [], []
        for p in self.params:
            unsharded = p.unsharded
            g = unsharded.grad if unsharded is not None and p.requires_grad else None
            if g is None and p.grad_acc is None and self.reduce_scatter_unused_params and unsharded is not None \
                    and p.requires_grad:
                g = torch.zeros(p.shape, dtype=p.param_dtype, device=self.device)  # a term every rank sends
            if g is None and p.grad_acc is None:
                continue
            params.append(p)
            if g is None:  # only what earlier backwards held (this one gave it no gradient)
                g, p.grad_acc = p.grad_acc, None
            else:
                unsharded.grad = None
                if type(g) is not torch.Tensor:  # (no call for a plain gradient or one in the parameter's layout)
                    if type(g) is DTensor or isinstance(g, DTensor):
                        spec = p.unsharded_spec
                        g = g._local_tensor if spec is not None and g._spec.placements == spec.placements \
                            else p.local_grad(g)
                    if type(g) is not torch.Tensor:
                        g = p.plain_grad(g)
                if p.grad_acc is not None:
                    g, p.grad_acc = g + p.grad_acc, None
            grads.append(g)
        return params, grads

    def _start_reduce(self, params: list[tuple[FSDPParam, torch.Tensor]]) -> None:
        """One reduce-scatter for the sharded parameters' gradients, one all-reduce for
        the replicated ones'."""
        world = self.info.shard_size
        sharded, replicated = params, []
        if self._replicated:
            sharded = [(p, g) for p, g in params if not p.replicated]
            replicated = [(p, g) for p, g in params if p.replicated]
        pre, _, _ = self._factors()
        scatter = reduce = None
        enabled = _grad_enabled()
        _set_grad_enabled(False)
        try:
            prepared = self._scatter
            if (prepared is not None and len(sharded) == prepared.count and settings.fast_paths
                    and self.custom_reduce_scatter is None and progress.mode() == "off"):
                PREPARED_SCATTER.hits += 1
                scatter = prepared.start(sharded, pre)
            elif sharded:
                total = sum(map(_shard_numel_of, map(_first, sharded)))
                device = sharded[0][1].device
                send = collectives.allocate(self.custom_reduce_scatter, (world * total,), self.reduce_dtype, device,
                                            reusable=True)
                packing.pack_ranks(send.view(world, total), sharded)
                if pre is not None:
                    collectives.divide(send, pre)
                scatter = collectives.start_reduce_scatter(self.custom_reduce_scatter, send, self._scatters)
            if replicated:
                flat = torch.cat([g.reshape(-1).to(self.reduce_dtype) for _, g in replicated])
                collectives.divide(flat, pre)
                reduce = collectives.start_all_reduce(flat, self.info.mesh.comm_for(tuple(range(self.info.mesh.ndim))))
        finally:
            _set_grad_enabled(enabled)
        self._pending = (scatter, list(map(_first, sharded)), reduce, list(map(_first, replicated)))

    def use_separate_reduce_scatter(self, enable: bool) -> None:
        """Reduce-scatter over a duplicate of the shard communicator (``enable``) or the
        shard communicator itself. Collective over the shard ranks the first time."""
        self.reduce_scatter_comm = self.info.separate_comm() if enable else self.info.shard_comm
        self._scatters = collectives.reduce_scatters(self.reduce_scatter_comm)
        self.prepare_scatter()

    def prepare_scatter(self) -> None:
        """The group's ``collectives.GroupScatter`` (``_scatter``, taken by ``_start_reduce``
        as ``PREPARED_SCATTER`` while torch's default collective and MPI progress ``"off"``
        are set) where its gradients reduce on the host over 2+ ranks of ``reduce_scatter_comm``."""
        comm, sharded = self.reduce_scatter_comm, [p for p in self.params if not p.replicated]
        usable = sharded and comm.size > 1 and self.device.type == "cpu" and self.reduce_dtype is not None
        self._scatter = collectives.GroupScatter(sharded, comm, self.reduce_dtype) if usable else None

    def _factors(self) -> tuple[float | None, float | None, float | None]:
        """``collectives.divide_factors`` of the group's settings, computed again only when
        one of them changed (``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``)."""
        key = (self.gradient_divide_factor, self.reduce_dtype, self.force_sum_reduction)
        if key != self._divide[0]:
            self._divide = (key, collectives.divide_factors(self.info.dp_size, self.gradient_divide_factor,
                                                                 self.reduce_dtype, self.force_sum_reduction,
                                                                 self.info.shard_size))
        return self._divide[1]

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and (HSDP) the all-reduce over the replicate dim,
        scale, run the all-reduce hook, and add the shards to the parameters' ``.grad``.
        Under HSDP with ``requires_all_reduce`` off, the reduce-scattered sum is kept
        (summed over backwards) and all-reduced by the next backward that has it on."""
        if self._pending is None:
            return
        scatter, sharded, reduce, replicated = self._pending
        self._pending = None
        _, with_comm, post = self._factors()
        outputs: list[tuple[torch.Tensor, list[FSDPParam], list[int]]] = []
        if scatter is not None:
            out = scatter.wait()
            if self.info.replicate_comm is not None and not self.requires_all_reduce:
                self._partial = out if self._partial is None else self._partial.add_(out)
            else:
                if self._partial is not None:
                    out, self._partial = out.add_(self._partial), None
                if self.info.replicate_comm is not None:
                    collectives.start_all_reduce(out, self.info.replicate_comm).wait()
                outputs.append((out, sharded, list(map(_shard_numel_of, sharded))))
        if reduce is not None:
            outputs.append((reduce.wait(), replicated, list(map(_numel_of, replicated))))
        for flat, params, sizes in outputs:
            if with_comm is not None:  # (no call for a factor that is not there)
                collectives.divide(flat, with_comm)
            if self.all_reduce_hook is not None:
                self.all_reduce_hook(flat)
            if post is not None:
                collectives.divide(flat, post)
            to_device = self.offload_to or flat.device
            flat = flat.contiguous()  # (a custom collective's output may be strided)
            # the shards' views: one C-level map (no Python call per parameter)
            views = map(flat.as_strided, map(_local_shape_of, params), map(_local_stride_of, params),
                        accumulate(sizes, initial=flat.storage_offset()))
            for p, local in zip(params, views):
                if local.dtype != p.orig_dtype or local.device != to_device:
                    local = local.to(device=to_device, dtype=p.orig_dtype)
                if p.sharded.grad is None:  # ``DTensor(local, p.spec)``, its wrapper made inline (a call less each)
                    spec = p.spec
                    grad = _make_wrapper(DTensor, spec.shape, strides=spec.stride, dtype=spec.dtype,
                                         device=local.device, layout=local.layout)
                    grad._local_tensor, grad._spec = local, spec
                    p.sharded.grad = grad
                else:
                    p.sharded.grad._local_tensor.add_(local)
                hooks = p.sharded._post_accumulate_grad_hooks
                if hooks:  # as torch's FSDP2 runs them once the shard's gradient is in (optimizer in backward)
                    for hook in tuple(hooks.values()):
                        hook(p.sharded)

    @property
    def reducing(self) -> bool:
        """A reduce-scatter has started and ``finish_reduce`` has not run yet."""
        return self._pending is not None

    @property
    def holds_grads(self) -> bool:
        """Gradients kept unreduced by backwards with gradient sync off."""
        return not all(map(is_, map(_grad_acc_of, self.params), repeat(None)))  # (C-level: no call per item)

    @property
    def has_pending_grads(self) -> bool:
        """Some unsharded gradients arrived that ``post_backward`` has not taken yet."""
        try:  # every parameter unsharded before (the common case: C-level maps, no call per parameter)
            return not all(map(is_, map(_unsharded_grad_of, self.params), repeat(None)))
        except AttributeError:  # some not yet (None has no grad)
            return any([p.unsharded is not None and p.unsharded.grad is not None for p in self.params])
