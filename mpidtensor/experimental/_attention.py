"""torch's older import path for context parallelism
(``torch.distributed.tensor.experimental._attention``, which recipes such as torchtitan's
import from); the code is in ``_context_parallel``."""
from ._context_parallel import context_parallel, context_parallel_unshard, set_rotate_method
from ._context_parallel.api import _cp_options

__all__ = ["_cp_options", "context_parallel", "context_parallel_unshard", "set_rotate_method"]
