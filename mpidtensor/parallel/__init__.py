"""Tensor parallelism on modules (the API of ``torch.distributed.tensor.parallel``)."""
from .api import parallelize_module
from .experts import ExpertParallel
from .hf_plan import from_hf_plan
from .loss import loss_parallel
from .fused import ExpertTensorParallel, PackedColwiseParallel, PackedRowwiseParallel
from .style import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from .sequence import SequenceParallel
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = [
    "ColwiseParallel",
    "ExpertParallel",
    "ExpertTensorParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "from_hf_plan",
    "loss_parallel",
    "parallelize_module",
]
