"""Pipeline parallelism on MPI, with torch's ``torch.distributed.pipelining`` API.

``PipelineStage`` wraps one stage's module; a schedule (``ScheduleGPipe``,
``Schedule1F1B``, ...) gives each rank its ordered actions and one runtime runs them,
moving activations and gradients as non-blocking MPI messages on the pipeline group
(docs/pipelining.md). The package is also torch's ``pipelining.schedules`` module under
the switch (its schedule classes, bases and ``get_schedule_class``).
"""
from .interleaved import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS
from .microbatch import TensorChunkSpec
from .runtime import StageFailed
from .base import (  # noqa: F401  (torch's private names, imported by torchtitan)
    PipelineScheduleMulti, PipelineScheduleSingle, _PipelineSchedule, _PipelineScheduleRuntime)
from .split import Pipe, SplitPoint, build_stage, pipe_split, pipeline
from .single import Schedule1F1B, ScheduleGPipe
from .stage import PipelineStage
from .vshape import ScheduleDualPipeV, ScheduleZBVZeroBubble
from .lookup import get_schedule_class

__all__ = [
    "Pipe",
    "SplitPoint",
    "build_stage",
    "pipe_split",
    "pipeline",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "StageFailed",
    "TensorChunkSpec",
    "get_schedule_class",
]
