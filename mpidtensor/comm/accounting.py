"""The host bytes mpidtensor holds, for :mod:`mpidtensor.tools.memory`'s statistics.

Three kinds, each with its current figure and peak:

* **library**: buffers the library allocated outside the pool and registered here
  (``track_buffer``; FSDP's shard and unsharded buffers, re-measured after an in-place
  ``resize_`` by ``track_resize``); a weak reference to each storage tells when it is freed;
* **pool**: buffers of :mod:`.pool` that are handed out (``pool_handed_out``, until
  ``pool_returned``); a hand-out counts as an allocation, as one from torch's cache does; the
  pool's idle buffers are cached, not allocated, like torch's caching allocator's;
* **dtensor**: storages of live DTensors' local tensors that are not library buffers,
  registered when :mod:`mpidtensor.tools.memory` scans for them (``register_dtensor``).

Storages are counted once however many tensors view them.
"""
from __future__ import annotations

import weakref

import torch

KINDS = ("library", "pool", "dtensor")

_storages: dict[int, tuple[weakref.ref, int, str]] = {}  # not cleared: live storages, id -> (ref, nbytes, kind)
current = {kind: 0 for kind in KINDS}
peak = {kind: 0 for kind in (*KINDS, "all")}
counts = {"allocated": 0, "freed": 0, "allocated_bytes": 0, "freed_bytes": 0}


def track_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Register a buffer the library allocated (returned unchanged) and update the peaks."""
    if is_host_tensor(tensor):
        _register(tensor.untyped_storage(), "library")
        update_peaks()
    return tensor


def track_resize(tensor: torch.Tensor, storage: torch.UntypedStorage | None = None, nbytes: int | None = None) -> None:
    """Re-read the size of ``tensor``'s storage (``storage``, if the caller holds it; ``nbytes``,
    its size, if the caller knows it) after an in-place ``resize_``, registering it if new,
    and update the peaks."""
    if type(tensor) not in _HOST_TYPES or tensor.device.type != "cpu":  # ``is_host_tensor``, inline: FSDP
        return  # resizes its unsharded buffers twice a step
    if storage is None:
        storage = tensor.untyped_storage()
    key = id(storage)
    entry = _storages.get(key)
    if entry is None:
        _register(storage, "library")
        update_peaks()
        return
    ref, old, kind = entry
    new = storage.nbytes() if nbytes is None else nbytes
    _storages[key] = (ref, new, kind)
    current[kind] += new - old
    if new > old:
        counts["allocated_bytes"] += new - old
        update_peaks()  # (only a growth can raise them)
    else:
        counts["freed_bytes"] += old - new


def pool_handed_out(nbytes: int) -> None:
    """The pool handed out a buffer of ``nbytes`` (an allocation from its cache)."""
    current["pool"] += nbytes
    counts["allocated"] += 1
    counts["allocated_bytes"] += nbytes
    update_peaks()


def pool_reused(nbytes: int, times: int = 1) -> None:
    """Handed-out pool buffers of ``nbytes`` in all came back and went out again ``times``
    times: as many frees and allocations, the current figure unchanged."""
    counts["allocated"] += times
    counts["freed"] += times
    counts["allocated_bytes"] += nbytes
    counts["freed_bytes"] += nbytes


def pool_returned(nbytes: int) -> None:
    """A handed-out pool buffer of ``nbytes`` was seen back (or dropped)."""
    current["pool"] -= nbytes
    counts["freed"] += 1
    counts["freed_bytes"] += nbytes


def register_dtensor(local: torch.Tensor) -> None:
    """Count a live DTensor's local storage (once; no-op if already counted)."""
    if is_host_tensor(local):
        _register(local.untyped_storage(), "dtensor")


_HOST_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_host_tensor(tensor: torch.Tensor) -> bool:
    """A real CPU tensor (not a fake, meta or functional one made while tracing)."""
    return type(tensor) in _HOST_TYPES and tensor.device.type == "cpu"


def update_peaks() -> None:
    for kind in KINDS:
        if current[kind] > peak[kind]:
            peak[kind] = current[kind]
    total = current["library"] + current["pool"] + current["dtensor"]
    if total > peak["all"]:
        peak["all"] = total


def reset_peaks() -> None:
    for kind in KINDS:
        peak[kind] = current[kind]
    peak["all"] = sum(current.values())


def live_storages() -> int:
    return len(_storages)


def _register(storage: torch.UntypedStorage, kind: str) -> None:
    key = id(storage)
    if key in _storages:
        return
    nbytes = storage.nbytes()
    _storages[key] = (weakref.ref(storage, lambda _, key=key: _release(key)), nbytes, kind)
    current[kind] += nbytes
    counts["allocated"] += 1
    counts["allocated_bytes"] += nbytes


def _release(key: int) -> None:
    _, nbytes, kind = _storages.pop(key)
    current[kind] -= nbytes
    counts["freed"] += 1
    counts["freed_bytes"] += nbytes
