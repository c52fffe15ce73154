"""Every cache mpidtensor keeps, with one owner: this registry.

A module makes its cache with :func:`cache` (a dict, so lookups on the hot path stay a
plain ``dict.get``), bounded where user input can grow it: past ``maxsize`` entries the
oldest is dropped. :func:`clear_all` (``mpidtensor.clear_cache``) empties every one, and
:func:`mesh_freed` (called by ``DeviceMesh.free``) empties those that may hold a mesh's
communicators, so nothing calls a freed communicator through a cached plan.

A verdict kept outside the registry (an object's own table, e.g. a parallel module's
fast-path decisions) keys itself by :data:`GENERATION`, which every :func:`clear_all`
bumps: ``clear_cache()`` and every change of the sharding rules (``register_sharding``,
the context-parallel dispatcher: each clears) reach it too.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

__all__ = ["GENERATION", "BoundedCache", "cache", "clear_all", "mesh_freed", "registered", "on_clear"]


class BoundedCache(dict):
    """A dict that keeps at most ``maxsize`` entries (None: no bound), dropping the oldest
    inserted first. Reads are ``dict`` reads; only insertion pays the bound check."""

    __slots__ = ("name", "maxsize", "holds_meshes")

    def __init__(self, name: str, maxsize: int | None, holds_meshes: bool) -> None:
        super().__init__()
        self.name, self.maxsize, self.holds_meshes = name, maxsize, holds_meshes

    def __setitem__(self, key: Hashable, value: Any) -> None:
        if self.maxsize is not None and len(self) >= self.maxsize and key not in self:
            del self[next(iter(self))]
        super().__setitem__(key, value)

    def setdefault(self, key: Hashable, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __repr__(self) -> str:
        return f"BoundedCache({self.name!r}, {len(self)}/{self.maxsize})"


GENERATION = 0  # bumped by clear_all: read as ``caches.GENERATION`` (a module attribute) on use
_CACHES: dict[str, BoundedCache] = {}  # not cleared: the registry itself (clear_all empties each)
_CLEARERS: list[tuple[str, Callable[[], None], bool]] = []


def cache(name: str, maxsize: int | None = 4096, holds_meshes: bool = True) -> BoundedCache:
    """The registered cache ``name`` (made on first call). ``holds_meshes``: its keys or
    values may refer to a mesh or communicator, so freeing a mesh clears it."""
    found = _CACHES.get(name)
    if found is None:
        found = _CACHES[name] = BoundedCache(name, maxsize, holds_meshes)
    return found


def on_clear(name: str, clear: Callable[[], None], holds_meshes: bool = True) -> None:
    """Register state that is not a dict (an ``lru_cache``, an object's table) by the
    function that empties it."""
    _CLEARERS.append((name, clear, holds_meshes))


def registered() -> dict[str, int]:
    """Each registered cache and its size (entries; -1 for one kept by a clear function)."""
    sizes = {name: len(c) for name, c in _CACHES.items()}
    sizes.update({name: -1 for name, _, _ in _CLEARERS})
    return sizes


def clear_all() -> None:
    """Empty every registered cache; a verdict keyed by :data:`GENERATION` is stale after."""
    global GENERATION
    GENERATION += 1
    for c in _CACHES.values():
        c.clear()
    for _, clear, _ in _CLEARERS:
        clear()


def mesh_freed() -> None:
    """Empty every cache that may hold a mesh or its communicators (a mesh was freed)."""
    for c in _CACHES.values():
        if c.holds_meshes:
            c.clear()
    for _, clear, holds_meshes in _CLEARERS:
        if holds_meshes:
            clear()
