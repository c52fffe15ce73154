"""``ExpertParallel``: a mixture-of-experts layer's experts split over a mesh, whole experts
per rank (Hugging Face transformers' expert-parallel plan: ``grouped_gemm`` on the expert
weights, ``ep_dispatch_experts`` on the experts module).

The style goes on the experts module, e.g. transformers' ``MixtralExperts``: its weights
are stacked per expert on dim 0 (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``,
biases ``[E, ...]``) and its forward takes ``(hidden_states, top_k_index, top_k_weights)``
with global expert ids, skipping an id equal to its ``num_experts`` (transformers' marker
for a route to another rank's expert). Every parameter becomes ``Shard(0)`` over the mesh,
``num_experts`` the local count, and each forward runs the module's own forward on the
local weights, by one of two dispatches:

* ``"all_to_all"`` (default): each rank holds its own tokens (expert parallelism over
  data-parallel ranks). The (token, expert) pairs go to the experts' ranks in one row
  exchange (``comm.exchange``, after one of the counts), run there top-1 with unit weights,
  come back in a second, and are weighted and summed on the sender. Backward runs the
  two exchanges in reverse.
* ``"all_reduce"``: every rank holds the same tokens (the experts split over a
  tensor-parallel group). Each rank runs its experts on the routes to them (others
  masked with weight 0) and one all-reduce sums the outputs; backward all-reduces the
  gradients of the tokens and routing weights (each rank's is a partial sum).

Expert ``e`` lives on rank ``e // (E / n)``; ``E`` must divide by the mesh size.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Literal

import torch
from torch import nn

from ..tensor.api import distribute_tensor
from ..tensor.dtensor import DTensor
from ..mesh import DeviceMesh
from ..comm import collectives
from ..comm.exchange import exchange_rows
from ..runtime.agreement import require_same
from ..tensor.placements import Shard
from .install import install, own_forward
from .style import ParallelStyle, require_1d_mesh, require_plain_parameters

__all__ = ["ExpertParallel"]

Dispatch = Literal["all_to_all", "all_reduce"]
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ExpertParallel(ParallelStyle):
    """Whole experts per rank of a 1-D mesh (module docstring); ``dispatch``: ``"all_to_all"``
    when each rank holds its own tokens, ``"all_reduce"`` when all hold the same ones."""

    _owns_parameters = True

    def __init__(self, *, dispatch: Dispatch = "all_to_all") -> None:
        if dispatch not in ("all_to_all", "all_reduce"):
            raise ValueError(f"ExpertParallel dispatch must be 'all_to_all' or 'all_reduce', got {dispatch!r}")
        self.dispatch = dispatch

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        require_1d_mesh(self, device_mesh)
        require_plain_parameters(self, module)
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or isinstance(experts, bool):
            raise TypeError(f"ExpertParallel needs an experts module with an int num_experts "
                            f"(transformers' *Experts), got {type(module).__name__}")
        params = dict(module.named_parameters(recurse=False))
        if not params:
            raise ValueError(f"ExpertParallel: {type(module).__name__} has no parameters of its own")
        stacked = {name: tuple(p.shape) for name, p in params.items() if p.ndim == 0 or p.shape[0] != experts}
        if stacked:
            raise ValueError(f"ExpertParallel: every parameter of {type(module).__name__} must stack its "
                             f"{experts} experts on dim 0; {stacked} do not")
        if experts % device_mesh.size():
            raise ValueError(f"ExpertParallel: {experts} experts do not split evenly over {device_mesh.size()} ranks")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        for name, param in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(param.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module._parameters[name] = nn.Parameter(shard, requires_grad=param.requires_grad)
        module.num_experts //= device_mesh.size()
        module._is_expert_parallel = True  # transformers' batched / grouped experts then skip foreign routes
        return install(module, ExpertsForward(device_mesh, self.dispatch, own_forward(module)))

    def __repr__(self) -> str:
        return f"ExpertParallel(dispatch={self.dispatch!r})"


class ExpertsForward:
    """``forward`` of an expert-parallel experts module (installed by a class swap,
    ``parallel.install``): the module's own forward (``inner``) on its local experts, by the
    dispatch of the module docstring. Not a fast path: there is no general DTensor path it
    stands in for (the tokens are each rank's own). It holds no state, so a deep copy of
    the model shares it (as the DTensors share the mesh)."""

    def __init__(self, mesh: DeviceMesh, dispatch: Dispatch, inner: Callable) -> None:
        self.mesh, self.dispatch, self.inner = mesh, dispatch, inner

    def __deepcopy__(self, memo: dict) -> "ExpertsForward":
        return self

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        return self._run(module, *args, **kwargs)

    def _run(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        hidden_states, top_k_weights = (t.to_local() if isinstance(t, DTensor) else t
                                        for t in (hidden_states, top_k_weights))
        comm, local = self.mesh.get_group(), module.num_experts
        if self.dispatch == "all_reduce":
            _require_same_tokens(hidden_states, top_k_index, comm)
        with _local_parameters(module):
            def experts(h, index, weights):
                return self.inner(module, h, index, weights, *args, **kwargs)
            if self.dispatch == "all_reduce":
                out = _all_reduce_dispatch(experts, hidden_states, top_k_index, top_k_weights, comm, local)
            else:
                out = _all_to_all_dispatch(experts, hidden_states, top_k_index, top_k_weights, comm, local)
        return out.to(hidden_states.dtype)


@contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their (differentiable) local shards for a forward."""
    shards = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    module._parameters.update({name: p.to_local() for name, p in shards.items()})
    try:
        yield
    finally:
        module._parameters.update(shards)


def _require_same_tokens(hidden: torch.Tensor, index: torch.Tensor, comm) -> None:
    """``ValueError`` on every rank unless all hold the same tokens and routes (compared by
    shape and sums, one small ``allgather``): summing the outputs of different batches
    would be silently wrong. The tokens' sum is of their bits as integers, wrapping: exact
    whatever the order of summation (threads), so equal data always agrees (and as fast
    as a float32 sum: 3.6 ms for 16M values here)."""
    bits = hidden.detach().contiguous().view(_INT_OF_SIZE[hidden.element_size()])
    total = bits.sum(dtype=torch.int64 if bits.element_size() == 8 else torch.int32)
    mine = (tuple(hidden.shape), total.item(), index.sum().item())
    require_same(comm, mine, lambda _: "ExpertParallel(dispatch='all_reduce') needs the same tokens on every "
                 "rank of its mesh; they differ (use dispatch='all_to_all' when each rank holds its own batch)")


def _require_routes_inside(ranks: list[int], experts: int) -> None:
    """``ValueError`` if ``ranks`` (which every rank computes alike) route outside the experts."""
    if ranks:
        raise ValueError(f"ExpertParallel: expert ids outside [0, {experts}) in the routes of ranks {ranks}")


def _all_reduce_dispatch(experts, hidden, index, weights, comm, local: int) -> torch.Tensor:
    """Every rank holds the same tokens: its experts on the routes to them, outputs summed."""
    outside = index.numel() and (int(index.min()) < 0 or int(index.max()) >= local * comm.size)
    _require_routes_inside(list(range(comm.size)) if outside else [], local * comm.size)  # same index everywhere
    hidden, weights = _SumGradient.apply(hidden, comm), _SumGradient.apply(weights, comm)
    first = comm.rank * local
    foreign = (index < first) | (index >= first + local)
    out = experts(hidden, torch.where(foreign, local, index - first), weights.masked_fill(foreign, 0.0))
    return _SumOutput.apply(out, comm)


def _all_to_all_dispatch(experts, hidden, index, weights, comm, local: int) -> torch.Tensor:
    """Each rank holds its own tokens: the (token, expert) pairs go to the experts' ranks and
    their outputs come back, weighted and summed per token on the sender."""
    tokens, top_k = index.shape
    routes = index.reshape(-1)
    order = torch.argsort(routes, stable=True)  # by expert, so by owner rank
    valid = (routes >= 0) & (routes < local * comm.size)
    outside = not bool(valid.all())
    counts = torch.bincount(routes[valid] if outside else routes, minlength=local * comm.size).view(comm.size, local)
    # the counts travel with a last column saying whether the sender has routes outside the
    # experts: every rank learns every rank's, so all raise alike before any token moves
    table = torch.cat([counts, counts.new_full((comm.size, 1), int(outside))], 1)
    arriving = exchange_rows(table, comm, send_rows=(1,) * comm.size, recv_rows=(1,) * comm.size)
    _require_routes_inside(arriving[:, local].nonzero().flatten().tolist(), local * comm.size)
    arriving = arriving[:, :local]
    send_rows, recv_rows = counts.sum(1).tolist(), arriving.sum(1).tolist()
    received = _Exchange.apply(hidden[order // top_k], comm, send_rows, recv_rows)
    ids = torch.arange(local, device=index.device).repeat(comm.size).repeat_interleave(arriving.reshape(-1))
    if received.shape[0]:
        out = experts(received, ids.unsqueeze(-1), received.new_ones(received.shape[0], 1))
    else:  # nothing to run here: a zero row through expert 0 keeps the backward exchanges connected
        out = experts(received.sum(0, keepdim=True), ids.new_zeros(1, 1), received.new_ones(1, 1))[:0]
    returned = _Exchange.apply(out, comm, recv_rows, send_rows)
    per_route = returned[torch.argsort(order)].view(tokens, top_k, -1)
    return (per_route * weights.unsqueeze(-1)).sum(1)


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward, the gradient summed over ``comm`` (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return collectives.all_reduce(grad.contiguous(), ctx.comm, "sum"), None


class _SumOutput(torch.autograd.Function):
    """Forward, the sum over ``comm``; backward, the identity (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm) -> torch.Tensor:
        return collectives.all_reduce(x.contiguous(), comm, "sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Exchange(torch.autograd.Function):
    """Rows to the ranks of ``send_rows``; backward, the gradient rows sent back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send_rows, ctx.recv_rows = comm, send_rows, recv_rows
        return exchange_rows(x.contiguous(), comm, send_rows=send_rows, recv_rows=recv_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = exchange_rows(grad.contiguous(), ctx.comm, send_rows=ctx.recv_rows, recv_rows=ctx.send_rows)
        return back, None, None, None
