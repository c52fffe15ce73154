"""The registry of fast paths, and the one switch that turns them all off.

A fast path runs local tensors where dispatch would plan, redistribute and wrap per op: a
tensor-parallel ``nn.Linear`` as one autograd Function, an optimizer step on local
tensors, a dispatch plan that moves nothing. Each registers a :class:`FastPath` naming
the general path it stands in for and what decides it, so a reader sees every such path
in one table (``paths()``), and ``settings.fast_paths = False``
(``MPIDTENSOR_FAST_PATHS=0``) sends every call through the general path: the
differential tests run the same programs both ways and compare.

A path counts the calls it takes (``hits``): a differential test asserts its path ran,
so a comparison is never vacuous.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime import caches
from ..runtime.settings import settings

__all__ = ["FastPath", "register", "paths", "enabled"]


@dataclass(eq=False)
class FastPath:
    """One fast path: ``name``; ``shortcuts``, the general path it replaces (ops, rules,
    modules); ``decided_by``, the dispatcher plan or rule its predicate is computed from."""

    name: str
    shortcuts: str
    decided_by: str
    hits: int = field(default=0, compare=False)

    def __repr__(self) -> str:
        return f"FastPath({self.name!r}, hits={self.hits})"


_PATHS: dict[str, FastPath] = {}  # not cleared: the registry of fast paths, by name


def register(name: str, shortcuts: str, decided_by: str) -> FastPath:
    """Register (once) and return the fast path ``name``."""
    if name in _PATHS:
        raise ValueError(f"fast path {name!r} is registered twice")
    path = _PATHS[name] = FastPath(name, shortcuts, decided_by)
    return path


def paths() -> list[FastPath]:
    """Every registered fast path, in registration order."""
    return list(_PATHS.values())


def _switched(_: bool) -> None:
    """Every cached decision (dispatch plans that are LocalPlans, the optimizer step's and
    detach's verdicts from them) was made under the old switch: all of them are dropped."""
    caches.clear_all()


settings.on_change("fast_paths", _switched)


def enabled() -> bool:
    """Whether fast paths may run (``settings.fast_paths``, which the hot paths read themselves:
    a call per Linear, norm or gather is one Python call more than the attribute read)."""
    return settings.fast_paths
