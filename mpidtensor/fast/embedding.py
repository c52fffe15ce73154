"""``RowwiseParallel`` ``nn.Embedding`` (vocabulary-parallel) run on the local block, as Megatron does.

The general path (input hook, ``nn.Embedding.forward`` on DTensors, output hook) looks the
tokens up through DTensor dispatch (a masked lookup, output ``Partial``), reduces the
output with the public ``redistribute``, and in backward computes the weight gradient of
the whole vocabulary on every rank (``embedding_dense_backward`` on replicated tokens).
Here one autograd Function does the masked lookup of this rank's rows, then one
all-reduce (output ``Replicate``) or reduce-scatter (output ``Shard(d)``, sequence
parallelism); backward, the output gradient is all-gathered first for a sharded output
and the gradient of this rank's rows alone is computed: a DTensor with the weight's spec.

A ``padding_idx`` is honoured by the rank holding that row: its gradient row stays zero,
as in one process. (torch 2.13's DTensor gives a vocabulary-parallel embedding a
``Replicate`` gradient of the whole vocabulary on every rank, with or without
``padding_idx``; so does the general path here.)

Taken per call when nothing needs the general path: fast paths on (``fast.registry``), a
plain ``nn.Embedding`` without ``max_norm``, ``scale_grad_by_freq`` or ``sparse``, its
weight on the style's mesh, C-contiguous, laid out so that the dispatcher's rule for
``aten.embedding`` looks replicated tokens up in place to a ``Partial`` sum (``Shard(0)``;
asked once per weight spec, ``fast.rules``), the tokens a plain integer tensor read as
replicated (or a replicated DTensor on that mesh), the output wanted replicated or sharded
on a token dim, not under ``torch.compile``. These facts are shared by all ranks.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor.layout import contiguous_strides
from ..tensor.dtensor import DTensor
from ..mesh import DeviceMesh
from ..tensor.placements import Partial, Placement, Replicate, Shard, normalize_placements
from ..tensor.spec import DTensorSpec
from .functions import compiler, direct_apply, dynamo_compiling
from .grads import param_grad
from .gather import Route, shard_route
from .linear import gather_reduced_grad, local_grad, reduce_partial, wrap_output
from .registry import register
from ..runtime.settings import settings
from .rules import keeps_layout

aten = torch.ops.aten

_REPLICATE = (Replicate(),)


class _VocabParallelEmbedding(torch.autograd.Function):
    """y = reduce(lookup of the tokens in rows [start, start + n), zeros elsewhere) over the
    mesh: all-reduce, or the reduce-scatter of ``route``; a DTensor of ``out_spec`` or local.
    ``padding``: the local row of the module's ``padding_idx`` (no gradient), or -1."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: DTensor, start: int, comm, route: Route | None,
                out_spec: DTensorSpec | None, padding: int = -1):
        w = weight._local_tensor
        rows = w.shape[0]
        outside = (tokens < start) | (tokens >= start + rows)
        rel = (tokens - start).masked_fill_(outside, 0)
        if rows:
            y = F.embedding(rel, w).masked_fill_(outside.unsqueeze(-1), 0)
        else:
            y = w.new_zeros((*tokens.shape, w.shape[1]))
        ctx.out_spec, ctx.weight, ctx.padding = out_spec, weight, padding
        ctx.to_save = (rel, outside)
        y = reduce_partial(ctx, y, comm, route)
        return wrap_output(y, out_spec)

    @staticmethod
    def backward(ctx, gy):
        gy = local_grad(gy, ctx.out_spec)
        rel, outside = ctx.saved_tensors
        gw = None
        if ctx.needs_input_grad[1]:
            gy = gather_reduced_grad(ctx, gy)
            weight = ctx.weight
            gy = gy.masked_fill(outside.unsqueeze(-1), 0)
            local = torch.ops.aten.embedding_dense_backward(gy, rel, weight._local_tensor.shape[0], ctx.padding,
                                                            False)
            gw = param_grad(ctx, 1, weight, local.to(weight.dtype), weight._spec)  # (on .grad: None)
        return None, gw, None, None, None, None, None


_vocab_parallel_embedding = direct_apply(_VocabParallelEmbedding, compiling_checked=True)  # (``_route`` asks)


EMBEDDING = register(
    "tp.embedding",
    shortcuts="RowwiseParallel nn.Embedding (vocabulary-parallel): the input hook, nn.Embedding.forward on "
              "DTensors (aten.embedding and embedding_dense_backward through dispatch), the output hook",
    decided_by="ops.nn's rule for aten.embedding of (weight, replicated tokens) keeps both in place and gives "
               "Partial (a masked lookup of this rank's rows)",
)


class LocalEmbeddingForward:
    """``forward`` of a ``RowwiseParallel`` ``nn.Embedding`` (installed by the style,
    ``parallel.install``): the local path when it applies (see the module docstring), else
    the style's general one."""

    def __init__(self, mesh: DeviceMesh, given: Placement, wanted: Placement, local_out: bool,
                 prepare_input: Callable, prepare_output: Callable) -> None:
        self.mesh, self.comm = mesh, mesh.comm_for((0,))
        self.given, self.wanted, self.local_out = given, wanted, local_out
        self.prepare_input, self.prepare_output = prepare_input, prepare_output
        self.starts: dict[DTensorSpec, int | None] = {}  # weight spec -> this rank's first row, or None: unfit
        self.outputs: dict[tuple, tuple | None] = {}  # tokens' shape -> (route, out spec), or None: general path

    def __deepcopy__(self, memo: dict) -> "LocalEmbeddingForward":
        twin = copy.copy(self)  # the mesh and the style's conversions are shared, as the DTensors' specs are
        twin.starts, twin.outputs = {}, {}
        return twin

    def __call__(self, module: nn.Embedding, args: tuple, kwargs: dict) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        route = self._route(module, x) if x is not None and settings.fast_paths else None
        if route is None:
            inputs = self.prepare_input(module, args, self.mesh)
            return self.prepare_output(module, nn.Embedding.forward(module, *inputs, **kwargs), self.mesh)
        EMBEDDING.hits += 1
        start, reduce_route, out_spec = route
        tokens = x._local_tensor if isinstance(x, DTensor) else x
        weight, padding = module.weight, module.padding_idx
        if padding is not None:  # nn.Embedding keeps it non-negative
            padding -= start
            if not 0 <= padding < weight._local_tensor.shape[0]:
                padding = -1  # another rank's row
        return _vocab_parallel_embedding(tokens, weight, start, self.comm, reduce_route,
                                         None if self.local_out else out_spec, -1 if padding is None else padding)

    def _route(self, module: nn.Embedding, x: Any) -> tuple | None:
        """(first row, reduce-scatter route or None for an all-reduce, out spec) when this call
        takes the local path, else None."""
        if isinstance(x, DTensor):
            if not (x._spec.mesh is self.mesh or x._spec.mesh == self.mesh) or x._spec.placements != _REPLICATE:
                return None
        elif type(x) is not torch.Tensor or self.given != Replicate():
            return None
        if x.dtype not in (torch.int64, torch.int32) or dynamo_compiling() or compiler._is_compiling_flag:
            return None
        weight = module.weight
        if not isinstance(weight, DTensor) or module.max_norm is not None or module.scale_grad_by_freq \
                or module.sparse:
            return None
        start = self.starts.get(weight._spec, False)
        if start is False:
            start = self.starts[weight._spec] = self._first_row(weight._spec)
        if start is None:
            return None
        key = (x.shape, weight.dtype)
        out = self.outputs.get(key, False)
        if out is False:
            out = self.outputs[key] = self._output(x.shape, weight._spec)
        return None if out is None else (start, *out)

    def _first_row(self, spec: DTensorSpec) -> int | None:
        """This rank's first vocabulary row for a weight on the style's mesh, C-contiguous (its
        gradient takes the spec), that the dispatcher's rule for ``aten.embedding`` looks
        replicated tokens up in where it lies, to a ``Partial`` sum (a masked lookup of this
        rank's rows); else None. (Asked for tokens of the mesh's size: the rule's verdict
        depends on placements, not on how many tokens.)"""
        on_mesh = spec.mesh is self.mesh or spec.mesh == self.mesh
        if not on_mesh or spec.stride != contiguous_strides(spec.shape):
            return None
        tokens = DTensorSpec(self.mesh, _REPLICATE, (self.mesh.size(),), (1,), torch.int64)
        if not keeps_layout(aten.embedding.default, (spec, tokens), self.mesh, [(Partial(),)]):
            return None
        return spec.local_shape_and_offset()[1][0]

    def _output(self, tokens_shape: torch.Size, weight_spec: DTensorSpec) -> tuple | None:
        """(reduce-scatter route or None for an all-reduce, out spec) for tokens of this shape,
        or None where the output is wanted sharded on the embedding dim (general path)."""
        shape = (*tokens_shape, weight_spec.shape[1])
        try:
            (wanted,) = normalize_placements((self.wanted,), 1, len(shape))
        except ValueError:
            return None  # out of range: the general path says why
        if wanted == Shard(len(shape) - 1):
            return None
        spec = DTensorSpec(self.mesh, (wanted,), shape, contiguous_strides(shape), weight_spec.dtype)
        return (shard_route(spec) if isinstance(wanted, Shard) else None), spec
