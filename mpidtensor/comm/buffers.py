"""The one path from torch tensors to mpi4py buffers.

* ``mpi_type``: the MPI datatype of a torch dtype; dtypes MPI lacks (bfloat16,
  float16, complex32, float8...) travel as opaque elements of their byte size.
* ``stage`` / ``empty`` / ``unstage``: inputs and outputs live on the
  *communication device* - the tensor's own device, except that CUDA tensors are
  staged through host memory when MPI is not CUDA-aware. This is the only place
  that decision is made.
* ``as_buffer``: a zero-copy byte view of a C-contiguous tensor (its raw address on
  the host, CuPy on a GPU), always paired with an explicit MPI datatype;
  ``contiguous_buffer`` / ``host_buffer`` the same for a tensor already known to be
  C-contiguous (on either device / on the host), without the check.
* ``derived``: a cache of committed derived datatypes, freed on eviction.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import cache
from typing import Any, Callable, Hashable

import torch
from mpi4py import MPI

from ..runtime.mpi_library import query_cuda_support
from .pool import Reuse, pool, tracked_empty
from ..runtime.settings import settings

_MPI_TYPES: dict[torch.dtype, MPI.Datatype] = {
    torch.float64: MPI.DOUBLE,
    torch.float32: MPI.FLOAT,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.int16: MPI.INT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint64: MPI.UINT64_T,
    torch.uint32: MPI.UINT32_T,
    torch.uint16: MPI.UINT16_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
}


def has_mpi_type(dtype: torch.dtype) -> bool:
    """Whether MPI can do arithmetic on ``dtype`` (otherwise it only moves bytes)."""
    return dtype in _MPI_TYPES


@cache  # not cleared: one datatype per dtype, for the process (committed types are kept)
def mpi_type(dtype: torch.dtype) -> MPI.Datatype:
    """The MPI datatype for one element of ``dtype`` (opaque bytes if MPI has none)."""
    if dtype in _MPI_TYPES:
        return _MPI_TYPES[dtype]
    return MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()


class _TypeCache:
    """Committed derived datatypes by key; least recently used ones are freed."""

    def __init__(self, maxsize: int) -> None:
        self._types: OrderedDict[Hashable, MPI.Datatype] = OrderedDict()
        self._maxsize = maxsize

    def __call__(self, key: Hashable, make: Callable[[], MPI.Datatype]) -> MPI.Datatype:
        datatype = self._types.get(key)
        if datatype is None:
            datatype = self._types[key] = make().Commit()
            if len(self._types) > self._maxsize:
                self._types.popitem(last=False)[1].Free()
        else:
            self._types.move_to_end(key)
        return datatype


# One collective holds at most 2 types per rank of its communicator; the cache must be
# at least that big so that none is freed while the collective is being set up.
derived = _TypeCache(maxsize=256 + 2 * MPI.COMM_WORLD.size)


def cuda_aware() -> bool:
    """Whether MPI may be handed device pointers: ``settings.cuda_aware``
    (``MPIDTENSOR_CUDA_AWARE=0|1``) where set, else what the MPI library answers."""
    override = settings.cuda_aware
    return _mpi_cuda_support() if override is None else override


@cache  # not cleared: fixed for the process
def _mpi_cuda_support() -> bool:
    """``MPIX_Query_cuda_support()`` of the loaded libmpi; False where it cannot tell."""
    return bool(query_cuda_support())


def comm_device(tensor: torch.Tensor) -> torch.device:
    """Where ``tensor``'s data must be for MPI to read or write it."""
    if tensor.device.type == "cuda" and not cuda_aware():
        return torch.device("cpu")
    return tensor.device


def stage(tensor: torch.Tensor, dtype: torch.dtype | None = None, *, copy: bool = False) -> torch.Tensor:
    """``tensor``'s data, detached and C-contiguous on the communication device, as ``dtype``.

    A view of ``tensor`` when nothing needs to change, unless ``copy``. A tensor subclass
    that dispatches its own ops (torchao's float8 or NF4 weights, DTensor local tensors of
    FSDP-sharded quantized parameters) has no memory MPI could read: its values are copied
    out through its own ``copy_``.
    """
    if type(tensor) is not torch.Tensor and type(tensor).__torch_dispatch__ is not _PLAIN_DISPATCH:
        tensor = _values(tensor)
    if (not copy and not tensor.is_cuda and (dtype is None or dtype == tensor.dtype)
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()):
        return tensor.detach() if tensor.requires_grad else tensor  # the common case: cheap checks only
    data = tensor.detach().resolve_conj().resolve_neg()
    data = data.to(comm_device(tensor), dtype, memory_format=torch.contiguous_format, copy=copy)
    return data.contiguous()  # ``to`` honours memory_format only when it copies


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """A dispatching subclass's values as a plain tensor."""
    plain = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        return plain.copy_(tensor)


def empty(shape: torch.Size | tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised C-contiguous tensor on ``like``'s communication device; on the
    host from the buffer pool (``comm.pool``), elsewhere from torch's allocator."""
    if not like.is_cuda and pool.limit_bytes:
        return pool.take(shape, dtype or like.dtype)  # a torch.Size keys the pool as its tuple does
    return tracked_empty(shape, dtype or like.dtype, comm_device(like))


def unstage(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``result`` (a C-contiguous tensor on ``like``'s communication device) on ``like``'s
    device as ``like``'s dtype; itself when it is already so."""
    if result.dtype == like.dtype and (not like.is_cuda or result.device == like.device):
        return result
    return result.to(like.device, like.dtype, memory_format=torch.contiguous_format).contiguous()


from_address = MPI.buffer.fromaddress  # (address, bytes): what ``host_buffer`` makes


def as_buffer(tensor: torch.Tensor) -> Any:
    """A zero-copy byte view of a C-contiguous tensor that mpi4py accepts as a buffer.

    On the host it is a raw address and length (``MPI.buffer.fromaddress``, ~20x cheaper
    than a NumPy view): the caller keeps ``tensor`` alive until MPI is done with it."""
    if not tensor.is_contiguous():
        raise ValueError("only C-contiguous tensors may be handed to MPI")
    return from_address(tensor.data_ptr(), tensor.nbytes) if not tensor.is_cuda else _device_buffer(tensor)


def contiguous_buffer(tensor: torch.Tensor) -> Any:
    """``as_buffer`` of a tensor its caller knows to be C-contiguous, on either device,
    without checking it (point-to-point messages of staged or packed tensors)."""
    return from_address(tensor.data_ptr(), tensor.nbytes) if not tensor.is_cuda else _device_buffer(tensor)


def host_buffer(tensor: torch.Tensor) -> Any:
    """``as_buffer`` of a tensor its caller knows to be a C-contiguous host tensor, without
    checking it: for the prepared collectives, whose calls check their inputs once."""
    return from_address(tensor.data_ptr(), tensor.nbytes)


def _device_buffer(tensor: torch.Tensor) -> Any:
    """A CuPy byte array over a C-contiguous CUDA tensor, once its stream's work is done."""
    # bytes (NumPy/CuPy lack some torch dtypes); as_strided, since a contiguous tensor of
    # 0 or 1 element may carry any stride, which reshape would keep and view refuse
    data = tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8)
    import cupy  # lazily: only CUDA tensors need it

    torch.cuda.current_stream(data.device).synchronize()
    with cupy.cuda.Device(data.device.index):
        return cupy.asarray(data)


def reuse(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Reuse:
    """Host outputs of ``shape`` and ``dtype`` for a caller that asks again and again (a
    prepared collective's runner): ``take()`` gives ``(tensor, its host_buffer)``, the
    buffer it gave last again when nothing else refers to it."""
    return Reuse(pool, shape, dtype, host_buffer)
