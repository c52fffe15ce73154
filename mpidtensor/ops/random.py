"""Layout-invariant random ops: under one seed they give the same GLOBAL tensor
whatever the mesh and the placements, on CPU and CUDA.

Each call draws one seed from torch's generator for the device (the default one,
or the op's ``generator=``); every rank draws alike, so generators stay in step.
Torch seeds each process differently, so the first random op on a mesh copies the
default generator's state of the mesh's first rank to the others (as
torch.distributed.tensor does); later seeding, and any explicit ``generator=``,
must be the same on every rank.
Each element is then a pure function of (seed, its GLOBAL row-major linear index):
a counter-based hash (SplitMix64, in wrapping int64 torch ops on the device,
vectorised over the local block) gives its random bits. Uniforms take the top 24
(53 for float64) bits, normals use Box-Muller,
Bernoulli draws compare a uniform with ``p``. So a run is reproducible when the
parallel layout changes, but the values differ from plain (undistributed) torch.

Outputs keep the input's placements; Partial becomes Replicate (fresh values are
not partial sums), except dropout, which keeps Partial sum/avg/max/min: its mask
depends only on the global index, so it is the same on every partial rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..tensor.layout import Runs, contiguous_strides, dim_runs
from ..runtime import watchdog
from ..tensor.placements import Partial, Replicate, _StridedShard
from ..tensor.spec import DTensorSpec
from .registry import OpCall, Sharding, register, replicate_all, takes_strided

aten = torch.ops.aten


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


_GAMMA = _signed(0x9E3779B97F4A7C15)  # SplitMix64 increment
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_STREAMS = 2  # counters per element: normals need two uniforms

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# Half types round 24-bit uniforms; those that round up to 1 become the largest value below it.
_BELOW_ONE = {torch.float16: 1 - 2.0 ** -11, torch.bfloat16: 1 - 2.0 ** -8}


@dataclass(frozen=True)
class Block:
    """This rank's block of a global tensor: local shape and offset, global shape, and
    where a ``_StridedShard`` gives a dim several runs of global indices, every dim's runs."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    runs: tuple[Runs, ...] | None = None  # per dim, (offset, size) runs; None: one span per dim

    @staticmethod
    def of(spec: DTensorSpec) -> "Block":
        shape, offset = spec.local_shape_and_offset()
        runs = None
        if any(type(p) is _StridedShard for p in spec.placements):
            runs = tuple(dim_runs(n, d, spec.placements, spec.mesh.shape, spec.mesh._coord)
                         for d, n in enumerate(spec.shape))
        return Block(tuple(shape), tuple(offset), tuple(spec.shape), runs)

    def _indices(self, d: int, device) -> torch.Tensor:
        """The global indices along dim ``d`` that this block holds, in order."""
        if self.runs is None:
            return torch.arange(self.offset[d], self.offset[d] + self.shape[d], device=device)
        return torch.cat([torch.arange(o, o + n, device=device) for o, n in self.runs[d]] or
                         [torch.zeros(0, dtype=torch.int64, device=device)])

    def linear_index(self, device) -> torch.Tensor:
        """The global row-major index of every local element (int64, local shape)."""
        strides = contiguous_strides(self.global_shape)
        if self.runs is None and self.shape[1:] == self.global_shape[1:]:  # whole rows: one contiguous range
            start = self.offset[0] * strides[0] if self.shape else 0
            return torch.arange(start, start + math.prod(self.shape), device=device).view(self.shape)
        index = torch.zeros((), dtype=torch.int64, device=device)
        for d, s in enumerate(strides):
            index = index.unsqueeze(-1) + self._indices(d, device) * s
        return index


def sync_default_generator(mesh, device: torch.device) -> None:
    """Give every rank of ``mesh`` the state of the default generator of ``device`` on the
    mesh's first rank, once per mesh (collective over the mesh on its first call). The mesh
    keeps the generators it synced (``_synced_generators``): the record lives and dies with it."""
    gen = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    if id(gen) in mesh._synced_generators:
        return
    comm = mesh.comm
    gen.set_state(watchdog.call("the random generator's state from the mesh's first rank (bcast)", comm, comm.bcast,
                                gen.get_state() if comm.rank == 0 else None, 0))
    mesh._synced_generators.add(id(gen))


def _mesh_device(mesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def draw_seed(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """One 63-bit seed from ``generator`` (default: torch's for ``device``), as a 0-d
    int64 tensor on ``device`` (no host sync on a GPU)."""
    return torch.empty((), dtype=torch.int64, device=device).random_(generator=generator)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (a new tensor)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in place (wrapping int64 arithmetic): one temporary at a time."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_shr(z, 31))


def random_bits(seed: torch.Tensor, block: Block, stream: int = 0) -> torch.Tensor:
    """64 random bits (int64) per element of ``block``, from (seed, global index, stream)."""
    state = block.linear_index(seed.device).mul_(_STREAMS).add_(stream).mul_(_GAMMA)
    return _mix_(state.add_(_mix_(seed.clone())))


def uniform(seed: torch.Tensor, block: Block, dtype: torch.dtype, stream: int = 0) -> torch.Tensor:
    """U[0, 1) in ``dtype``: the top 53 bits for float64, 24 bits otherwise."""
    bits, work = (53, torch.float64) if dtype == torch.float64 else (24, torch.float32)
    u = _shr(random_bits(seed, block, stream), 64 - bits).to(work).mul_(2.0 ** -bits).to(dtype)
    return u.clamp_(max=_BELOW_ONE[dtype]) if dtype in _BELOW_ONE else u


def normal(seed: torch.Tensor, block: Block, dtype: torch.dtype, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """N(mean, std^2) by Box-Muller from two uniforms per element."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u1 = 1.0 - uniform(seed, block, work, 0)  # (0, 1]: log is finite
    u2 = uniform(seed, block, work, 1)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.mul_(std).add_(mean).to(dtype)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype Bernoulli draws compare uniforms in for a tensor of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bernoulli(seed: torch.Tensor, block: Block, p, dtype: torch.dtype) -> torch.Tensor:
    """1 with probability ``p`` (a float or a tensor of the block's shape), else 0, in ``dtype``."""
    return (uniform(seed, block, _work_dtype(dtype)) < p).to(dtype)


# --- rules --------------------------------------------------------------------------------------


def _fresh_placements(spec: DTensorSpec) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)


def _out_spec(call: OpCall, placements) -> DTensorSpec:
    out = call.out_metas()[0]
    return DTensorSpec(call.mesh, placements, out.shape, out.stride(), out.dtype)


def _arg(call_args: Sequence, kwargs: dict, position: int, name: str, default):
    return call_args[position] if len(call_args) > position else kwargs.get(name, default)


def _sampler(func, args: Sequence, kwargs: dict):
    """``(seed, block, dtype) -> values`` for one call of ``func`` (None: not layout-invariant here)."""
    name = func._schema.name.split("::")[-1]
    if name == "uniform_":
        low, high = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
        return lambda s, b, dt: uniform(s, b, dt).mul_(high - low).add_(low)
    if name == "normal_":
        mean, std = _arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0)
        return lambda s, b, dt: normal(s, b, dt, mean, std)
    if name == "exponential_":
        lambd = _arg(args, kwargs, 1, "lambd", 1.0)
        return lambda s, b, dt: torch.log1p(-uniform(s, b, dt)).mul_(-1.0 / lambd)
    if name in ("bernoulli_", "bernoulli") and func._overloadname in ("float", "p"):
        p = _arg(args, kwargs, 1, "p", 0.5)
        return lambda s, b, dt: bernoulli(s, b, p, dt)
    if name == "rand_like":
        return uniform
    if name == "randn_like":
        return normal
    if name == "randint_like":
        low, high = (0, args[1]) if func._overloadname == "default" else (args[1], args[2])
        return lambda s, b, dt: _randint(s, b, low, high, dt)
    return None


def _randint(seed: torch.Tensor, block: Block, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers uniform in [low, high) (53-bit uniforms: exact for ranges up to 2**53)."""
    u = uniform(seed, block, torch.float64)
    return torch.floor(u * (high - low)).clamp_(max=high - low - 1).to(torch.int64).add_(low).to(dtype)


def _supported(dtype: torch.dtype, func) -> bool:
    name = func._schema.name.split("::")[-1]
    return dtype in _FLOATS or name in ("bernoulli_", "bernoulli", "randint_like")


@register(
    aten.uniform_.default, aten.normal_.default, aten.exponential_.default, aten.bernoulli_.float,
    aten.bernoulli.p, aten.rand_like.default, aten.randn_like.default,
    aten.randint_like.default, aten.randint_like.low_dtype,
)
@takes_strided
def fill_random(call: OpCall) -> Sharding:
    """Fresh values over the input's layout (Partial becomes Replicate; a ``_StridedShard``
    stays, its runs drawn at their global indices); the input is not moved, so an in-place
    fill keeps a parameter's placements (FSDP's strided ones under TP included)."""
    sync_default_generator(call.mesh, _mesh_device(call.mesh))
    self = call.tensor_specs[0]
    out_dtype = call.out_metas()[0].dtype
    sample = _sampler(call.func, call.args, call.kwargs)
    if sample is None or not _supported(out_dtype, call.func):
        return replicate_all(call)  # generators in step: every replica draws the same values
    placements = _fresh_placements(self)
    block = Block.of(_out_spec(call, placements))
    inplace = call.func._schema.name.endswith("_")
    overwrite = inplace and placements == self.placements

    def local(args, kwargs):
        t = args[0]
        values = sample(draw_seed(t.device, kwargs.get("generator")), block, out_dtype)
        # In place: write into the local tensor, unless it held a Partial (then a new local
        # tensor tells the dispatcher that the placements changed).
        return t.copy_(values) if overwrite else values

    return Sharding([None], [placements], local)


@register(aten.bernoulli.default)
def bernoulli_probs(call: OpCall) -> Sharding:
    """``torch.bernoulli(probs)``: the probabilities must be whole values (Partial is reduced)."""
    sync_default_generator(call.mesh, _mesh_device(call.mesh))
    self = call.tensor_specs[0]
    dtype = call.out_metas()[0].dtype
    if dtype not in _FLOATS:
        return replicate_all(call)
    placements = _fresh_placements(self)
    block = Block.of(self.with_placements(placements))

    def local(args, kwargs):
        probs = args[0]
        return bernoulli(draw_seed(probs.device, kwargs.get("generator")), block, probs, dtype)

    return Sharding([placements], [placements], local)


_DROPOUT_KEEPS = ("sum", "avg", "max", "min")  # x * mask * scale (scale > 0) commutes with these


@register(aten.native_dropout.default)
def native_dropout(call: OpCall) -> Sharding:
    """``(x * mask / (1 - p), mask)`` with mask ~ Bernoulli(1 - p), drawn exactly like
    ``x.new_empty(...).bernoulli_(1 - p)`` (the path eager CPU dropout takes)."""
    sync_default_generator(call.mesh, _mesh_device(call.mesh))
    self = call.tensor_specs[0]
    p, train = call.args[1], call.args[2]
    if self.dtype not in _FLOATS:
        return replicate_all(call)
    mask_placements = _fresh_placements(self)
    out_placements = tuple(
        q if isinstance(q, Partial) and q.reduce_op in _DROPOUT_KEEPS else m
        for q, m in zip(self.placements, mask_placements)
    )
    inputs = [out_placements]
    if train is False:  # (torch's own kernel gives an empty shard a float mask)
        return Sharding(inputs, [out_placements, mask_placements], _keep_all)
    block = Block.of(self.with_placements(mask_placements))
    keep_p = 1.0 - p
    scale = 0.0 if keep_p == 0 else 1.0 / keep_p

    def local(args, kwargs):
        x = args[0]
        mask = uniform(draw_seed(x.device), block, _work_dtype(x.dtype)) < keep_p
        return x * mask * scale, mask

    return Sharding(inputs, [out_placements, mask_placements], local)


def _keep_all(args, kwargs):
    x = args[0]
    return x.clone(), torch.ones_like(x, dtype=torch.bool)
