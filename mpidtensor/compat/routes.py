"""The switch's routing table: which torch module paths user code gets as views, and which
torch objects are replaced by mpidtensor's wherever user code reaches them.

Two sources, one table (docs/unchanged-programs.md):

- the module rows of :data:`~.aliases.ALIASES` (torch path -> mpidtensor module); every
  module of torch's tree below a row, and every package above one, is routed too
  (:func:`routed`);
- the name tables: :data:`~.aliases.NAMES` and those the switch registers with
  :func:`override` (``torch.distributed``'s ``init_process_group`` and friends).

From those, :func:`replacement` answers by identity: the object torch defines or exports at
a row's path (``torch.distributed.device_mesh.DeviceMesh``) is mpidtensor's wherever torch
re-exports it (``torch.distributed.DeviceMesh``, ``torch.distributed.tensor.parallel.style.
ColwiseParallel``), because torch re-exports the same object. Nothing here is listed by
hand beyond the rows; :func:`provided` walks torch's package tree to list every routed
name (the tests reach each one by attribute, ``from ... import`` and ``import_module``).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import types
import warnings
from typing import Any, Iterator

from .aliases import ALIASES, NAMES

__all__ = ["PARENTS", "module_names", "override", "overrides", "provided", "replacement", "routed", "target"]

# Every package above an aliased path ("torch", "torch.distributed", ...).
PARENTS = frozenset(path.rsplit(".", k)[0] for path in ALIASES for k in range(1, path.count(".") + 1))

_ABSENT = object()
# torch path -> {name: what user code gets}
_OVERRIDES: dict[str, dict[str, Any]] = {}  # not cleared: the switch's routing, set when installed
_by_id: dict[int, tuple[Any, Any]] | None = None  # id(torch object) -> (torch object, replacement)
_NAMED_PATHS = frozenset(full.rsplit(".", 1)[0] for full in NAMES)


def routed(path: str) -> bool:
    """Whether user code gets a view for torch's module ``path``: a row, a package above
    one, or any module below a row."""
    if path in ALIASES or path in PARENTS:
        return True
    return any(path.startswith(row + ".") for row in ALIASES)


def import_if_present(name: str) -> types.ModuleType | None:
    """Module ``name`` (imported as Python would), or ``None`` if it or a package above it
    does not exist; an import error from inside an existing module is raised."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            return None
        raise


def target(path: str) -> types.ModuleType | None:
    """The mpidtensor module of ``path``'s row, or ``None`` (no row, or its module does not
    exist yet)."""
    name = ALIASES.get(path)
    return None if name is None else import_if_present(name)


def override(path: str, names: dict[str, Any]) -> None:
    """Give ``names`` in place of torch's module ``path``'s own, there and wherever torch
    re-exports the same objects."""
    global _by_id
    _OVERRIDES[path] = dict(names)
    _by_id = None


def overrides(path: str) -> dict[str, Any]:
    """The names user code gets in place of torch's module ``path``'s own: the switch's
    (:func:`override`) and :data:`~.aliases.NAMES`."""
    found = _OVERRIDES.get(path)
    if found is None:
        if path not in _NAMED_PATHS:
            return {}
        found = _OVERRIDES[path] = {}
    if path in _NAMED_PATHS:
        for full, ours in NAMES.items():
            module, name = full.rsplit(".", 1)
            if module == path and name not in found:
                found[name] = _resolve(ours)
    return found


def _resolve(dotted: str) -> Any:
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def replacement(original: Any) -> Any:
    """mpidtensor's object for torch's ``original`` (by identity), or ``None``. Objects not
    defined under ``torch.distributed`` (``torch.cat``) are answered without the table."""
    try:
        module = original.__module__
    except Exception:  # noqa: BLE001 - any object may be asked; most have no such attribute
        return None
    if not isinstance(module, str) or not module.startswith("torch.distributed"):
        return None
    found = (_by_id if _by_id is not None else _build()).get(id(original))
    return found[1] if found is not None and found[0] is original else None


def module_names(module: types.ModuleType) -> set[str]:
    """The names a torch module exports (``__all__``) or defines (objects whose
    ``__module__`` is the module): the names its row replaces."""
    names = {n for n in getattr(module, "__all__", ()) if isinstance(n, str)}
    for name, value in vars(module).items():
        try:
            if getattr(value, "__module__", None) == module.__name__:
                names.add(name)
        except Exception:  # noqa: BLE001
            continue
    return names


def _build() -> dict[int, tuple[Any, Any]]:
    """The identity table from the rows and the overrides (made once, on first need)."""
    global _by_id
    table: dict[int, tuple[Any, Any]] = {}
    for path in _NAMED_PATHS | _OVERRIDES.keys():
        module = _torch_module(path)
        for name, ours in overrides(path).items():
            theirs = getattr(module, name, _ABSENT) if module is not None else _ABSENT
            if theirs is not _ABSENT and theirs is not ours:
                table[id(theirs)] = (theirs, ours)
    for path in ALIASES:
        module, ours_module = _torch_module(path), target(path)
        if module is None or ours_module is None:
            continue
        for name in sorted(module_names(module)):
            theirs, ours = getattr(module, name, _ABSENT), getattr(ours_module, name, _ABSENT)
            if _ABSENT in (theirs, ours) or theirs is ours or isinstance(theirs, types.ModuleType):
                continue
            table.setdefault(id(theirs), (theirs, ours))
    _by_id = table
    return table


def _torch_module(path: str) -> types.ModuleType | None:
    module = sys.modules.get(path)
    if module is not None:
        return module
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def torch_modules() -> Iterator[types.ModuleType]:
    """torch's modules that user code gets as views: the parents, the rows and every
    module below a row (those that import in this environment)."""
    seen: set[str] = set()
    for path in sorted(PARENTS | ALIASES.keys()):
        module = _torch_module(path)
        if module is None or path in seen:
            continue
        seen.add(path)
        yield module
        if path not in ALIASES or not hasattr(module, "__path__"):
            continue
        for info in pkgutil.walk_packages(module.__path__, prefix=path + ".", onerror=lambda name: None):
            if info.name in seen:
                continue
            seen.add(info.name)
            found = _torch_module(info.name)
            if found is not None:
                yield found


def provided() -> dict[tuple[str, str], Any]:
    """Every ``(torch module path, name)`` for which user code gets an object of
    mpidtensor's, with that object: a row's names its mpidtensor module has, the overrides,
    and every re-export of a replaced object anywhere in :func:`torch_modules`."""
    found: dict[tuple[str, str], Any] = {}
    with warnings.catch_warnings():  # reading every name reads deprecated ones too
        warnings.simplefilter("ignore")
        for module in torch_modules():
            found.update(_provided_by(module))
    return found


def _provided_by(module: types.ModuleType) -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {}
    path = module.__name__
    ours_module, local = target(path), overrides(path)
    for name, value in list(vars(module).items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        ours = local.get(name, _ABSENT)
        if ours is _ABSENT and ours_module is not None:
            ours = getattr(ours_module, name, _ABSENT)
            if isinstance(ours, types.ModuleType):
                ours = _ABSENT
        if ours is _ABSENT:
            ours = replacement(value)
        if ours is not None and ours is not _ABSENT and ours is not value and _ours(ours):
            found[(path, name)] = ours
    return found


def _ours(value: Any) -> bool:
    """Whether ``value`` is mpidtensor's own (not a typing name both modules import)."""
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and module.partition(".")[0] == "mpidtensor"
