"""The module objects user code gets under the switch, in place of torch's.

``sys.modules`` keeps torch's modules: torch's own Python and C++ code import them by
path (libtorch_python's dispatcher reads ``torch.distributed.tensor.DTensor._op_dispatcher``,
and looks ``torch.distributed.tensor`` up in ``sys.modules``), so replacing them breaks
torch, and torch's module is always imported before its view is made. User code gets, from
the import hook, a *view* of every module :func:`.routes.routed` names:

- an **alias** for a path of :data:`~.aliases.ALIASES`: a module named after torch's path
  whose attributes are its mpidtensor module's (read through, so it never goes stale); a
  name mpidtensor lacks is torch's object routed by :func:`.routes.replacement`
  (``torch.distributed.tensor.experimental.DTensor``), torch's submodule's view, torch's
  constant, or else a stand-in that raises ``NotImplementedError`` naming it when called or
  instantiated (every rank runs the same program: it raises on every rank, before any
  collective); any other name is an ``AttributeError`` as usual;
- a **proxy** for any other routed path (``torch``, ``torch.distributed``,
  ``torch.distributed.tensor.parallel.style``, ``torch.distributed.tensor._utils``):
  torch's module read through, except its routed children (views), the switch's
  overrides and the objects :func:`.routes.replacement` replaces (``torch.distributed.
  init_device_mesh`` is mpidtensor's), so that every spelling of a name reaches the same
  object.

Views are plain ``types.ModuleType`` objects with a module ``__getattr__`` (PEP 562), so
``torch.compile`` and ``inspect`` treat them as modules. What an alias or a parent package
reads through is kept in its namespace: the first read of a name costs a Python call, later
ones are as fast as on torch's module (an attribute of torch's reassigned after that is not
seen through it). A proxy of a module below a row keeps only what it replaces: torch's
internals (``torch.distributed.tensor._random._rng_tracker``) are read afresh each time.
"""
from __future__ import annotations

import importlib
import types
from typing import Any

from . import routes
from .aliases import ALIASES, TORCH_KEPT

__all__ = ["PARENTS", "override", "stand_in", "view"]

PARENTS = routes.PARENTS

_VIEWS: dict[str, types.ModuleType | None] = {}  # not cleared: user code holds these modules
_STAND_INS: dict[str, Any] = {}  # not cleared: user code holds these objects
_ABSENT = object()
_HIDDEN = ("__spec__", "__loader__", "__package__")  # read through to the module, not None


def view(path: str) -> types.ModuleType | None:
    """What user code gets for torch's module ``path``: its alias, its proxy, or ``None``
    (torch's own module: not routed, or neither torch nor mpidtensor has it)."""
    try:
        return _VIEWS[path]
    except KeyError:
        pass
    made = None
    if routes.routed(path):
        source = routes.import_if_present(path)  # torch's first, as Python's import would have loaded it
        target = routes.target(path)
        if target is not None:
            made = _module(path, source, target)
        elif source is not None:
            made = _module(path, source, None)
    _VIEWS[path] = made
    return made


def override(path: str, names: dict[str, Any]) -> None:
    """Give ``names`` in place of torch's module ``path``'s own, in its view (made or to
    come) and wherever torch re-exports the same objects (:func:`.routes.override`)."""
    routes.override(path, names)
    for made in _VIEWS.values():
        if made is not None:  # forget what views read before: a name may now be replaced
            for name in [n for n in vars(made) if not n.startswith("__")]:
                del vars(made)[name]


def _module(path: str, source: types.ModuleType | None, target: types.ModuleType | None) -> types.ModuleType:
    """A module named ``path`` reading ``source`` (torch's) or, for an alias, ``target``."""
    made = types.ModuleType(path, (target or source).__doc__)
    for name in _HIDDEN:
        vars(made).pop(name, None)
    namespace = vars(made)
    keeps_all = target is not None or path in PARENTS

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        found = _attribute(path, source, target, name)
        if not name.startswith("__") and (keeps_all or found is not getattr(source, name, _ABSENT)):
            namespace[name] = found  # read once: later reads are plain module attribute reads
        return found

    made.__getattr__ = __getattr__
    made.__dir__ = lambda: sorted(set(dir(target or source)) | set(dir(source) if source else ()))
    if target is not None:
        made.__alias_of__ = target.__name__
    return made


def _attribute(path: str, source: types.ModuleType | None, target: types.ModuleType | None, name: str) -> Any:
    child = f"{path}.{name}"
    if child in ALIASES or child in PARENTS:
        found = view(child)
        if found is not None:
            return found
    overrides = routes.overrides(path)
    if name in overrides:
        return overrides[name]
    if target is not None:
        found = getattr(target, name, _ABSENT)
        if found is not _ABSENT and not isinstance(found, types.ModuleType):
            return found
    original = _torch_attribute(source, path, name)
    if original is _ABSENT:
        if target is not None and found is not _ABSENT:
            return found  # mpidtensor's submodule; torch has none of that name
        where = f" (mpidtensor's {target.__name__} under the torch.distributed switch)" if target else ""
        raise AttributeError(f"module {path!r}{where} has no attribute {name!r}")
    if isinstance(original, types.ModuleType):
        routed = view(child) if original.__name__ == child else None
        return routed if routed is not None else original
    replaced = routes.replacement(original)
    if replaced is not None:
        return replaced
    if target is None or name.startswith("__") or not callable(original) or _defined_at(original) in TORCH_KEPT:
        return original  # torch's own object (a proxy), a constant, or one kept by name
    return stand_in(child, original, target.__name__)


def _torch_attribute(source: types.ModuleType | None, path: str, name: str) -> Any:
    """torch's ``path.name`` (an attribute or a submodule), or ``_ABSENT``."""
    if source is None:
        return _ABSENT
    found = getattr(source, name, _ABSENT)
    if found is not _ABSENT or name.startswith("__"):
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


def _defined_at(obj: Any) -> str:
    """The path ``obj`` is defined at (``module.qualname``), or ``""``."""
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


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
        kept = {attr: value for attr, value in vars(original).items()
                if f"{_defined_at(original)}.{attr}" in TORCH_KEPT}
        found = _Missing(name, (), {"__new__": refuse, "__doc__": message, "__module__": module, "__qualname__": name,
                                    **kept})
    else:
        refuse.__name__ = refuse.__qualname__ = name
        refuse.__module__, refuse.__doc__ = module, message
        found = refuse
    _STAND_INS[qualified] = found
    return found
