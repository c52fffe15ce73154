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
        self._send_plan: list[tuple[int, int] | None] | None = None
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

    def _sends(self) -> list[tuple[int, int] | None]:
        """``(destination rank, tag)`` of the message each action sends (``None``: it sends
        nothing, or hands over in memory), in order (once)."""
        if self._send_plan is None:
            plan: list[tuple[int, int] | None] = []
            for s, kind, mb in self.order:
                to = s + 1 if kind == F else s - 1 if kind in (B, I) else -1
                if 0 <= to < self.num_stages and self.stage_rank[to] != self.rank:
                    plan.append((self.stage_rank[to], self._tag(s, _FWD if kind == F else _BWD, mb)))
                else:
                    plan.append(None)
            self._send_plan = plan
        return self._send_plan

    def run(self, channel: Channel, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
            loss_fn: Callable | None, loss_kwargs: dict | None, has_backward: bool, save_outputs: bool) -> dict[int, Any]:
        """Execute the list once; the losses of the last stage's micro-batches (if here).
        Raises :class:`PeerFailed` when another rank failed, :class:`StageFailed` (after
        notifying the others) when a stage here did."""
        plan = self._receives() if has_backward else [r for r in self._receives() if self.order[r[0]].kind == F]
        sends = self._sends()
        # per stage, looked up once a step: first, last, FSDP-managed (its switches set
        # before each backward), and how its received inputs are rebuilt
        flags = {s: (st.is_first, st.is_last, isinstance(st.submod, fsdp_sync.FSDPModule),
                     _input_kinds(st, has_backward)) for s, st in self.stages.items()}
        posted: dict[int, Any] = {}
        handoff: dict[tuple[int, str, int], list] = {}
        losses: dict[int, Any] = {}
        next_post = 0
        kwargs = loss_kwargs or {}
        for here, action in enumerate(self.order):
            s, kind, mb = action
            if not has_backward and kind != F:
                continue
            while next_post < len(plan) and plan[next_post][0] < here + RECV_AHEAD:
                i, source, tag, metas = plan[next_post]
                posted[i] = channel.post(source, tag, metas, self.stages[self.order[i].stage_index].device)
                next_post += 1
            st = self.stages[s]
            first, last, fsdp, kinds = flags[s]
            if last and kind in (B, I) and losses.get(mb) is None:
                raise ValueError(f"stage {s} is the last and has no loss for micro-batch {mb}: "
                                 "a schedule that trains needs loss_fn and step(..., target=...)")
            if kind == F:
                if first:
                    args = arg_mbs[mb]
                else:
                    args = handoff.pop((s, F, mb), None)
                    if args is None:
                        args = _rebuilt(channel.wait(posted.pop(here), action), kinds)
                out = _call(action, "", st.forward_one_chunk, mb, args, kwarg_mbs[mb], save_outputs)
                if last:
                    if loss_fn is not None and target_mbs is not None:
                        losses[mb] = _call(action, "its loss_fn", loss_fn, out, target_mbs[mb], **kwargs)
                    continue
                outs = as_tuple(out)
                st.check_outputs(outs)
                sent = [local_of(o) for o in outs]
                to = sends[here]
                if to is None:
                    handoff[(s + 1, F, mb)] = _rebuilt(sent, flags[s + 1][3])
                else:
                    channel.send(sent, *to)
            elif kind == W:
                if fsdp:
                    fsdp_sync.before_backward(st.submod, last=False)
                _call(action, "", st.backward_weight_one_chunk, mb)
            else:  # B or I
                grads = None
                if not last:
                    grads = handoff.pop((s, B, mb), None)
                    if grads is None:
                        grads = channel.wait(posted.pop(here), action)
                if fsdp:
                    fsdp_sync.before_backward(st.submod, last=here == self._last_backward.get(s))
                input_grads = _call(action, "", st.backward_one_chunk, mb, losses.get(mb) if last else None, grads,
                                    full_backward=kind == B)
                if not first:
                    to = sends[here]
                    if to is None:
                        handoff[(s - 1, B, mb)] = input_grads
                    else:
                        channel.send(input_grads, *to)
        channel.finish_sends()
        return losses


def _input_kinds(stage, has_backward: bool) -> list[tuple]:
    """How each received input of ``stage`` is rebuilt: ``(DistMeta or None, mesh,
    requires_grad)`` (:func:`_rebuilt`)."""
    if stage.inputs_meta is None:
        return []
    return [(m.dist, mesh, has_backward and grad_carrying(m)) for m, mesh in zip(stage.inputs_meta, stage.input_meshes)]


def _rebuilt(tensors: list[torch.Tensor], kinds: list[tuple]) -> tuple:
    """Received or handed-over activations (local tensors) as a stage's inputs: new
    leaves, DTensors again where they were sent as such, requiring gradients where one
    flows back."""
    return tuple([rebuild(t.detach(), dist, mesh).requires_grad_(grad)
                  for t, (dist, mesh, grad) in zip(tensors, kinds)])


def _call(action: Action, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, the stage's own code; its failure becomes :class:`StageFailed`
    naming the stage, the action and the micro-batch (``what``: the code, when not the
    action's own)."""
    try:
        return fn(*args, **kwargs)
    except PeerFailed:
        raise
    except Exception as err:  # noqa: BLE001  (named and raised on every rank by the schedule)
        kind = {F: "forward", B: "backward", I: "input backward", W: "weight backward"}[action.kind]
        where = f"{what} after the forward" if what else f"its {kind}"
        raise StageFailed(f"pipeline stage {action.stage_index} failed in {where} of micro-batch "
                          f"{action.microbatch_index}: {type(err).__name__}: {err}") from err
