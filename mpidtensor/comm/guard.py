"""Debug mode (``MPIDTENSOR_DEBUG=1``): ranks agree on each collective before it runs.

A collective that ranks enter with different kinds, dtypes, sizes or shapes hangs or
corrupts data in MPI. Under debug mode every collective first exchanges a small
fingerprint with one ``allgather`` on its own communicator; every rank compares the
same list, so a mismatch (or an argument error found on some ranks only) raises the
same error on every rank (the exchange and the raise are :mod:`..runtime.agreement`'s), naming the collective, the ranks and what differs, before
any data moves. ``settings.debug`` turns it on (``settings.update(debug=True)`` on every
rank alike); the collectives test the module flag ``ENABLED``, which a settings listener
keeps equal to it, and skip this module entirely while it is false.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from mpi4py import MPI

from ..runtime.agreement import outcomes, raise_first
from ..runtime.settings import settings

ENABLED: bool = settings.debug  # read by every collective: a module flag, not a settings lookup


def _debug_changed(value: bool) -> None:
    global ENABLED
    ENABLED = bool(value)


settings.on_change("debug", _debug_changed)

_MARK = "mpidtensor.guard"  # tells our fingerprints from a stray object a user collective sent
_ERRORS = (ValueError, TypeError, IndexError)


def check(
    kind: str,
    comm: MPI.Comm,
    facts: dict[str, Any],
    validate: Callable[[], object] | None = None,
) -> None:
    """Raise on every rank of ``comm`` unless all of them enter the same collective alike.

    ``kind`` names the collective; ``facts`` (dtype, sizes, op, root, shape with the
    dims that may differ per rank masked...) must be equal on every rank; ``validate``
    runs this rank's own argument checks, and an error it raises on any rank is raised
    on all (as the first failing rank's exception type). A collective: every rank of
    ``comm`` calls it. Non-blocking collectives call it before posting.
    """
    error = None
    if validate is not None:
        try:
            validate()
        except _ERRORS as exc:
            error = exc
    raise_first([_verdict(outcomes(comm, (_MARK, kind, comm.size, tuple(sorted(facts.items()))), error))])


def tensor_facts(tensor: torch.Tensor, masked: tuple[int, ...] = ()) -> dict[str, Any]:
    """``dtype``, ``device type`` and ``shape`` of ``tensor``, with dims in ``masked``
    (which may legitimately differ between ranks) shown as ``*``."""
    drop = {norm_dim(d, tensor.ndim) for d in masked}
    shape = tuple("*" if d in drop else n for d, n in enumerate(tensor.shape))
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": shape}


def norm_dim(dim: int, ndim: int) -> int:
    """``dim`` made non-negative when in range, so that ranks passing -1 and ndim-1 agree."""
    return dim % ndim if -ndim <= dim < ndim and ndim else dim


def _verdict(everyone: list) -> Exception | None:
    """The error (or None) that the gathered ``(fingerprint, error)`` pairs call for."""
    message, exc_type = _judge(everyone)
    return None if message is None else exc_type(f"MPIDTENSOR_DEBUG: {message}")


def _judge(everyone: list) -> tuple[str | None, type[Exception]]:
    """The error message (or None) that the gathered fingerprints call for, and its type."""
    foreign = [r for r, f in enumerate(everyone) if not _ours(f)]
    if foreign:
        return (f"ranks {foreign} entered a collective that is not an mpidtensor collective while "
                f"the others entered one"), ValueError
    kinds = [f[1] for f, _ in everyone]
    if len(set(kinds)) > 1:
        return "ranks entered different collectives: " + _by_rank(kinds), ValueError
    kind = kinds[0]
    facts = [dict(f[3]) for f, _ in everyone]
    keys = sorted(set().union(*facts))
    differ = []
    for key in keys:
        values = [fact.get(key, "<missing>") for fact in facts]
        if len(set(map(repr, values))) > 1:
            differ.append(f"{key} differs: " + _by_rank(values))
    if differ:
        return f"{kind} on a communicator of {len(everyone)} ranks: " + "; ".join(differ), ValueError
    errors = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if errors:
        first = type(errors[0][1])
        exc_type = first if first in _ERRORS else ValueError
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in errors)
        return f"{kind} got bad arguments on ranks {[r for r, _ in errors]} ({detail})", exc_type
    return None, ValueError


def _ours(pair: Any) -> bool:
    """Whether ``pair`` is an mpidtensor collective's ``(fingerprint, error)``."""
    return (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], tuple) and len(pair[0]) == 4
            and pair[0][0] == _MARK)


def _by_rank(values: list) -> str:
    """``values`` grouped as ``value on ranks [..]``, most common first."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))
    return ", ".join(f"{value} on ranks {ranks}" for value, ranks in ordered)
