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

from torch import nn

from ..placements import Partial, Replicate
from .prepare import PrepareModuleOutput
from .sequence import SequenceParallel
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["ReplicatedWithGradAllReduce", "from_hf_plan"]


class ReplicatedWithGradAllReduce(SequenceParallel):
    """transformers' ``replicated_with_grad_allreduce``: the module's parameters replicated,
    its input this rank's local block, its output local, each parameter's gradient summed
    over the mesh (transformers all-reduces it in a hook). For modules that treat each row
    of the block on its own: Qwen3's per-head ``q_norm`` / ``k_norm``, or Apertus' xIELU
    activation with learnt scalars on the MLP's local columns, whose gradients are partial
    sums on each rank otherwise (plan it so: ``{"model.layers.*.mlp.act_fn":
    "replicated_with_grad_allreduce"}``; Apertus' own plan leaves it out).

    It is ``SequenceParallel`` along dim 0 (the local block taken as a row shard, so the
    parameters' gradients come out ``Partial`` and are all-reduced once), for any module.
    """

    def __init__(self) -> None:
        super().__init__(sequence_dim=0, use_local_output=True)

    def _check_module(self, module: nn.Module) -> None:
        """Any module: the plan's author vouches that it treats rows on their own."""

    def __repr__(self) -> str:
        return "ReplicatedWithGradAllReduce()"

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
    # a module on this rank's local block with replicated parameters (below)
    "replicated_with_grad_allreduce": lambda: ReplicatedWithGradAllReduce(),
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
