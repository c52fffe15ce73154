"""Hugging Face transformers' tensor-parallel plans as mpidtensor styles.

A transformers model names its tensor parallelism as a plan of style strings per module
pattern (``model.tp_plan``, built from ``config.base_model_tp_plan``: ``"model.layers.*.
self_attn.q_proj": "colwise"``, ...), which transformers applies itself with torch's
DTensor (``from_pretrained(tp_plan="auto")``). :func:`from_hf_plan` maps such a plan to
mpidtensor's styles, so the same model is sharded on an MPI mesh::

    parallelize_module(model, mesh, from_hf_plan(model.tp_plan))

The mixture-of-experts and packed-weight styles (``moe_tp_experts``, ``packed_colwise``,
``packed_rowwise``) need a strided-shard placement mpidtensor does not have; a plan that
uses them is refused with a ``ValueError`` naming them.
"""
from __future__ import annotations

from typing import Callable, Mapping

from ..placements import Partial, Replicate
from .prepare import PrepareModuleOutput
from .sequence import SequenceParallel
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["from_hf_plan"]

_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    # Linear column-wise, output sharded on its last dim
    "colwise": ColwiseParallel,
    "local_colwise": ColwiseParallel,
    # column-wise with the output gathered
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    # Linear row-wise on a last-dim-sharded input, output all-reduced
    "rowwise": RowwiseParallel,
    "local_rowwise": RowwiseParallel,
    # row-wise on a replicated input (each rank takes its slice)
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Embedding on replicated ids: vocabulary-sharded (partial sums all-reduced) or hidden-sharded (gathered)
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    # norms on a sequence-sharded input, local output
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    # a norm on this rank's heads (Qwen3's q_norm / k_norm): its input is a local block whose
    # rows it normalizes each on its own; SequenceParallel on a dim it does not normalize (the
    # batch dim) keeps its weight Replicate and sums the weight's gradient over the mesh, as
    # transformers' hook all-reduces it
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=0, use_local_output=True),
    # a module whose output is partial: all-reduced
    "all_reduce": lambda: PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
    "gather": lambda: PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
}


def from_hf_plan(tp_plan: Mapping[str, str]) -> dict[str, ParallelStyle]:
    """``tp_plan`` (module pattern -> transformers style string) as a plan of mpidtensor styles
    for :func:`parallelize_module`, one new style per entry. A ``ValueError`` names the
    styles that have no mpidtensor counterpart (raised alike on every rank: the plan is
    the same everywhere)."""
    if not isinstance(tp_plan, Mapping):
        raise TypeError(f"from_hf_plan expects a mapping of module patterns to style strings, got {type(tp_plan).__name__}")
    unknown = sorted({s for s in tp_plan.values() if s not in _STYLES})
    if unknown:
        raise ValueError(f"no mpidtensor style for the transformers plan styles {unknown}")
    return {key: _STYLES[style]() for key, style in tp_plan.items()}
