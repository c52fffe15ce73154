"""torch's older import path for context parallelism
(``torch.distributed.tensor.experimental._attention``, which recipes such as torchtitan's
import from); the code is in ``_context_parallel``."""
from ._context_parallel._attention import (
    _context_parallel_shard,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PTRRLoadBalancer,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)

__all__ = [
    "_HeadTailLoadBalancer", "_LoadBalancer", "_PTRRLoadBalancer", "_context_parallel_shard", "_cp_options",
    "_disable_context_parallel_dispatcher", "_enable_context_parallel_dispatcher", "context_parallel",
    "context_parallel_unshard", "set_rotate_method",
]
