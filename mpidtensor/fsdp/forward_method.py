"""``register_fsdp_forward_method``: another method that gathers and frees like ``forward``."""
from __future__ import annotations

import functools

from torch import nn

from .module import FSDPModule


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run FSDP's pre- and post-forward around it, as
    ``forward`` does: the parameters are gathered for the whole method and (per
    ``reshard_after_forward``) freed after it. The use case is Hugging Face's
    ``generate()`` on a ``fully_shard``-ed model. Calls of ``module``'s own forward inside
    the method find the parameters gathered and leave them so (sub-modules gather and
    free as usual). As in torch, a no-op if ``module`` is not an ``FSDPModule``;
    a missing or non-callable method raises on every rank, before anything changes."""
    if not isinstance(method_name, str):
        raise TypeError(f"method_name must be a str, got {type(method_name).__name__}")
    method = getattr(module, method_name, None)
    if method is None:
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register as an FSDP forward method")
    if not callable(method):
        raise TypeError(f"{type(module).__name__}.{method_name} is a {type(method).__name__}, not a method")
    if not isinstance(module, FSDPModule):
        return
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward(module, args, kwargs)
        state.method_depth += 1
        try:
            out = method(*args, **kwargs)
        finally:
            state.method_depth -= 1
        return state._post_forward(module, args, out)

    setattr(module, method_name, wrapped)
