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

from typing import Any, Callable, NamedTuple

import torch
from mpi4py import MPI

from ..comm.p2p import Channel, NOTICE_TAG, PeerFailed, Receive
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


class _Step(NamedTuple):
    """One action as the runtime runs it, prepared once per order (:meth:`Runtime._prepare`):
    what it posts first, where its input and output go, and its stage's flags."""

    action: Action
    stage: Any
    kind: str
    mb: int
    posts: tuple[Receive, ...]  # receives posted before it (RECV_AHEAD)
    receive: Receive | None  # its input from another rank (None: handed over in memory, or none)
    inbox: tuple | None  # the key of its input handed over in memory
    send: tuple[int, int] | None  # (destination rank, tag) of what it sends
    outbox: tuple | None  # the key its output is handed over under, to a stage of this rank
    first: bool
    last: bool
    last_backward: bool  # the stage's last whole backward of the step (FSDP reduces there)
    kinds: list  # how its received inputs are rebuilt (_rebuilt)
    next_kinds: list  # how the next stage rebuilds what it hands over
    plain_out: bool  # the stage's outputs are plain tensors (no DTensor's local tensor to take)


class Runtime:
    """Runs ``order`` (this rank's actions) on ``stages`` (this rank's, by index)."""

    def __init__(self, stages: dict[int, Any], order: list[Action], stage_rank: dict[int, int], rank: int) -> None:
        self.stages, self.order, self.stage_rank, self.rank = stages, order, stage_rank, rank
        self.num_stages = next(iter(stages.values())).num_stages
        self.tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._plans: dict[bool, list[_Step]] = {}  # with and without backward
        # each stage's last whole backward of the step: FSDP reduces its gradients there; a
        # stage with a split backward (I, W; DualPipeV mixes them with B) reduces at the
        # step's end instead (fsdp_sync)
        split = {s for s, kind, _ in order if kind in (I, W)}
        self._last_backward = {s: i for i, (s, kind, _) in enumerate(order) if kind == B and s not in split}

    def _tag(self, sender: int, direction: int, mb: int) -> int:
        return tag_of(self.num_stages, sender, direction, mb, self.tag_ub)

    def _prepare(self, has_backward: bool) -> list[_Step]:
        """The order as :class:`_Step` s (once each way, after the first step fixed the
        shapes that cross): each receive's tag, source and layout (a DTensor's are its
        local tensor's), each send's destination and tag, the in-memory hand-overs between
        this rank's stages, and which receives each action posts first."""
        kinds = {s: _input_kinds(st, has_backward) for s, st in self.stages.items()}
        order = [(i, a) for i, a in enumerate(self.order) if has_backward or a.kind == F]
        receives: list[tuple[int, Receive]] = []
        steps = []
        for here, action in order:
            s, kind, mb = action
            st = self.stages[s]
            receive = inbox = send = outbox = None
            peer = s - 1 if kind == F else s + 1 if kind in (B, I) else -1
            if kind != W and 0 <= peer < self.num_stages:  # an input from the peer stage
                if self.stage_rank[peer] == self.rank:
                    inbox = (s, kind == F, mb)
                else:
                    metas = st.inputs_meta if kind == F else [m for m in st.outputs_meta if grad_carrying(m)]
                    receive = Receive(st.comm, self.stage_rank[peer], self._tag(peer, _FWD if kind == F else _BWD, mb),
                                      [(m.shape, m.dtype) for m in metas], st.device, action)
                    receives.append((here, receive))
            to = s + 1 if kind == F else s - 1 if kind in (B, I) else -1
            if 0 <= to < self.num_stages:  # an output to the next (F) or previous (B, I) stage
                if self.stage_rank[to] == self.rank:
                    outbox = (to, kind == F, mb)
                else:
                    send = (self.stage_rank[to], self._tag(s, _FWD if kind == F else _BWD, mb))
            plain_out = st.outputs_meta is not None and all(m.dist is None for m in st.outputs_meta)
            steps.append([action, st, kind, mb, receive, inbox, send, outbox, st.is_first, st.is_last,
                          here == self._last_backward.get(s), kinds[s], kinds.get(s + 1, []), plain_out])
        plan, posted = [], 0
        for (here, _), (action, st, kind, mb, receive, *rest) in zip(order, steps):
            end = posted
            while end < len(receives) and receives[end][0] < here + RECV_AHEAD:
                end += 1
            plan.append(_Step(action, st, kind, mb, tuple(r for _, r in receives[posted:end]), receive, *rest))
            posted = end
        return plan

    def run(self, channel: Channel, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
            loss_fn: Callable | None, loss_kwargs: dict | None, has_backward: bool, save_outputs: bool) -> dict[int, Any]:
        """Execute the list once; the losses of the last stage's micro-batches (if here).
        Raises :class:`PeerFailed` when another rank failed, :class:`StageFailed` (after
        notifying the others) when a stage here did."""
        plan = self._plans.get(has_backward)
        if plan is None:
            plan = self._plans[has_backward] = self._prepare(has_backward)
        # whether each stage is FSDP-managed (its switches set before each backward): a step's look
        fsdp = {s: isinstance(st.submod, fsdp_sync.FSDPModule) for s, st in self.stages.items()}
        handoff: dict[tuple, Any] = {}
        losses: dict[int, Any] = {}
        kwargs = loss_kwargs or {}
        doing, what = None, ""  # the action whose stage code runs (its failure is the stage's)
        try:
            for action, st, kind, mb, posts, receive, inbox, send, outbox, first, last, last_b, kinds, \
                    next_kinds, plain_out in plan:
                for r in posts:
                    channel.post(r)
                if kind == F:
                    if first:
                        args = arg_mbs[mb]
                    elif receive is None:
                        args = handoff.pop(inbox)
                    else:
                        args = _rebuilt(channel.wait(receive), kinds)
                    doing = action
                    out = st.forward_one_chunk(mb, args, kwarg_mbs[mb], save_outputs and last)
                    if last:
                        if loss_fn is not None and target_mbs is not None:
                            what = "its loss_fn after the forward"
                            losses[mb] = loss_fn(out, target_mbs[mb], **kwargs)
                            what = ""
                        doing = None
                        continue
                    doing = None
                    outs = (out,) if type(out) is torch.Tensor else as_tuple(out)
                    st.check_outputs(outs)  # plain tensors where the fixed shapes say so: sent as they are
                    sent = outs if plain_out else [local_of(o) for o in outs]
                    if send is None:
                        handoff[outbox] = _rebuilt(sent, next_kinds)
                    else:
                        channel.send(sent, *send)
                elif kind == W:
                    if fsdp[action.stage_index]:
                        fsdp_sync.before_backward(st.submod, last=False)
                    doing = action
                    st.backward_weight_one_chunk(mb)
                    doing = None
                else:  # B or I
                    if last:
                        loss = losses.get(mb)
                        if loss is None:
                            raise ValueError(f"stage {action.stage_index} is the last and has no loss for micro-batch "
                                             f"{mb}: a schedule that trains needs loss_fn and step(..., target=...)")
                        grads = None
                    else:
                        loss = None
                        grads = handoff.pop(inbox) if receive is None else channel.wait(receive)
                    if fsdp[action.stage_index]:
                        fsdp_sync.before_backward(st.submod, last=last_b)
                    doing = action
                    input_grads = st.backward_one_chunk(mb, loss, grads, full_backward=kind == B)
                    doing = None
                    if send is not None:
                        channel.send(input_grads, *send)
                    elif outbox is not None:
                        handoff[outbox] = input_grads
        except PeerFailed:
            raise
        except Exception as err:
            if doing is None:
                raise
            kind = {F: "forward", B: "backward", I: "input backward", W: "weight backward"}[doing.kind]
            raise StageFailed(f"pipeline stage {doing.stage_index} failed in {what or f'its {kind}'} of micro-batch "
                              f"{doing.microbatch_index}: {type(err).__name__}: {err}") from err
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
    if len(kinds) == 1 and kinds[0][0] is None:  # one plain tensor (the common case): no comprehension
        return (tensors[0].detach().requires_grad_(kinds[0][2]),)
    return tuple([rebuild(t.detach(), dist, mesh).requires_grad_(grad)
                  for t, (dist, mesh, grad) in zip(tensors, kinds)])
