"""Pipeline parallelism on MPI, with torch's ``torch.distributed.pipelining`` API.

``PipelineStage`` wraps one stage's module; a schedule (``ScheduleGPipe``,
``Schedule1F1B``, ...) gives each rank its ordered actions and one runtime runs them,
moving activations and gradients as non-blocking MPI messages on the pipeline group
(docs/pipelining.md).
"""
from .microbatch import TensorChunkSpec
from .schedule import PipelineScheduleMulti, PipelineScheduleSingle
from .single import Schedule1F1B, ScheduleGPipe
from .stage import PipelineStage

__all__ = [
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "TensorChunkSpec",
]
