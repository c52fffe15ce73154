"""Automatic splitting: ``pipeline``, ``Pipe``, ``SplitPoint``, ``pipe_split``, ``build_stage``.

The model is traced and cut by torch's own tracer (``torch.distributed.pipelining``'s
``Pipe``, a dependency like the rest of torch); the stages it yields run here, on
:class:`.stage.PipelineStage` and the MPI runtime. The runtime moves tensors between
neighbouring stages only, so each stage must take exactly what the previous one returns,
in order (the first stage: the model's positional inputs); a graph with skip connections
across stages is refused by :func:`build_stage`, naming the stage.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.distributed.pipelining import SplitPoint, pipe_split
from torch.distributed.pipelining import pipeline as _torch_pipeline

from .stage import PipelineStage

__all__ = ["Pipe", "SplitPoint", "build_stage", "pipe_split", "pipeline"]


class Pipe:
    """A model cut into stages (torch's ``Pipe`` inside): ``num_stages``,
    ``get_stage_module(i)`` (parameter names as in the model), ``info()`` and
    ``build_stage(i, device, group)``."""

    def __init__(self, traced: Any) -> None:
        self._traced = traced
        self.split_gm = traced.split_gm
        self.num_stages: int = traced.num_stages

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        return self._traced.get_stage_module(stage_idx)

    def info(self) -> Any:
        return self._traced.info()

    def build_stage(self, stage_index: int, device: torch.device | str, group: Any = None) -> PipelineStage:
        return build_stage(self.get_stage_module(stage_index), stage_index, self.info(), device, group)


def pipeline(module: nn.Module, mb_args: tuple, mb_kwargs: dict | None = None,
             split_spec: dict[str, SplitPoint] | None = None,
             split_policy: Callable[[fx.GraphModule], fx.GraphModule] | None = None) -> Pipe:
    """Trace ``module`` on one micro-batch's inputs and cut it at ``split_spec`` (submodule
    name -> ``SplitPoint``), ``split_policy`` or its ``pipe_split()`` calls (torch's
    arguments and meaning)."""
    return Pipe(_torch_pipeline(module, mb_args, mb_kwargs, split_spec=split_spec, split_policy=split_policy))


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: Any, device: torch.device | str,
                group: Any = None) -> PipelineStage:
    """The :class:`PipelineStage` of a traced pipeline's stage ``stage_index`` (torch's
    ``build_stage``); ``NotImplementedError`` when the stage takes inputs other than the
    previous stage's outputs, in order."""
    calls = [n for n in pipe_info.graph.nodes if n.op == "call_module"]
    if len(calls) != pipe_info.num_stages:
        raise ValueError(f"the pipe's graph has {len(calls)} stages, its info says {pipe_info.num_stages}")
    problem = _wiring_problem(calls, stage_index)
    if problem:
        raise NotImplementedError(f"stage {stage_index} of the traced pipeline {problem}: the MPI pipeline "
                                  "moves tensors between neighbouring stages only (no skip connections)")
    return PipelineStage(stage_module, stage_index, pipe_info.num_stages, device, group=group)


def _wiring_problem(calls: list[fx.Node], i: int) -> str | None:
    node = calls[i]
    if node.kwargs:
        return "takes keyword inputs"
    if i == 0:
        return None if all(a.op == "placeholder" for a in node.args) else "mixes model inputs with other values"
    prev = calls[i - 1]
    if list(node.args) == [prev]:
        return None
    indices = [a.args[1] if isinstance(a, fx.Node) and a.op == "call_function" and a.target is operator.getitem
               and a.args[0] is prev else None for a in node.args]
    if indices != list(range(len(node.args))):
        return "takes inputs other than all of the previous stage's outputs in order"
    users = [u for u in prev.users if u.op == "call_function" and u.target is operator.getitem]
    if len(users) != len(node.args):
        return "leaves some of the previous stage's outputs to later stages"
    return None
