"""``PipelineStage``: one stage's module and its forward and backward on micro-batches.

A stage computes; it does not communicate (the runtime moves its inputs, outputs and
gradients, :mod:`.runtime`). What it keeps per micro-batch between its forward and its
backward is the stage's outputs and the inputs whose gradients go back upstream.

Backward comes whole (``B``: ``torch.autograd.backward`` from the outputs, gradients
accumulating in the parameters' ``.grad`` across micro-batches) or split for the
zero-bubble schedules: ``I`` computes only the input gradients, so they can be sent at
once, and keeps the gradients ``W`` needs to compute, later, only the weight gradients
(:mod:`.split_backward`: the graph is walked once between the two, and analysed once
per graph shape for the stage); a ``dw_builder`` replaces ``W``, as in torch.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from mpi4py import MPI
from torch import nn
from torch.utils import _pytree as pytree

from . import crossing, fsdp_sync, split_backward
from .meta import Meta, fmt as _fmt, grad_carrying, metas_of

__all__ = ["PipelineStage", "resolve_group"]


def resolve_group(group: Any) -> MPI.Intracomm:
    """The MPI communicator of a pipeline ``group``: ``None`` (the world), an MPI
    communicator, a 1-D ``DeviceMesh`` (``mesh["pp"]``) or a process group of
    ``mpidtensor.backend.process_group``."""
    from ..mesh.device_mesh import DeviceMesh

    if group is None:
        return MPI.COMM_WORLD
    if isinstance(group, MPI.Intracomm):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a pipeline group must be a 1-D mesh (e.g. mesh['pp']), got a {group.ndim}-D mesh "
                             f"with dims {group.mesh_dim_names}")
        return group.get_group()
    comm = getattr(group, "comm", None)
    if isinstance(comm, MPI.Intracomm):
        return comm
    raise TypeError(f"group must be None, an MPI communicator, a 1-D DeviceMesh or an MPI process group, "
                    f"got {type(group).__name__}")


def as_tuple(output: Any) -> tuple:
    """A stage's output as the tuple of what it passes on (torch's convention)."""
    if isinstance(output, tuple):
        return output
    if isinstance(output, list):
        return tuple(output)
    return (output,)


class PipelineStage:
    """One stage of a pipeline (torch's ``PipelineStage``, same arguments).

    ``group`` is the pipeline group (see :func:`resolve_group`). ``input_args`` /
    ``output_args`` (example tensors of one micro-batch) fix the shapes that cross stages;
    where absent they are inferred on the first step. DTensors cross stages as torch's do
    (:mod:`.crossing`): ``get_mesh(dim_names, None)`` may name the mesh a received
    DTensor lives on; by default it is found among the meshes this rank holds.
    ``output_grads`` and ``input_grads`` are accepted for torch's signature: a gradient
    has its tensor's shape, dtype and placements here.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device | str,
                 input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
                 output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
                 output_grads: Any = None, input_grads: Any = None, group: Any = None,
                 dw_builder: Callable[[], Callable[..., None]] | None = None, get_mesh: Any = None) -> None:
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.comm = resolve_group(group)
        self.group_rank = self.comm.rank
        self.group_size = self.comm.size
        self.dw_builder = dw_builder
        self.given_inputs: list[Meta] | None = metas_of(input_args) if input_args is not None else None
        self.given_outputs: list[Meta] | None = metas_of(output_args) if output_args is not None else None
        self.get_mesh = get_mesh
        self._given_meshes = crossing.meshes_of(as_tuple(input_args) if input_args is not None else ())
        self.inputs_meta: list[Meta] | None = None  # fixed by the first step (pipelining.meta)
        self.outputs_meta: list[Meta] | None = None
        self.input_meshes: list = []  # this rank's mesh of each received DTensor (None: a plain tensor)
        self.has_backward = False
        self.output_chunks: list[Any] = []
        self.fwd_cache: dict[int, tuple[tuple, list[torch.Tensor]]] = {}
        self._deferred: dict[int, Callable[[], None]] = {}
        self._splitter = split_backward.Splitter()  # I/W plans per graph shape, kept across steps
        self._autograd_params: list[torch.Tensor] | None = None  # found at a step's first I
        self._carrying: tuple = (None, [])  # (outputs_meta, the positions of its outputs that carry a gradient)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, rank {self.group_rank} of {self.group_size})"

    def own_meshes(self) -> list:
        """The meshes of the stage's DTensor parameters, buffers and ``input_args``: where a
        received DTensor's mesh is looked for first."""
        return crossing.meshes_of([*self.submod.parameters(), *self.submod.buffers()]) + self._given_meshes

    def clear_runtime_states(self) -> None:
        """Forget the previous step's micro-batches."""
        self.output_chunks.clear()
        self.fwd_cache.clear()
        self._deferred.clear()
        self._autograd_params = None

    # -- forward ------------------------------------------------------------------------
    def forward_one_chunk(self, mb: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True) -> Any:
        """Run the module on micro-batch ``mb`` (its received or first-stage inputs) and keep
        what its backward needs."""
        output = self.submod(*args, **(kwargs or {}))
        outputs = (output,) if type(output) is torch.Tensor else as_tuple(output)
        if save_forward_output and self.is_last:
            # for the merged output; without its graph when the step trains (its backward
            # consumes the graph, which would otherwise hold until the next step the received
            # inputs, through their AccumulateGrad nodes, and what a split backward retained)
            self.output_chunks.append(_detached(output) if self.has_backward else output)
        if self.has_backward:
            if len(args) == 1:  # the common case, without a comprehension
                x = args[0]
                inputs = [x] if isinstance(x, torch.Tensor) and x.requires_grad else []
            else:
                inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            self.fwd_cache[mb] = (outputs, inputs)
        return output

    def check_outputs(self, outputs: tuple) -> None:
        """``ValueError`` unless ``outputs`` match the shapes and dtypes fixed at the first
        step (local and cheap: a comparison of tuples before each send)."""
        expected = self.outputs_meta
        if len(outputs) == len(expected):  # plain tensors: compared without building their metas
            for o, m in zip(outputs, expected):
                if type(o) is not torch.Tensor or m.dist is not None or o.dtype != m.dtype or o.shape != m.shape:
                    break
            else:
                return
        found = metas_of(outputs)
        if found != expected:
            raise ValueError(f"stage {self.stage_index} output changed since the first step: it sent "
                             f"{_fmt(self.outputs_meta)} and now gives {_fmt(found)}")

    # -- backward -----------------------------------------------------------------------
    def _roots(self, mb: int, loss: torch.Tensor | None, grads: list[torch.Tensor] | None):
        outputs, inputs = self.fwd_cache.pop(mb)
        if self.is_last:
            if loss is None:
                raise RuntimeError(f"stage {self.stage_index} is the last: its backward needs a loss (loss_fn)")
            return [loss], None, inputs
        carrying = self._carrying
        if carrying[0] is not self.outputs_meta:  # once per fixing of the shapes
            carrying = self._carrying = (self.outputs_meta, [i for i, m in enumerate(self.outputs_meta)
                                                             if grad_carrying(m)])
        roots, root_grads = [], []
        for i, g in zip(carrying[1], grads):
            o = outputs[i]
            if o.requires_grad:  # one gradient came for each output that carries one
                roots.append(o)
                root_grads.append(g if type(o) is torch.Tensor else crossing.grad_received(g, o))
        return roots, root_grads, inputs

    def backward_one_chunk(self, mb: int, loss: torch.Tensor | None = None,
                           grads: list[torch.Tensor] | None = None, full_backward: bool = True) -> list[torch.Tensor]:
        """Backward of micro-batch ``mb`` from ``loss`` (last stage) or the gradients of its
        outputs; the gradients of its received inputs (zeros where unused) as they travel
        upstream (:func:`.crossing.grad_to_send`). With ``full_backward=False`` only those
        (``I``); the weight gradients wait for :meth:`backward_weight_one_chunk` (``W``)."""
        roots, root_grads, inputs = self._roots(mb, loss, grads)
        if full_backward or self.dw_builder is not None:
            if roots:
                torch.autograd.backward(roots, root_grads)
            if not full_backward:
                self._deferred[mb] = self.dw_builder()
            return _to_send([x.grad for x in inputs], inputs)
        if self._autograd_params is None:  # once a step: the module's parameters do not change within one
            self._autograd_params = fsdp_sync.autograd_parameters(self.submod)
        got, self._deferred[mb] = self._splitter.backward_input(roots, root_grads, inputs, self._autograd_params)
        return _to_send(got, inputs)

    def backward_weight_one_chunk(self, mb: int) -> None:
        """The weight gradients of micro-batch ``mb`` (after its ``I``)."""
        self._deferred.pop(mb)()

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the parameters' gradients by ``grad_scale_factor`` (the micro-batch count
        when the loss is a mean, as torch's schedules do with ``scale_grads=True``)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """End of a step's backwards (torch's name): a ``fully_shard``-ed module reduces the
        gradients its backwards held (:func:`.fsdp_sync.reduce_held`), then the gradients
        are divided by ``grad_scale_factor``."""
        fsdp_sync.reduce_held(self.submod)
        self.scale_grads(grad_scale_factor)


def _detached(output: Any) -> Any:
    """``output`` with each of its tensors detached."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, output)


def _to_send(grads: list[torch.Tensor | None], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of a stage's received ``inputs`` as they travel upstream (zeros where
    unused; :func:`.crossing.grad_to_send`; a plain tensor's as it is)."""
    out = []
    for g, x in zip(grads, inputs):
        if g is None:
            g = torch.zeros_like(x)
        out.append(g if type(x) is torch.Tensor else crossing.grad_to_send(g, x))
    return out
