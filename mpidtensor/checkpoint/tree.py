"""A nested state dict as a flat list of leaves, and back.

A leaf's ``path`` is the ``(kind, key)`` pairs from the root (kind: ``d`` a dict with a
str key, ``i`` a dict with an int key, ``l`` a list index, ``t`` a tuple index); its
``fqn`` the keys joined by dots, as errors and ``torch.distributed.checkpoint`` name it.
Empty containers are leaves, so that they survive a round trip. (torch DCP's own
flattening, which the ``Metadata`` describes, is :func:`.metadata.torch_leaves`.)
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

__all__ = ["Leaf", "flatten", "fqn", "leaves", "put", "unflatten"]

CONTAINERS = {"d": dict, "i": dict, "l": list, "t": tuple}


def flatten(state: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, leaf)`` pairs of a nested dict/list/tuple, in order."""
    if isinstance(state, dict) and state:
        for key, value in state.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"state dict keys must be str or int, got {key!r} at {fqn(path)!r}")
            yield from flatten(value, path + (("d" if isinstance(key, str) else "i", key),))
    elif isinstance(state, (list, tuple)) and state:
        kind = "l" if isinstance(state, list) else "t"
        for i, value in enumerate(state):
            yield from flatten(value, path + ((kind, i),))
    else:
        yield path, state


def fqn(path: tuple) -> str:
    """The dotted name of a leaf."""
    return ".".join(str(key) for _, key in path)


class Leaf(NamedTuple):
    """One leaf of a nested state dict, as the native and safetensors formats see it."""

    path: tuple  # the (kind, key) pairs from the root
    fqn: str
    value: Any

    @property
    def keys(self) -> tuple:
        """The keys and indices from the root (what :func:`put` takes)."""
        return tuple(key for _, key in self.path)


def leaves(state: Any) -> list[Leaf]:
    """The leaves of ``state`` in order (:func:`flatten`)."""
    return [Leaf(path, fqn(path), value) for path, value in flatten(state)]


def put(node: Any, keys: tuple, value: Any) -> Any:
    """``node`` with the leaf at ``keys`` replaced by ``value``: dicts and lists are
    updated in place, tuples on the way rebuilt (the result is the new node)."""
    if not keys:
        return value
    key = keys[0]
    child = put(node[key], keys[1:], value)
    if isinstance(node, tuple):
        return node[:key] + (child,) + node[key + 1:]
    node[key] = child
    return node


def unflatten(pairs: list[tuple[tuple, Any]]) -> Any:
    """The nested structure that :func:`flatten` took apart."""
    if len(pairs) == 1 and pairs[0][0] == ():
        return pairs[0][1]
    root: dict = {}
    for path, value in pairs:
        node = root
        for depth, (kind, key) in enumerate(path):
            last = depth == len(path) - 1
            node = node.setdefault((kind, key), value if last else {})
    return _build(root)


def _build(node: Any) -> Any:
    if not isinstance(node, dict) or not node or not isinstance(next(iter(node)), tuple):
        return node
    kind = next(iter(node))[0]
    items = [(key, _build(child)) for (_, key), child in node.items()]
    if kind in ("d", "i"):
        return dict(items)
    return CONTAINERS[kind](value for _, value in items)
