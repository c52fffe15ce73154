"""Pipeline stages of the Llama-style model of llama.py, and per-rank timelines.

``split_stages(model, num_stages)`` cuts a ``Transformer`` into ``LlamaStage`` modules
as torchtitan does: stage 0 keeps the token embedding, the last keeps the final norm and
the output projection, the blocks are spread as evenly as possible (earlier stages get
the extra ones). Each stage holds its blocks in a ``ModuleDict`` keyed by their index in
the whole model, so a stage's parameter names are the model's (``layers.3.attention.wq.
weight``): state dicts of the stages are pieces of the model's, and checkpoints saved at
one pipeline degree load at another, or into the whole model.

``shard_stage`` applies TP (the plan of ``parallelize_llama``, restricted to the stage's
modules) and FSDP (per block, then the stage) to one stage. Between stages the residual
stream, a sequence-sharded DTensor inside a stage, crosses as its plain local tensor,
re-wrapped as ``Shard(1)`` by the next stage.

``Timeline`` records when each stage's forward and backward run on this rank (marks at
the stage's entry and exit, whose gradients' arrivals are the backward's end and start), from
which ``bubble_fraction`` is measured: the share of a step a rank spends not computing.
The marks are tensor hooks (no autograd node, no copy).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from llama import Transformer, tp_plan

__all__ = ["LlamaStage", "Timeline", "split_stages", "stage_layers", "shard_stage", "theoretical_bubble"]


def stage_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """The block indices of each stage: contiguous, as even as possible (the first stages
    take one more when ``num_stages`` does not divide ``n_layers``). A stage may hold none
    (the first and last still hold the embedding and the output)."""
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (s < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


class LlamaStage(nn.Module):
    """One pipeline stage of a ``Transformer``: its blocks (by their model index), the
    embedding on the first stage, the final norm and output on the last."""

    def __init__(self, model: Transformer, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope", model.rope.clone(), persistent=False)
        self.tp_mesh = None  # set by shard_stage: re-wrap a local residual arriving from the previous stage
        self.timeline: Timeline | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        timeline = self.timeline
        if timeline is not None:
            timeline.forward_start()
        h = self.tok_embeddings(x) if self.first else x
        if self.tp_mesh is not None and not self.first:
            from mpidtensor import DTensor, Shard
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False)
        if timeline is not None:
            h = timeline.mark_backward_end(h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.last:
            h = self.output(self.norm(h))
        elif self.tp_mesh is not None:
            h = h.to_local()
        if timeline is not None:
            h = timeline.mark_backward_start(h)
            timeline.forward_end()
        return h


def split_stages(model: Transformer, num_stages: int, stages: list[int] | None = None) -> list[LlamaStage]:
    """``model`` cut into ``num_stages`` stages; only those of index in ``stages`` (all by
    default) are built. The stages share ``model``'s modules (deep-copy it first to keep it)."""
    parts = stage_layers(len(model.layers), num_stages)
    wanted = range(num_stages) if stages is None else stages
    return [LlamaStage(model, parts[s], s == 0, s == num_stages - 1) for s in wanted]


def shard_stage(stage: LlamaStage, tp_mesh=None, fsdp_mesh=None) -> LlamaStage:
    """TP + SP over ``tp_mesh`` (the plan of ``parallelize_llama`` for this stage's modules,
    logits replicated), then ``fully_shard`` per block and the stage over ``fsdp_mesh``.
    In place; returns ``stage``."""
    if tp_mesh is not None and tp_mesh.size() > 1:
        from mpidtensor.parallel import parallelize_module
        names = {name for name, _ in stage.named_modules()}
        plan = {k: v for k, v in tp_plan(_Shell(stage.cfg), loss_parallel=False).items() if k in names}
        parallelize_module(stage, tp_mesh, plan)
        stage.tp_mesh = tp_mesh
    if fsdp_mesh is not None:
        from mpidtensor.fsdp import fully_shard
        for layer in stage.layers.values():
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(stage, mesh=fsdp_mesh)
    return stage


@dataclass
class _Shell:
    """What ``tp_plan`` reads of a model: its config and its number of blocks."""

    cfg: object

    @property
    def layers(self) -> range:
        return range(self.cfg.n_layers)


@dataclass
class Timeline:
    """This rank's compute spans ``(kind, start, end)`` in one step (``time.perf_counter``)."""

    spans: list[tuple[str, float, float]] = field(default_factory=list)
    step_start: float = 0.0
    step_end: float = 0.0
    _open: dict[str, float] = field(default_factory=dict)

    def start_step(self) -> None:
        self.spans.clear()
        self._open.clear()
        self.step_start = time.perf_counter()

    def end_step(self) -> None:
        self.step_end = time.perf_counter()

    def forward_start(self) -> None:
        self._open["F"] = time.perf_counter()

    def forward_end(self) -> None:
        self.spans.append(("F", self._open.pop("F"), time.perf_counter()))

    def backward_start(self) -> None:
        self._open["B"] = time.perf_counter()

    def backward_end(self) -> None:
        start = self._open.pop("B", None)
        if start is not None:
            self.spans.append(("B", start, time.perf_counter()))

    def mark_backward_start(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (a stage's output), whose gradient's arrival starts the backward span (a
        tensor hook: no autograd node, no view)."""
        if h.requires_grad:
            h.register_hook(lambda grad: self.backward_start())
        return h

    def mark_backward_end(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (a stage's input, or its first result that needs a gradient), whose
        gradient's arrival ends the backward span."""
        if h.requires_grad:
            h.register_hook(lambda grad: self.backward_end())
        return h

    @property
    def busy(self) -> float:
        """Seconds of compute in the step (spans do not overlap on one rank)."""
        return sum(end - start for _, start, end in self.spans)

    @property
    def bubble_fraction(self) -> float:
        """The share of the step this rank did not compute."""
        total = self.step_end - self.step_start
        return max(0.0, 1.0 - self.busy / total) if total > 0 else 0.0


def theoretical_bubble(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle share of a step that GPipe, 1F1B and the interleaved schedules (``v``
    stages per rank) imply with equal stage costs and free communication:
    ``(p - 1) / (v m + p - 1)``."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)
