"""How a style installs its forward on a module: a cached class swap, as ``fully_shard`` does.

A style whose module runs its own forward (a tensor-parallel ``nn.Linear`` or vocabulary-
parallel ``nn.Embedding``, a sequence-parallel norm, expert-parallel experts) keeps that
forward's state in the module's ``_parallel_forward`` attribute and makes
``module.__class__`` a subclass of the module's class (one per class, cached here) whose
``forward`` calls it: ``module._parallel_forward(module, args, kwargs)``. The state runs
the fast path (``mpidtensor.fast``) or the general one (the base class's forward between
the style's input and output conversions). The module stays an instance of its class
(``isinstance``, ``state_dict``, ``named_parameters`` unchanged), ``copy.deepcopy``
copies the state with the module, and pickling names the class by its base (rebuilt
through :func:`swapped_class`; a model of DTensors still does not pickle, as its
communicators do not). Styles that only convert inputs and outputs use
``distribute_module``'s hooks instead.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["ParallelForwardModule", "install", "own_forward", "swapped_class"]

_CLASSES: dict[type, type] = {}  # not cleared: a module class -> its swapped subclass (one per class)


class ParallelForwardModule:
    """Mixin of the swapped classes: ``forward`` is the module's ``_parallel_forward``."""

    _parallel_base: type  # the module's own class

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._parallel_forward(self, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> Any:
        cls = type(self)
        if _CLASSES.get(cls._parallel_base) is not cls:  # a class swapped again on top (fully_shard)
            return super().__reduce_ex__(protocol)
        return swapped_instance, (cls._parallel_base,), self.__dict__


def swapped_class(cls: type) -> type:
    """The cached subclass of the module class ``cls`` whose forward is the installed one."""
    swapped = _CLASSES.get(cls)
    if swapped is None:
        swapped = _CLASSES[cls] = type(f"Parallel{cls.__name__}", (ParallelForwardModule, cls),
                                       {"_parallel_base": cls})
    return swapped


def swapped_instance(cls: type) -> nn.Module:
    """An empty instance of ``swapped_class(cls)`` (unpickling and ``copy`` fill its state)."""
    return object.__new__(swapped_class(cls))


def install(module: nn.Module, forward: Callable[[nn.Module, tuple, dict], Any]) -> nn.Module:
    """Make ``forward(module, args, kwargs)`` the forward of ``module`` (a class swap)."""
    module._parallel_forward = forward
    if not isinstance(module, ParallelForwardModule):
        module.__class__ = swapped_class(type(module))
    return module


def own_forward(module: nn.Module) -> Callable:
    """The forward of the module's own class, under any swap by :func:`install` (a style
    applied again replaces the installed forward and wraps the same one)."""
    cls = type(module)
    return cls._parallel_base.forward if issubclass(cls, ParallelForwardModule) else cls.forward
