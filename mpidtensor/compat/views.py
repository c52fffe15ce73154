"""The module objects user code gets under the switch, in place of torch's.

``sys.modules`` keeps torch's modules: torch's own Python and C++ code import them by
path (libtorch_python's dispatcher reads ``torch.distributed.tensor.DTensor._op_dispatcher``),
so replacing them breaks torch. User code gets, from the import hook, a *view*:

- an **alias** for a path of :data:`~.aliases.ALIASES`: a module named after torch's path
  whose attributes are its mpidtensor module's (read through, so it never goes stale);
  a name mpidtensor lacks and torch's module has is a stand-in that raises
  ``NotImplementedError`` naming it when called or instantiated (every rank runs the same
  program: it raises on every rank, before any collective); torch's submodules without a
  row are torch's own; any other name is an ``AttributeError`` as usual;
- a **proxy** for a package above an alias (``torch``, ``torch.distributed``,
  ``torch.distributed._composable``): torch's module read through, except its aliased
  children and the names in :data:`OVERRIDES` (``torch.distributed.init_process_group``...),
  so that ``import torch.distributed.checkpoint as dcp`` and ``dist = torch.distributed``
  reach the aliases.

Views are plain ``types.ModuleType`` objects with a module ``__getattr__`` (PEP 562), so
``torch.compile`` and ``inspect`` treat them as modules. What a view reads through is kept
in its namespace: the first read of a name costs a Python call, later ones are as fast as
on torch's module (an attribute of torch's reassigned after that is not seen through it).
"""
from __future__ import annotations

import importlib
import types
from typing import Any

from .aliases import ALIASES

__all__ = ["OVERRIDES", "PARENTS", "override", "stand_in", "view"]

# Every package above an aliased path ("torch", "torch.distributed", ...).
PARENTS = frozenset(path.rsplit(".", k)[0] for path in ALIASES for k in range(1, path.count(".") + 1))

# Names a view gives in place of its module's: {torch path: {name: object}} (the switch
# fills "torch.distributed" with the MPI-backed init_process_group and friends).
OVERRIDES: dict[str, dict[str, Any]] = {}

_VIEWS: dict[str, types.ModuleType | None] = {}  # not cleared: user code holds these modules
_STAND_INS: dict[str, Any] = {}  # not cleared: user code holds these objects
_ABSENT = object()
_HIDDEN = ("__spec__", "__loader__", "__package__")  # read through to the module, not None


def view(path: str) -> types.ModuleType | None:
    """What user code gets for torch's module ``path``: its alias, its proxy, or ``None``
    (torch's own module: no row, or the row's mpidtensor module does not import)."""
    try:
        return _VIEWS[path]
    except KeyError:
        pass
    target = _target(path) if path in ALIASES else None
    if target is not None:
        made = _module(path, target, target)
    elif path in PARENTS:
        made = _module(path, importlib.import_module(path), None)
    else:
        made = None
    _VIEWS[path] = made
    return made


def override(path: str, names: dict[str, Any]) -> None:
    """Give ``names`` in place of the module's own in the view of ``path`` (made or to come)."""
    OVERRIDES[path] = names
    made = _VIEWS.get(path)
    if made is not None:
        vars(made).update(names)


def _target(path: str) -> types.ModuleType | None:
    """The mpidtensor module of ``path``'s row, or ``None`` when it does not exist (yet)."""
    name = ALIASES[path]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            return None
        raise


def _module(path: str, source: types.ModuleType, target: types.ModuleType | None) -> types.ModuleType:
    """A module named ``path`` reading ``source`` (an alias when ``target`` is given)."""
    made = types.ModuleType(path, source.__doc__)
    for name in _HIDDEN:
        vars(made).pop(name, None)
    namespace = vars(made)

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        found = _attribute(path, source, target, name)
        if not name.startswith("__"):
            namespace[name] = found  # read once: later reads are plain module attribute reads
        return found

    made.__getattr__ = __getattr__
    made.__dir__ = lambda: sorted(set(dir(source)) | {c.rsplit(".", 1)[1] for c in _children(path)})
    if target is not None:
        made.__alias_of__ = target.__name__
    return made


def _children(path: str) -> set[str]:
    return {p for p in ALIASES.keys() | PARENTS if p.rsplit(".", 1)[0] == path}


def _attribute(path: str, source: types.ModuleType, target: types.ModuleType | None, name: str) -> Any:
    child = f"{path}.{name}"
    if child in ALIASES or child in PARENTS:
        found = view(child)
        if found is not None:
            return found
    overrides = OVERRIDES.get(path)
    if overrides is not None and name in overrides:
        return overrides[name]
    if target is None:  # a proxy: torch's module, read through
        return getattr(source, name)
    try:
        return getattr(target, name)
    except AttributeError:
        pass
    original = _ABSENT if name.startswith("__") else _torch_attribute(path, name)
    if original is _ABSENT:
        raise AttributeError(f"module {path!r} (mpidtensor's {target.__name__} under the torch.distributed "
                             f"switch) has no attribute {name!r}")
    if isinstance(original, types.ModuleType) or not callable(original):
        return original  # torch's own submodule or constant
    return stand_in(f"{path}.{name}", original, target.__name__)


def _torch_attribute(path: str, name: str) -> Any:
    """torch's ``path.name`` (an attribute or a submodule), or ``_ABSENT``."""
    try:
        module = importlib.import_module(path)
    except ImportError:
        return _ABSENT
    found = getattr(module, name, _ABSENT)
    if found is not _ABSENT:
        return found
    try:
        return importlib.import_module(f"{path}.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"{path}.{name}":
            return _ABSENT
        raise


class _Missing(type):
    """The metaclass of stand-in classes: their attributes (``ShardingStrategy.FULL_SHARD``,
    ``FSDP.state_dict_type``) raise the stand-in's ``NotImplementedError`` too."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(cls.__doc__)


def stand_in(qualified: str, original: Any, target: str) -> Any:
    """A function or class in place of torch's ``qualified`` (``original``) that raises
    ``NotImplementedError`` naming it when called, instantiated or read from; one per name."""
    found = _STAND_INS.get(qualified)
    if found is not None:
        return found
    module, name = qualified.rsplit(".", 1)
    message = (f"{qualified} is not provided by mpidtensor: under the torch.distributed switch {module} "
               f"is {target}, which has no {name!r} (docs/unchanged-programs.md lists what is provided)")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message)

    if isinstance(original, type):
        found = _Missing(name, (), {"__new__": refuse, "__doc__": message, "__module__": module, "__qualname__": name})
    else:
        refuse.__name__ = refuse.__qualname__ = name
        refuse.__module__, refuse.__doc__ = module, message
        found = refuse
    _STAND_INS[qualified] = found
    return found
