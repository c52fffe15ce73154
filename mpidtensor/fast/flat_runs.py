"""Runs of DTensor parameters whose local tensors lie back to back in memory, stepped as
one flat tensor by :mod:`mpidtensor.fast.optim_step` (the fast path ``optim.flat_runs``).

FSDP keeps a group's shards in one flat buffer (``fsdp.group``'s ``shard_flat``)
and reduce-scatters its gradients into another in the same order; where no padding or
alignment lies between two shards, their local tensors are adjacent in both. On CPU an
elementwise optimizer pays per tensor for every op of every step (AdamW's foreach kernels
loop over the tensors): over the demo's 21 FSDP x TP parameters its step took 0.8-1.5 ms
on their local tensors against 0.3-0.5 ms on 3 flat ones (docs/performance.md, "the
optimizer on local tensors and flat runs"). A run steps as one tensor when, across it,
the parameters, the gradients and every DTensor state are each contiguous and back to
back in one storage (so each flat tensor covers exactly the run's elements, no one
else's) and the scalar states (step counts) agree; each element then gets the update it
would get alone. The run's parameters need not stand together in the optimizer's group
(the update of an element does not depend on the order): FSDP's root group, whose embedding
comes first in ``model.parameters()`` and whose norm and output come last, is one run.
:func:`rehome` puts the states of a run back to back (states just created, or loaded as
separate tensors), so that the next step takes the flat path.

A run is made only of parameters the local step already takes (the dispatcher moves
nothing for their ops), and an elementwise optimizer updates each element alone: what is
checked here is memory (adjacency, one storage, the gradients laid out as the
parameters) and equal scalar states, nothing about placements.
"""
from __future__ import annotations

from itertools import chain as chained, repeat
from operator import attrgetter, is_, sub
from typing import Sequence

import torch

from ..tensor.dtensor import DTensor
from . import registry

__all__ = ["Run", "candidate_runs", "rehome", "PATH"]

PATH = registry.register(
    "optim.flat_runs",
    "the local step's per-parameter kernels over parameters whose local tensors, gradients and "
    "states lie back to back (FSDP's flat shards): one flat tensor per run",
    decided_by="optim.local_step's verdict for each parameter of the run (the dispatcher's plan moves "
               "nothing), the elementwise update, and the tensors' memory layout (Run.make, Run.grad)")

_storage_address = torch._C._storage_address  # an address, without making a storage object
_version_of = attrgetter("_version")
_data_ptr, _is_contiguous = torch.Tensor.data_ptr, torch.Tensor.is_contiguous


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` starts where the contiguous ``a`` ends, in the same storage and dtype."""
    return (b.dtype == a.dtype and b.is_contiguous() and b.storage_offset() == a.storage_offset() + a.numel()
            and _storage_address(b) == _storage_address(a))


def _back_to_back(tensors: Sequence[torch.Tensor]) -> bool:
    return tensors[0].is_contiguous() and all(_follows(a, b) for a, b in zip(tensors, tensors[1:]))


def _common_keys(entries: Sequence[dict | None]) -> tuple:
    """The state keys every entry has, the same in each (empty if an entry is missing or
    differs)."""
    keys = entries[0].keys() if entries[0] else None
    if not keys or any(not e or e.keys() != keys for e in entries):
        return ()
    return tuple(keys)


def _flat(first: torch.Tensor, numel: int) -> torch.Tensor:
    """The 1-D tensor of ``numel`` elements from ``first``'s start."""
    return first.as_strided((numel,), (1,), first.storage_offset())


def candidate_runs(params: Sequence, locals_: Sequence) -> list[tuple[int, ...]]:
    """The group indices, in memory order, of every chain of at least two DTensor parameters
    whose local tensors (``locals_[i]``, None for a plain parameter) are contiguous and back
    to back, wherever the parameters stand in the group: an elementwise step does not depend
    on their order (FSDP's root group, the embedding before the blocks and the norm and the
    output after them in ``model.parameters()``, is one chain of its ``shard_flat``)."""
    order = sorted((i for i, t in enumerate(locals_) if t is not None and t.is_contiguous()),
                   key=lambda i: (_storage_address(locals_[i]), locals_[i].storage_offset(), locals_[i].numel()))
    chains, chain = [], []
    for i in order:
        if chain and not _follows(locals_[chain[-1]], locals_[i]):
            if len(chain) > 1:
                chains.append(tuple(chain))
            chain = []
        chain.append(i)
    if len(chain) > 1:
        chains.append(tuple(chain))
    return chains


class Run:
    """DTensor parameters whose local tensors and states lie back to back (see
    :meth:`make`): ``flat`` is them as one tensor, ``views`` each DTensor state as one,
    ``scalars`` each 0-d state's per-parameter tensors, ``others`` the other states;
    ``agreed``, the scalar tensors' version counters when they were last made equal
    (:meth:`write_back`): while they read the same, nothing wrote to them and :meth:`entry`
    need not compare their values."""

    __slots__ = ("params", "numel", "flat", "views", "scalars", "others", "offsets", "agreed")

    def __init__(self, params: tuple, flat: torch.Tensor, views: dict, scalars: dict, others: dict) -> None:
        self.params, self.numel, self.flat = params, flat.numel(), flat
        self.views, self.scalars, self.others = views, scalars, others
        self.agreed: tuple[int, ...] | None = None
        base = flat.data_ptr()
        self.offsets = tuple(p._local_tensor.data_ptr() - base for p in params)  # bytes from the first

    @classmethod
    def make(cls, params: Sequence, entries: Sequence[dict]) -> "Run | None":
        """The run of ``params`` (their state entries ``entries``), or None if some state
        is missing, not back to back, or differs in kind across them."""
        keys = _common_keys(entries)
        if not keys:
            return None
        views, scalars, others = {}, {}, {}
        locals_ = [p._local_tensor for p in params]
        numel = sum(t.numel() for t in locals_)
        for key in keys:
            values = [e[key] for e in entries]
            if all(type(v) is DTensor for v in values):
                tensors = [v._local_tensor for v in values]
                if not _back_to_back(tensors):
                    return None
                views[key] = _flat(tensors[0], numel)
            elif all(isinstance(v, torch.Tensor) and type(v) is not DTensor and not v.dim() for v in values):
                scalars[key] = values
            elif any(isinstance(v, torch.Tensor) for v in values):
                return None
            else:
                others[key] = values
        return cls(tuple(params), _flat(locals_[0], numel), views, scalars, others)

    def entry(self) -> dict | None:
        """The state of ``flat`` for this step, or None if the scalar states or the other
        states differ across the run (it steps one parameter at a time then)."""
        entry = dict(self.views)
        for key, values in self.others.items():
            if any(v != values[0] for v in values[1:]):
                return None
            entry[key] = values[0]
        scalars = self.scalars
        if scalars and self._versions() != self.agreed:
            for tensors in scalars.values():
                stacked = torch.stack(tensors)  # one comparison for the run, not an item() per parameter
                if not bool(stacked.eq(stacked[0]).all()):
                    return None
        for key, tensors in scalars.items():
            entry[key] = tensors[0]
        return entry

    def _versions(self) -> tuple[int, ...]:
        return tuple(map(_version_of, chained.from_iterable(self.scalars.values())))

    def grad(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """The parameters' gradients as one tensor, given their local tensors ``grads`` (in the
        order of ``params``, None for a missing one), if they are all there and laid out as
        the parameters are: contiguous, each at its parameter's byte offset from the first
        (same dtype and shape: a gradient has its parameter's spec), the first and the last
        in one storage, so the flat view stays inside it."""
        if any(map(is_, grads, repeat(None))):  # (C-level loops: a run has dozens of parameters)
            return None
        first, last = grads[0], grads[-1]
        if (_storage_address(first) != _storage_address(last) or not all(map(_is_contiguous, grads))
                or tuple(map(sub, map(_data_ptr, grads), repeat(first.data_ptr()))) != self.offsets):
            return None
        return first.as_strided((self.numel,), (1,), first.storage_offset())  # (_flat inline: a call less a step)

    def write_back(self, new: dict, state) -> None:
        """After the step: ``new`` (the flat state) into every parameter's entry; the state
        views hold their values already unless the step replaced one."""
        for key, v in new.items():
            view = self.views.get(key)
            if view is not None:
                if v is not view:
                    view.copy_(v)
            elif key in self.scalars:
                tensors = self.scalars[key]
                targets = tensors[1:] if v is tensors[0] else tensors
                torch._foreach_copy_(targets, [v] * len(targets))
            else:
                for p in self.params:
                    state[p][key] = v
        if self.scalars and self.scalars.keys() <= new.keys():  # each now holds the run's value
            self.agreed = self._versions()


def rehome(params: Sequence, entries: Sequence[dict]) -> None:
    """Put each DTensor state of ``params`` (their entries ``entries``) back to back in one
    new buffer per key, the entries becoming DTensor views of it (same values), so that
    :meth:`Run.make` takes them."""
    for key in _common_keys(entries):
        values = [e[key] for e in entries]
        if not all(type(v) is DTensor for v in values):
            continue
        tensors = [v._local_tensor for v in values]
        if _back_to_back(tensors):
            continue
        flat = torch.cat([t.reshape(-1) for t in tensors])
        at = 0
        for p, entry, t in zip(params, entries, tensors):
            entry[key] = DTensor(flat[at:at + t.numel()].view(t.shape), p._spec)
            at += t.numel()
