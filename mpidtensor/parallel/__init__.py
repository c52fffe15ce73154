"""Tensor parallelism on modules (the API of ``torch.distributed.tensor.parallel``)."""
from .api import parallelize_module
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["ColwiseParallel", "ParallelStyle", "RowwiseParallel", "parallelize_module"]
