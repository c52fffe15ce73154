"""The shapes and dtypes that cross stages (and the layouts of DTensors that do,
:mod:`.crossing`): found once, on the first step, then fixed.

Each stage's inputs come from its ``input_args`` or from what the previous stage sends;
its outputs from its ``output_args`` or from running it once on inputs of those shapes
(no gradients, the random state restored), as torch does. The stages do this in pipeline
order, passing the shapes on (a small message per hop); then one ``allgather`` over the
pipeline group lets every rank check every hop alike: a stage that sends what the next
one does not expect, or a stage that failed, raises the same error on every rank before
any data moves.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from mpi4py import MPI

from ..runtime import watchdog
from ..runtime.agreement import exchange, raise_listed
from ..tensor.dtensor import DTensor
from .crossing import DistMeta, dist_meta, meshes_for, rebuild


class Meta(NamedTuple):
    """Shape and dtype of one tensor crossing stages (a DTensor's local shape, and what
    rebuilds it: :mod:`.crossing`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dist: DistMeta | None = None


def metas_of(values: Any) -> list[Meta]:
    """The ``Meta`` of a tensor or of each tensor of a tuple or list; ``TypeError`` for
    anything else (only tensors cross stages)."""
    values = values if isinstance(values, (tuple, list)) else (values,)
    metas = []
    for v in values:
        if isinstance(v, DTensor):
            metas.append(Meta(tuple(v._local_tensor.shape), v.dtype, dist_meta(v)))
        elif isinstance(v, torch.Tensor):
            metas.append(Meta(tuple(v.shape), v.dtype))
        else:
            raise TypeError(f"only tensors cross pipeline stages, got a {type(v).__name__}")
    return metas


def grad_carrying(meta: Meta) -> bool:
    """Whether a gradient flows back for a tensor of this kind (floating or complex)."""
    return meta.dtype.is_floating_point or meta.dtype.is_complex


def fmt(metas: list[Meta] | None) -> str:
    if metas is None:
        return "nothing"
    return "[" + ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}"
                           + (f" (local of a {m.dist.text()})" if m.dist else "") for m in metas) + "]"


def infer(stages: list, stage_rank: dict[int, int], ctl: MPI.Intracomm, first_args: tuple | None,
          first_kwargs: dict | None, local_error: BaseException | None = None) -> None:
    """Fix ``inputs_meta`` / ``outputs_meta`` of this rank's ``stages`` (collective over the
    pipeline group ``ctl``). ``first_args`` / ``first_kwargs``: micro-batch 0 as the step
    split it; ``local_error``: a failure this rank already met (it is raised everywhere)."""
    error = local_error
    found: dict[int, tuple[list[Meta] | None, list[Meta] | None]] = {}
    local_out: dict[int, list[Meta] | None] = {}
    sends = []
    for stage in sorted(stages, key=lambda st: st.stage_index):
        s = stage.stage_index
        if stage.is_first:
            incoming = None
        elif stage_rank[s - 1] == ctl.rank:
            incoming = local_out[s - 1]
        else:
            incoming = watchdog.call(f"the pipeline's shape exchange: stage {s}'s input from stage {s - 1} (recv)",
                                     ctl, ctl.recv, None, stage_rank[s - 1], s)
        ins = outs = None
        # a stage runs once only on the inputs it will get: not after a failure upstream,
        # nor when its input_args disagree with what arrives (reported below)
        upstream_ok = stage.is_first or (incoming is not None and stage.given_inputs in (None, incoming))
        if error is None and upstream_ok and not stage.is_first:
            try:  # this rank's mesh of each DTensor it receives
                stage.input_meshes = meshes_for(s, stage.given_inputs or incoming, stage.own_meshes(), stage.get_mesh)
            except ValueError as err:  # raised on every rank below
                error = err
        if error is None and upstream_ok:
            try:
                ins = metas_of([a for a in first_args if isinstance(a, torch.Tensor)]) if stage.is_first \
                    else (stage.given_inputs or incoming)
                outs = None if stage.is_last else (stage.given_outputs or _run_once(stage, ins, first_args, first_kwargs))
            except Exception as err:  # noqa: BLE001  (raised on every rank below)
                error = RuntimeError(f"stage {s} failed while finding its output shapes: {type(err).__name__}: {err}")
        if not stage.is_first:
            ins = stage.given_inputs or incoming
        found[s] = (ins, outs)
        if not stage.is_last:
            local_out[s] = outs
            if stage_rank[s + 1] != ctl.rank:
                sends.append(ctl.isend(outs, dest=stage_rank[s + 1], tag=s + 1))
    watchdog.wait_all(sends, "the pipeline's exchange of stage shapes", ctl)
    every = {s: v for part in exchange(ctl, found, error) for s, v in part.items()}
    problems = []
    for s in sorted(every):
        sent, expected = every[s][1], every.get(s + 1, (None,))[0]
        if sent is not None and expected is not None and sent != expected:
            problems.append(f"stage {s} sends {fmt(every[s][1])} but stage {s + 1} expects {fmt(every[s + 1][0])}")
    raise_listed(problems)
    for stage in stages:
        stage.inputs_meta, stage.outputs_meta = every[stage.stage_index]


def _run_once(stage, ins: list[Meta], first_args: tuple, first_kwargs: dict | None) -> list[Meta]:
    """The output shapes of ``stage`` run once on micro-batch 0 (first stage) or on zeros
    of its input shapes, without gradients and with the random state put back."""
    args = first_args if stage.is_first else tuple(
        rebuild(torch.zeros(m.shape, dtype=m.dtype, device=stage.device), m.dist, mesh)
        for m, mesh in zip(ins, stage.input_meshes))
    devices = [stage.device] if stage.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        out = stage.submod(*args, **(first_kwargs or {}))
    return metas_of(out)
