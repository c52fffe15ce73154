"""Setup that needs ``torch._dynamo``, run when torch.compile first imports it.

:func:`when_dynamo_loads` defers such setup (marking functions as graph breaks) to
Dynamo's own import: importing Dynamo takes longer than importing torch, so a program that
never compiles should not pay it. The import hook it may put on ``sys.meta_path`` is a
process-wide effect, installed with the first mesh (``dtensor`` registers it with
:mod:`mpidtensor.runtime.effects`). (Collectives reached while torch.compile traces go
through the custom ops of :mod:`mpidtensor.comm.compiled`.)
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable

_DYNAMO = "torch._dynamo"


def when_dynamo_loads(setup: Callable[[], None]) -> None:
    """Run ``setup`` once ``torch._dynamo`` is imported: now if it is, else right after the
    import that torch.compile makes (an import hook that removes itself)."""
    if _DYNAMO in sys.modules:
        setup()
    else:
        sys.meta_path.insert(0, _AfterImport(setup))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the default path finder does, with a loader that runs a
    setup function after the module has executed."""

    def __init__(self, setup: Callable[[], None]) -> None:
        self.setup = setup

    def find_spec(self, fullname, path, target=None):
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenSetup(spec.loader, self.setup)
        return spec


class _ThenSetup(importlib.abc.Loader):
    def __init__(self, loader, setup: Callable[[], None]) -> None:
        self.loader, self.setup = loader, setup

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.setup()

    def __getattr__(self, name):  # get_source, get_resource_reader... of the real loader
        return getattr(self.loader, name)
