"""The policies ``fully_shard`` takes: ``MixedPrecisionPolicy`` (the dtypes FSDP computes,
reduces and returns in) and ``OffloadPolicy`` / ``CPUOffloadPolicy`` (where FSDP keeps the
sharded state), with the helpers that apply them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mesh import DeviceMesh


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


@dataclass
class OffloadPolicy:
    """As ``torch.distributed.fsdp.OffloadPolicy``: the base class, meaning no offloading;
    the default ``offload_policy`` of ``fully_shard``."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """As ``torch.distributed.fsdp.CPUOffloadPolicy``: sharded parameters, their gradients
    and so the optimizer step and its state live in host memory. Before each all-gather
    the sharded parameters are copied to the mesh's device; after each reduce-scatter
    the gradient shards are copied back to the host.

    On a CPU mesh the parameters already live in host memory: the policy is accepted
    and changes nothing (nothing is copied, and ``pin_memory`` has no accelerator to pin
    for). A parameter on a device that is neither the host, ``meta`` (deferred init) nor
    the mesh's device type cannot be served: ``fully_shard`` raises ``ValueError``.

    ``pin_memory``: page-lock the host shards for faster copies (``cuda`` meshes only).
    """

    pin_memory: bool = True


def check_offload_policy(policy: object, devices: set[torch.device], mesh: DeviceMesh) -> None:
    """Raise (before ``fully_shard`` changes anything) if ``policy`` is not an
    ``OffloadPolicy`` or cannot serve parameters on ``devices``. Only global facts are
    read (the policy, the mesh, where the model was built), so every rank agrees."""
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(policy).__name__}")
    if not isinstance(policy, CPUOffloadPolicy):
        return
    served = {"cpu", "meta", mesh.device_type}
    bad = sorted(str(d) for d in devices if d.type not in served)
    if bad:
        raise ValueError(
            f"CPUOffloadPolicy cannot serve parameters on {bad}: it keeps shards in host memory and copies "
            f"them to the mesh's {mesh.device_type!r} device; build the module on cpu, meta or {mesh.device_type}"
        )


def host_device(policy: OffloadPolicy, mesh: DeviceMesh, device: torch.device) -> torch.device | None:
    """Where the sharded state goes if ``policy`` moves it off ``device`` (the compute
    device), else ``None``: only a CPU policy on a non-CPU mesh moves anything."""
    if isinstance(policy, CPUOffloadPolicy) and mesh.device_type != "cpu" and device.type != "meta":
        return torch.device("cpu")
    return None


def compute_device(mesh: DeviceMesh) -> torch.device:
    """The device the mesh computes on (this rank's current GPU on a ``cuda`` mesh)."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def pinned(policy: OffloadPolicy, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` page-locked if the policy asks for it and there is an accelerator to pin for."""
    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and tensor.device.type == "cpu" \
            and torch.cuda.is_available():
        return tensor.pin_memory()
    return tensor
