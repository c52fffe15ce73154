"""torch's ``torch.distributed.tensor.experimental._context_parallel._attention``: the
names frameworks import from it (torchtitan: ``flex_cp_allgather``), mapped onto
mpidtensor's ring attention. The code is in ``api``, ``entry``, ``dispatcher`` and
``balancers``."""
from .api import _cp_options, context_parallel, context_parallel_unshard, set_rotate_method
from .balancers import _HeadTailLoadBalancer, _LoadBalancer, _PTRRLoadBalancer
from .dispatcher import _disable_context_parallel_dispatcher, _enable_context_parallel_dispatcher
from .entry import _context_parallel_shard, flex_cp_allgather

__all__ = [
    "_HeadTailLoadBalancer", "_LoadBalancer", "_PTRRLoadBalancer", "_context_parallel_shard", "_cp_options",
    "_disable_context_parallel_dispatcher", "_enable_context_parallel_dispatcher", "context_parallel",
    "context_parallel_unshard", "flex_cp_allgather", "set_rotate_method",
]
