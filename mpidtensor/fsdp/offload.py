"""``OffloadPolicy`` and ``CPUOffloadPolicy``: where FSDP keeps the sharded state."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mesh import DeviceMesh


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
