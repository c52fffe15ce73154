"""The import hook of the switch: ``builtins.__import__`` and ``importlib.import_module``
wrapped so that user code importing torch's distributed modules gets the views of
:mod:`.views` (mpidtensor's modules under torch's paths).

Only imports made by user code are routed: an importing module under ``torch`` or
``mpidtensor`` (its ``__name__``) keeps torch's modules, so torch's internals never see an
alias. ``sys.modules`` is left alone. An import of a name outside ``torch`` costs one
string comparison more than Python's own; ``import torch.x.y`` from user code binds
``torch`` to the proxy of ``torch`` (whose ``distributed`` reaches the aliases).

How Python 3.11 compiles the forms that matter:

- ``from torch.distributed.tensor import DTensor``: ``__import__`` with a fromlist returns
  the module the names are read from: the alias;
- ``import torch.distributed.checkpoint as dcp``: ``__import__`` without a fromlist returns
  the top package, then two attribute reads (``distributed``, ``checkpoint``): the proxy of
  ``torch``, whose ``distributed`` is the proxy of ``torch.distributed``;
- ``from torch.distributed import fsdp``: the proxy of ``torch.distributed``.
"""
from __future__ import annotations

import builtins
import importlib
import sys
from types import ModuleType
from typing import Any

from . import views

__all__ = ["install", "installed", "uninstall"]

_IMPORT = builtins.__import__
_IMPORT_MODULE = importlib.import_module


def _is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def _internal(module_globals: dict[str, Any] | None) -> bool:
    """Whether the importing module is torch's or mpidtensor's own."""
    if module_globals is None:
        module_globals = sys._getframe(2).f_globals
    importer = module_globals.get("__name__") or ""
    return importer.partition(".")[0] in ("torch", "mpidtensor")


def _hooked_import(name: str, globals: dict[str, Any] | None = None, locals: Any = None,
                   fromlist: Any = (), level: int = 0) -> ModuleType:
    if level or not _is_torch(name) or _internal(globals):
        return _IMPORT(name, globals, locals, fromlist, level)
    found = views.view(name)
    if fromlist:
        return found if found is not None else _IMPORT(name, globals, locals, fromlist, level)
    if found is None:
        _IMPORT(name, globals, locals, fromlist, level)  # torch's module, imported as Python would
    return views.view("torch")


def _hooked_import_module(name: str, package: str | None = None) -> ModuleType:
    if not _is_torch(name) or _internal(sys._getframe(1).f_globals):
        return _IMPORT_MODULE(name, package)
    found = views.view(name)
    return found if found is not None else _IMPORT_MODULE(name, package)


def install() -> None:
    """Route user code's imports of torch's modules through the views (idempotent)."""
    builtins.__import__ = _hooked_import
    importlib.import_module = _hooked_import_module


def uninstall() -> None:
    """Python's own import functions again (for tests; the switch is meant for a whole program)."""
    builtins.__import__ = _IMPORT
    importlib.import_module = _IMPORT_MODULE


def installed() -> bool:
    return builtins.__import__ is _hooked_import
