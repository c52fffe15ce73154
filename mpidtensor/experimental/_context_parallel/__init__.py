"""Context parallelism: sequence-sharded attention (ring attention) over an MPI communicator."""
from .ring import ring_attention
from .api import context_parallel, context_parallel_unshard, set_rotate_method

__all__ = ["context_parallel", "context_parallel_unshard", "ring_attention", "set_rotate_method"]
