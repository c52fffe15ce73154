"""torch's test helpers seeing mpidtensor's modules, as the test file does (mpidtensor side only).

The switch routes an import by the importing module's ``__name__``: torch's own modules keep
torch's ``torch.distributed.tensor``. torch's test helpers (``common_dtensor.py`` builds the
meshes and DTensors the tests compare with) are torch modules by name, so under the switch
alone they would hand torch's DTensor to a test that holds mpidtensor's. This finder loads
each helper that imports an aliased path from torch's own file, under torch's module path in
``sys.modules`` (so the test file's ``from torch.testing._internal... import`` finds it), but
with a ``__name__`` outside ``torch``: its imports, at load and at call time, are user code's
to the switch. It is installed only by the runner's worker, never by the library.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from mpidtensor.compat.aliases import ALIASES

PREFIX = "suite_routed."  # the __name__ of a routed helper: this prefix + torch's module path
HELPERS = "torch.testing._internal."


def _imports_alias(path: Path) -> bool:
    """Whether the file names a path the switch aliases (``torch.distributed.tensor``, ...)."""
    source = path.read_text(encoding="utf-8", errors="replace")
    return any(alias in source for alias in ALIASES)


class _RoutedLoader(importlib.abc.Loader):
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        torch_name = module.__spec__.name
        module.__name__ = PREFIX + torch_name  # what the switch reads: not torch's
        sys.modules[module.__name__] = module  # classes' __module__ resolves (dataclasses, pickle)
        code = compile(Path(self.origin).read_bytes(), self.origin, "exec")
        exec(code, vars(module))


class HelperRouter(importlib.abc.MetaPathFinder):
    """Finds the helpers under ``torch.testing._internal`` that import an aliased path and
    loads them routed (see the module docstring); every other module as Python would."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(HELPERS):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.origin is None or not spec.origin.endswith(".py") or spec.submodule_search_locations is not None:
            return spec
        if not _imports_alias(Path(spec.origin)):
            return spec
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=_RoutedLoader(spec.origin))


def install() -> None:
    """Put the router first on ``sys.meta_path``; helpers imported before stay torch's, so
    this runs before the test file (and its helpers) is imported."""
    already = [name for name in sys.modules if name.startswith(HELPERS) and
               (getattr(sys.modules[name], "__file__", None) or "").endswith(".py") and
               _imports_alias(Path(sys.modules[name].__file__))]
    if already:
        raise RuntimeError(f"torch's helpers {already} were imported before the router: they would see torch's DTensor")
    sys.meta_path.insert(0, HelperRouter())
