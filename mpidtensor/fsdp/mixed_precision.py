"""``MixedPrecisionPolicy``: the dtypes FSDP computes, reduces and returns in."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As ``torch.distributed.fsdp.MixedPrecisionPolicy``.

    ``param_dtype``: the unsharded parameters (and so the all-gather) are cast to it;
    ``reduce_dtype``: gradients are reduce-scattered in it (default ``param_dtype``);
    ``output_dtype``: floating-point forward outputs are cast to it;
    ``cast_forward_inputs``: floating-point forward inputs are cast to ``param_dtype``.
    ``None`` means the parameters' own dtype. Sharded parameters and their gradients
    always keep the original dtype, so the optimizer steps in full precision.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a floating-point torch.dtype, got {dtype!r}")


def cast_floats(value, dtype: torch.dtype | None):
    """``value`` with every floating-point tensor in it (nested in tuples, lists, dicts) as ``dtype``."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        items = [cast_floats(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value
