"""The one executor of action lists (every schedule runs here).

For this rank's ordered list of actions it moves micro-batches between stages: an ``F``
sends the stage's outputs to the next stage, a ``B`` or ``I`` sends its input gradients to
the previous one, as non-blocking messages on the pipeline's :class:`comm.p2p.Channel`;
between two stages of the same rank they are handed over in memory. Receives are posted
``RECV_AHEAD`` actions before the action that needs them, so a rank waits only where its
list says it needs another rank's result. A failure in a stage's forward, backward or
loss notifies the other ranks (their waits return) and is raised, naming stage, action and
micro-batch, by the schedule on every rank.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from mpi4py import MPI

from ..comm.p2p import Channel, NOTICE_TAG, PeerFailed
from . import fsdp_sync
from .actions import B, F, I, W, Action
from .crossing import local_of, rebuild
from .meta import grad_carrying
from .stage import as_tuple

RECV_AHEAD = 4  # actions: how far ahead of its use a receive is posted
_FWD, _BWD = 0, 1


class StageFailed(RuntimeError):
    """A stage's own code (forward, backward, loss) raised; raised on every pipeline rank."""


def tag_of(num_stages: int, sender: int, direction: int, mb: int, tag_ub: int) -> int:
    """The MPI tag of the message ``sender`` sends for micro-batch ``mb`` in ``direction``,
    wrapping below ``tag_ub`` (the MPI tag limit; messages of one source and tag stay in
    order, so a wrap needs ``tag_ub / (2 num_stages)`` micro-batches in flight to collide)."""
    wrap = max(1, (tag_ub - NOTICE_TAG - 1) // (2 * num_stages))
    return NOTICE_TAG + 1 + ((mb % wrap) * num_stages + sender) * 2 + direction


class Runtime:
    """Runs ``order`` (this rank's actions) on ``stages`` (this rank's, by index)."""

    def __init__(self, stages: dict[int, Any], order: list[Action], stage_rank: dict[int, int], rank: int) -> None:
        self.stages, self.order, self.stage_rank, self.rank = stages, order, stage_rank, rank
        self.num_stages = next(iter(stages.values())).num_stages
        self.tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._plan: list[tuple[int, int, int, list]] | None = None
        # each stage's last whole backward of the step: FSDP reduces its gradients there; a
        # stage with a split backward (I, W; DualPipeV mixes them with B) reduces at the
        # step's end instead (fsdp_sync)
        split = {s for s, kind, _ in order if kind in (I, W)}
        self._last_backward = {s: i for i, (s, kind, _) in enumerate(order) if kind == B and s not in split}

    def _tag(self, sender: int, direction: int, mb: int) -> int:
        return tag_of(self.num_stages, sender, direction, mb, self.tag_ub)

    def _receives(self) -> list[tuple[int, int, int, list]]:
        """``(action position, source, tag, (shape, dtype) of each tensor)`` of each receive,
        in order (once); a DTensor's are its local tensor's."""
        if self._plan is None:
            plan = []
            for i, (s, kind, mb) in enumerate(self.order):
                st = self.stages[s]
                if kind == F and not st.is_first and self.stage_rank[s - 1] != self.rank:
                    plan.append((i, self.stage_rank[s - 1], self._tag(s - 1, _FWD, mb),
                                 [(m.shape, m.dtype) for m in st.inputs_meta]))
                elif kind in (B, I) and not st.is_last and self.stage_rank[s + 1] != self.rank:
                    plan.append((i, self.stage_rank[s + 1], self._tag(s + 1, _BWD, mb),
                                 [(m.shape, m.dtype) for m in st.outputs_meta if grad_carrying(m)]))
            self._plan = plan
        return self._plan

    def run(self, channel: Channel, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
            loss_fn: Callable | None, loss_kwargs: dict | None, has_backward: bool, save_outputs: bool) -> dict[int, Any]:
        """Execute the list once; the losses of the last stage's micro-batches (if here).
        Raises :class:`PeerFailed` when another rank failed, :class:`StageFailed` (after
        notifying the others) when a stage here did."""
        plan = self._receives() if has_backward else [r for r in self._receives() if self.order[r[0]].kind == F]
        posted: dict[int, Any] = {}
        handoff: dict[tuple[int, str, int], list] = {}
        losses: dict[int, Any] = {}
        next_post = 0
        for here, action in enumerate(self.order):
            if not has_backward and action.kind != F:
                continue
            while next_post < len(plan) and plan[next_post][0] < here + RECV_AHEAD:
                i, source, tag, metas = plan[next_post]
                posted[i] = channel.post(source, tag, metas, self.stages[self.order[i].stage_index].device)
                next_post += 1
            s, kind, mb = action
            st = self.stages[s]
            if kind == F:
                if st.is_first:
                    args = arg_mbs[mb]
                elif (s, F, mb) in handoff:
                    args = handoff.pop((s, F, mb))
                else:
                    args = _as_inputs(channel.wait(posted.pop(here), action), st, has_backward)
                out = _guarded(action, lambda: st.forward_one_chunk(mb, args, kwarg_mbs[mb], save_outputs))
                if st.is_last:
                    if loss_fn is not None and target_mbs is not None:
                        losses[mb] = _guarded(action, lambda: loss_fn(out, target_mbs[mb], **(loss_kwargs or {})),
                                              "its loss_fn")
                    continue
                outs = as_tuple(out)
                st.check_outputs(outs)
                sent = [local_of(o) for o in outs]
                if self.stage_rank[s + 1] == self.rank:
                    handoff[(s + 1, F, mb)] = _as_inputs(sent, self.stages[s + 1], has_backward)
                else:
                    channel.send(sent, self.stage_rank[s + 1], self._tag(s, _FWD, mb))
            elif kind in (B, I):
                grads = None
                if not st.is_last:
                    grads = handoff.pop((s, B, mb)) if (s, B, mb) in handoff else channel.wait(posted.pop(here), action)
                loss = losses.get(mb) if st.is_last else None
                if st.is_last and loss is None:
                    raise ValueError(f"stage {s} is the last and has no loss for micro-batch {mb}: "
                                     "a schedule that trains needs loss_fn and step(..., target=...)")
                fsdp_sync.before_backward(st.submod, last=here == self._last_backward.get(s))
                input_grads = _guarded(action, lambda: st.backward_one_chunk(mb, loss, grads, full_backward=kind == B))
                if not st.is_first:
                    if self.stage_rank[s - 1] == self.rank:
                        handoff[(s - 1, B, mb)] = input_grads
                    else:
                        channel.send(input_grads, self.stage_rank[s - 1], self._tag(s, _BWD, mb))
            elif kind == W:
                fsdp_sync.before_backward(st.submod, last=False)
                _guarded(action, lambda: st.backward_weight_one_chunk(mb))
        channel.finish_sends()
        return losses


def _as_inputs(tensors: list[torch.Tensor], stage, has_backward: bool) -> tuple:
    """Received or handed-over activations (local tensors) as ``stage``'s inputs: new
    leaves, DTensors again where they were sent as such, requiring gradients where one
    flows back."""
    return tuple(rebuild(t.detach(), m.dist, mesh).requires_grad_(has_backward and grad_carrying(m))
                 for t, m, mesh in zip(tensors, stage.inputs_meta, stage.input_meshes))


def _guarded(action: Action, fn: Callable[[], Any], what: str = "") -> Any:
    """``fn()``; a failure of the stage's own code becomes :class:`StageFailed` naming it."""
    try:
        return fn()
    except PeerFailed:
        raise
    except Exception as err:  # noqa: BLE001  (named and raised on every rank by the schedule)
        kind = {F: "forward", B: "backward", I: "input backward", W: "weight backward"}[action.kind]
        where = f"{what} after the forward" if what else f"its {kind}"
        raise StageFailed(f"pipeline stage {action.stage_index} failed in {where} of micro-batch "
                          f"{action.microbatch_index}: {type(err).__name__}: {err}") from err
