"""Schedule classes by torch's names: ``get_schedule_class("ZBVZeroBubble")`` (torchtitan
reads its schedule from a config string this way)."""
from __future__ import annotations

from .base import PipelineScheduleMulti, PipelineScheduleSingle, _PipelineSchedule
from .interleaved import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS
from .single import Schedule1F1B, ScheduleGPipe
from .vshape import ScheduleDualPipeV, ScheduleZBVZeroBubble

__all__ = ["get_schedule_class"]

_BY_NAME = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


def get_schedule_class(schedule_name: str) -> type[_PipelineSchedule]:
    """The schedule class of a name, case-insensitive, as torch maps them ("1F1B",
    "Interleaved1F1B", "ZBVZeroBubble", ...); ``ValueError`` naming the choices."""
    found = {name.lower(): cls for name, cls in _BY_NAME.items()}.get(schedule_name.lower())
    if found is None:
        raise ValueError(f"Unknown schedule name '{schedule_name}'. The valid options are {list(_BY_NAME)}")
    return found
