"""Hugging Face transformers' tensor-parallel plans as mpidtensor styles.

A transformers model names its tensor parallelism as a plan of style strings per module
pattern (``model.tp_plan``, built from ``config.base_model_tp_plan``: ``"model.layers.*.
self_attn.q_proj": "colwise"``, ...), which transformers applies itself with torch's
DTensor (``from_pretrained(tp_plan="auto")``). :func:`from_hf_plan` maps such a plan to
mpidtensor's styles, so the same model is sharded on an MPI mesh::

    parallelize_module(model, mesh, from_hf_plan(model.tp_plan))

Expert-parallel plans (``model.ep_plan``: ``ep_dispatch_experts``, ``grouped_gemm``) map to
:class:`ExpertParallel`. The packed styles map to :mod:`.fused`'s: ``packed_colwise`` and
``packed_rowwise`` on a module to :class:`PackedColwiseParallel` / :class:`PackedRowwiseParallel`
(weights ``_StridedShard``), and ``moe_tp_experts`` on an experts module to
:class:`ExpertTensorParallel`, which shards that module's parameters by the plan's entries
for them (``experts.gate_up_proj: packed_colwise``, ``experts.down_proj: rowwise``).
"""
from __future__ import annotations

from typing import Callable, Mapping

from torch import nn

from ..tensor.placements import Partial, Replicate
from .api import matching_submodules
from .experts import Dispatch, ExpertParallel
from .fused import PARAM_STYLES, ExpertTensorParallel, PackedColwiseParallel, PackedRowwiseParallel
from .style import PrepareModuleOutput
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
    # fused projections side by side (gate and up): each part sharded, a _StridedShard
    "packed_colwise": PackedColwiseParallel,
    "packed_rowwise": PackedRowwiseParallel,
}
# the expert-parallel plan's (``model.ep_plan``): whole experts per rank
_EXPERT_STYLES = ("ep_dispatch_experts", "grouped_gemm", "moe_tp_experts")


def from_hf_plan(tp_plan: Mapping[str, str], *, expert_dispatch: Dispatch = "all_to_all",
                 model: nn.Module | None = None) -> dict[str, ParallelStyle]:
    """``tp_plan`` (module pattern -> transformers style string) as a plan of mpidtensor styles
    for :func:`parallelize_module`, one new style per entry. A ``ValueError`` names the
    styles that have no mpidtensor counterpart (raised alike on every rank: the plan is
    the same everywhere).

    An expert-parallel plan (``model.ep_plan``) translates too: its experts module
    (``ep_dispatch_experts``) becomes :class:`ExpertParallel` with ``expert_dispatch``
    (``"all_to_all"`` when each rank holds its own tokens, ``"all_reduce"`` when the mesh
    is a tensor-parallel group sharing them), which shards all the module's weights; the
    weights' own ``grouped_gemm`` entries must each belong to such a module.

    ``model``: drop the entries that name none of its submodules, as transformers skips
    them (a plan covers an architecture's variants: Qwen2-MoE's names dense MLPs that a
    model of MoE layers only has not; ``parallelize_module`` refuses such keys)."""
    if not isinstance(tp_plan, Mapping):
        raise TypeError(f"from_hf_plan expects a mapping of module patterns to style strings, got {type(tp_plan).__name__}")
    unknown = sorted({s for s in tp_plan.values() if s not in _STYLES and s not in _EXPERT_STYLES})
    if unknown:
        raise ValueError(f"no mpidtensor style for the transformers plan styles {unknown}")
    tp_experts = {key for key, style in tp_plan.items() if style == "moe_tp_experts"}
    if model is not None:  # a weight, not a module: grouped_gemm's, or a moe_tp_experts module's
        tp_plan = {key: style for key, style in tp_plan.items() if matching_submodules(model, key)
                   or style == "grouped_gemm" or key.rpartition(".")[0] in tp_experts}
        tp_experts = {key for key in tp_experts if key in tp_plan}
    owners = {key for key, style in tp_plan.items() if style == "ep_dispatch_experts"}
    orphans = sorted(key for key, style in tp_plan.items()
                     if style == "grouped_gemm" and key.rsplit(".", 1)[0] not in owners)
    if orphans:
        raise ValueError(f"grouped_gemm weights {orphans} have no ep_dispatch_experts module in the plan")
    owned = {key: style for key, style in tp_plan.items() if key.rpartition(".")[0] in tp_experts}  # their weights
    unplaceable = sorted(f"{key}: {style}" for key, style in owned.items() if style not in PARAM_STYLES)
    if unplaceable:
        raise ValueError(f"moe_tp_experts weights with no parameter style of {PARAM_STYLES}: {unplaceable}")
    plan: dict[str, ParallelStyle] = {}
    for key, style in tp_plan.items():
        if style == "ep_dispatch_experts":
            plan[key] = ExpertParallel(dispatch=expert_dispatch)
        elif style == "moe_tp_experts":
            plan[key] = ExpertTensorParallel({k.rpartition(".")[2]: s for k, s in owned.items()
                                              if k.rpartition(".")[0] == key})
        elif style != "grouped_gemm" and key not in owned:  # those are sharded by their module's style
            plan[key] = _STYLES[style]()
    return plan
