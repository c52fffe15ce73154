"""``Stateful``: an object that ``save``/``load`` checkpoint through its own
``state_dict()`` / ``load_state_dict()`` (an ``nn.Module``, an optimizer, or an
``AppState`` that wraps both with ``get_state_dict`` / ``set_state_dict``).

As in ``torch.distributed.checkpoint.stateful`` it is a runtime-checkable protocol:
any object with both methods is one. ``save`` replaces each by its ``state_dict()``;
``load`` calls ``state_dict()`` for the targets, fills them, then hands them to
``load_state_dict()``. Unlike torch, which looks at the top-level values only, they
may sit anywhere in nested dicts, lists and tuples.

A ``state_dict()`` or ``load_state_dict()`` that raises on some ranks raises a
``CheckpointError`` naming the object's key and each failing rank on every rank
(``runtime.agreement.raise_found``: one small ``allgather``), so that no rank is left
waiting in a later collective.
"""
from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

from mpi4py import MPI

from ..runtime.agreement import raise_found
from . import tree
from .errors import CheckpointError

__all__ = ["Stateful", "StatefulT"]


@runtime_checkable
class Stateful(Protocol):
    """An object checkpointed through its ``state_dict()`` and restored in place by
    ``load_state_dict()`` (``load`` calls ``state_dict()`` too, for the targets)."""

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ...


StatefulT = TypeVar("StatefulT", bound=Stateful)


class _StepError(Exception):
    """A Stateful method's failure, with the key of the object it was called on."""


def _has_stateful(node: Any) -> bool:
    if isinstance(node, Stateful):
        return True
    if isinstance(node, dict):
        return any(_has_stateful(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_stateful(v) for v in node)
    return False


def _resolved(node: Any, path: tuple) -> Any:
    """``node`` with every Stateful replaced by its ``state_dict()``; containers that
    hold none are kept as they are (the same objects), the others copied."""
    if isinstance(node, Stateful):
        try:
            return node.state_dict()
        except Exception as err:  # noqa: BLE001  (agreed over the ranks by the caller)
            raise _StepError(f"state_dict() of {tree.fqn(path) or 'the state dict'!r}: "
                             f"{type(err).__name__}: {err}") from err
    if not _has_stateful(node):
        return node
    if isinstance(node, dict):
        return {k: _resolved(v, path + (("d", k),)) for k, v in node.items()}
    return type(node)(_resolved(v, path + (("l", i),)) for i, v in enumerate(node))


def _restored(original: Any, loaded: Any, path: tuple) -> Any:
    """Hand each Stateful of ``original`` its part of ``loaded`` (``load_state_dict``)
    and put the loaded values into ``original``'s containers; the restored node."""
    if isinstance(original, Stateful):
        try:
            original.load_state_dict(loaded)
        except Exception as err:  # noqa: BLE001  (agreed over the ranks by the caller)
            raise _StepError(f"load_state_dict() of {tree.fqn(path) or 'the state dict'!r}: "
                             f"{type(err).__name__}: {err}") from err
        return original
    if original is loaded:  # no Stateful inside: the reader filled it in place
        return original
    if isinstance(original, dict) and isinstance(loaded, dict):
        for k in original:
            original[k] = _restored(original[k], loaded[k], path + (("d", k),))
        return original
    if isinstance(original, (list, tuple)) and isinstance(loaded, (list, tuple)):
        items = [_restored(o, n, path + (("l", i),)) for i, (o, n) in enumerate(zip(original, loaded))]
        if isinstance(original, list):
            original[:] = items
            return original
        return tuple(items)
    return loaded


def agree(comm: MPI.Intracomm, failure: str | None, cause: BaseException | None = None) -> None:
    """When any rank's ``failure`` is set, raise ``CheckpointError`` on every rank naming
    each failure and the rank that met it (``cause``, this rank's error, chained)."""
    try:
        raise_found(comm, [] if failure is None else [str(failure)], CheckpointError, name_ranks=True)
    except CheckpointError as err:
        raise err from cause


def resolve_here(state_dict: Any) -> tuple[Any, str | None, BaseException | None]:
    """``(resolved, failure, cause)``: ``state_dict`` with every Stateful replaced by its
    ``state_dict()``, or the failure to agree on (see :func:`agree`). Local."""
    try:
        return _resolved(state_dict, ()), None, None
    except _StepError as err:
        return state_dict, str(err), err.__cause__


def resolve(state_dict: Any, comm: MPI.Intracomm) -> Any:
    """``state_dict`` with every Stateful replaced by its ``state_dict()``. Collective:
    a failure on any rank raises on every rank."""
    resolved, failure, cause = resolve_here(state_dict)
    agree(comm, failure, cause)
    return resolved


def restore(state_dict: Any, loaded: Any, comm: MPI.Intracomm) -> None:
    """After a load into ``loaded`` (what :func:`resolve` gave): each Stateful's
    ``load_state_dict()`` with its part, the other values put back into
    ``state_dict``. Collective: a failure on any rank raises on every rank."""
    failure, cause = None, None
    try:
        _restored(state_dict, loaded, ())
    except _StepError as err:
        failure, cause = str(err), err.__cause__
    agree(comm, failure, cause)
