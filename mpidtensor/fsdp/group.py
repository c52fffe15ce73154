"""The parameters of one ``fully_shard`` call, communicated together: the group's state
machine (``ShardedState``) and its collectives.

Which form of the parameters the modules hold is ``ParamGroup.sharded_state``; each
transition is one method that checks the state it leaves:

* ``start_unshard``: ``SHARDED`` or ``SHARDED_POST_FORWARD`` -> ``UNSHARDING``: one
  ``Iallgather`` of every rank's send buffer (``packing``), in rank order, into a pooled
  buffer (``comm.pool``); from ``SHARDED_POST_FORWARD`` over the subgroup of
  ``reshard_after_forward=k`` ranks only, from the rows each rank kept. On the host, a group
  of one plain parameter split evenly along dim 0 is gathered straight into
  ``unsharded_flat`` (the ranks' shards back to back are the parameter), and a group of
  plain dim-0 shards in their own dtype by one ``Ialltoallw`` whose receive datatypes put
  each rank's shards in their places there, or for a large group one ``Iallgatherv`` per
  parameter straight into it (``comm.placed``, ``PLACED_GATHER``: no copy out).
* ``finish_unshard``: ``UNSHARDING`` -> ``UNSHARDED``: wait, copy the rows (if any) into
  ``unsharded_flat`` (or an extension's outputs, then its ``fsdp_post_all_gather``) and
  register the unsharded parameters on the modules.
* ``reshard_post_forward``: ``UNSHARDED`` -> ``SHARDED_POST_FORWARD`` (keep this rank's
  ``world / k`` rows of the all-gather input) or ``SHARDED``.
* ``reshard``: any state -> ``SHARDED``: register the sharded parameters, free
  ``unsharded_flat``'s storage (``resize_(0)``: the next all-gather refills the same
  tensors, so autograd's saved references stay valid) and drop a prefetch nobody used.

Gradients: ``gradients.GradientReduction`` (``post_backward`` then ``finish_reduce``).
Replicated parameters (TP-sharded on every dim) are neither gathered nor scattered: their
unsharded form is their local block.

``CPUOffloadPolicy`` on a non-CPU mesh: ``shard_flat`` and the ``.grad`` shards on the
host, copied to the device for the all-gather and back after the reduce-scatter.
``shard_flat`` and ``unsharded_flat`` are registered with ``comm.accounting`` (and every
resize reported), so ``memory_allocated()`` shows sharded + currently gathered bytes.
"""
from __future__ import annotations

from enum import Enum, auto
from operator import attrgetter
from typing import Callable

import torch
from mpi4py import MPI

from ..comm import accounting
from ..runtime.agreement import attempt, exchange
from ..comm.nonblocking import Handle, PostedAllGather
from ..comm.placed import PlacedAllGather, pays as placed_pays
from ..fast.registry import register
from ..runtime.settings import settings
from ..comm.pool import HUGE_PAGES_MIN, advise_huge_pages, tracked_empty
from . import collectives, packing
from .float8 import whole_weight_scales
from .packing import FromRanks, Piece
from .gradients import GradientReduction
from .param import FSDPParam, MeshInfo
from .policies import MixedPrecisionPolicy, OffloadPolicy, compute_device, host_device, pinned


POSTED_GATHER = register(
    "fsdp.posted_gather",
    shortcuts="FSDP's all-gather of a group over the shard ranks through collectives.start_all_gather "
              "(iall_gather: its checks, staging, buffer and MPI arguments made every step)",
    decided_by="the group's layout, made by its first all-gather: host buffers, 2+ shard ranks, torch's "
               "default collective (no set_custom_all_gather)",
)
PLACED_GATHER = register(
    "fsdp.placed_gather",
    shortcuts="FSDP's all-gather of a group into (ranks, bytes) rows and the copy out into the unsharded "
              "parameters (split_with_sizes_copy or FromRanks): one Ialltoallw places each rank's shards "
              "(one Iallgatherv per parameter from comm.placed.BY_PIECE_MIN bytes per rank)",
    decided_by="the group's layout (packing.placed_pieces): plain parameters sharded along dim 0 in their own "
               "dtype, host buffers, no offloading, 3+ shard ranks (2 from BY_PIECE_MIN bytes per rank: "
               "comm.placed.pays), torch's default collective",
)


class ShardedState(Enum):
    """Which form of a group's parameters its modules hold (torch's FSDP2 ``ShardedState``,
    plus the all-gather in flight)."""

    SHARDED = auto()  # the sharded parameters; nothing gathered
    SHARDED_POST_FORWARD = auto()  # the sharded ones; this rank keeps its subgroup rows of the last gather
    UNSHARDING = auto()  # the sharded ones; an all-gather in flight (a prefetch, unshard(async_op=True))
    UNSHARDED = auto()  # the unsharded parameters, gathered


_data_ptr, _local_of, _sharded_of = torch.Tensor.data_ptr, attrgetter("_local_tensor"), attrgetter("sharded")
_unsharded_of, _version_of = attrgetter("unsharded"), attrgetter("_version")
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled

# The members as module constants: reading an Enum member off its class costs ~10x a
# global lookup in Python 3.11, and these are compared on every hook of every step.
SHARDED, SHARDED_POST_FORWARD = ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD
UNSHARDING, UNSHARDED = ShardedState.UNSHARDING, ShardedState.UNSHARDED


class ParamGroup(GradientReduction):
    """Flat buffers, all-gather, reshard and gradient reduce-scatter of one group."""

    def __init__(self, params: list[FSDPParam], info: MeshInfo, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int, offload: OffloadPolicy = OffloadPolicy()) -> None:
        self.params = params
        self.info = info
        self.mp = mp
        # int: after forward keep the parameters gathered over a subgroup of that many ranks
        self.post_forward_comm = info.subgroup(reshard_after_forward) if type(reshard_after_forward) is int else None
        self.reshard_after_forward = bool(reshard_after_forward)
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        # settings of FSDPModule's set_* methods (torch's defaults)
        self.requires_all_reduce = True
        self.unshard_in_backward = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.custom_all_gather = self.custom_reduce_scatter = None
        self.reduce_scatter_unused_params = False  # zero gradients for parameters backward left out
        self.reduce_scatter_max_input_buffers = 1  # reduce-scatters left in flight (FSDPState._reduced)
        self.reduce_scatter_comm = info.shard_comm  # set_separate_reduce_scatter_group: a duplicate
        self.allocate_from_process_group = False  # stored only: NCCL's allocator (FSDPModule docstring)
        self.symm_mem_backend: str | None = None  # stored only: NCCL symmetric memory
        trainable = [p for p in params if p.requires_grad]
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype or (trainable[0].orig_dtype if trainable else None)
        self.gathered = [p for p in params if not p.replicated]
        self._plain = [p for p in self.gathered if not p.extension]
        self._extensions = [(i, p) for i, p in enumerate(self.gathered) if p.extension]
        self._replicated = [p for p in params if p.replicated]
        self._users = [(module, name, p) for p in params for module, name in p.users]
        self.direct = all(not p.extension and p.param_dtype == p.orig_dtype for p in self.gathered)
        shard_total, self.unsharded_nbytes = packing.place(self.gathered)
        # one parameter, even dim-0 shards: a plain Iallgather lays it out (2x faster than
        # Ialltoallw at 4 MiB with one rank per core; docs/performance.md "FSDP step")
        only = self.gathered[0] if len(self.gathered) == 1 else None
        self._rank_major = only is not None and only.pre == 1 and only.rows % info.shard_size == 0
        # a group mixing meta parameters (deferred init) with real ones lives on the real device
        built_on = next((p.initial_local.device for p in params if not p.initial_local.is_meta),
                        params[0].initial_local.device)
        self.offload_to = host_device(offload, info.mesh, built_on)  # where sharded state lives, if moved
        self.device = compute_device(info.mesh) if self.offload_to else built_on  # gathered params, gradients
        self.shard_flat = accounting.track_buffer(pinned(offload, torch.zeros(
            shard_total, dtype=torch.uint8, device=self.offload_to or self.device)))
        with torch.no_grad():
            for p in params:
                if p.extension or p.replicated:
                    local = p.initial_local if self.offload_to is None else p.initial_local.to(self.offload_to)
                else:  # a meta parameter's slot: zeros until assigned or loaded (torch keeps it on meta)
                    local = packing.shard_slot(self.shard_flat, p)
                    if not p.initial_local.is_meta:
                        local.copy_(p.initial_local)
                p.make_sharded(local)
                p.initial_local = None
        self.sharded_state = SHARDED
        self.unsharded_flat: torch.Tensor | None = None
        # the all-gather input's layout, made by the first all-gather (extensions' inputs decide it)
        self.pieces: list[list[Piece]] | None = None
        self.gather_nbytes = 0
        self.split_sizes: list[int] | None = None  # packing.split_sizes
        self._split_views: tuple[torch.Tensor | None, list[torch.Tensor]] = (None, [])
        self._from_ranks: FromRanks | None = None
        self._input_kinds: dict[int, list[tuple[torch.dtype, tuple[int, ...]]]] = {}  # first extension inputs
        # UNSHARDING: the all-gather and whether it writes into unsharded_flat itself
        self._gather: tuple[Handle | PostedAllGather | collectives.NoGather, bool] | None = None
        self._posted: PostedAllGather | None = None  # the prepared all-gather over the shard ranks (_prepare_gather)
        self._placed: PlacedAllGather | None = None  # the all-gather straight into unsharded_flat (_prepare_gather)
        self._in_place = False  # the all-gather may write into unsharded_flat (_prepare_gather)
        self._meta: dict[int, object] = {}  # extensions' fsdp_pre_all_gather metadata, for the post hook
        self._kept: torch.Tensor | None = None  # SHARDED_POST_FORWARD: this rank's rows of a gather
        self._kept_meta: dict[int, object] = {}
        self._pending: tuple[Handle | None, list[FSDPParam], Handle | None, list[FSDPParam]] | None = None
        self._divide: tuple[tuple | None, tuple] = (None, ())  # GradientReduction._factors: its settings, factors
        self._scatters = collectives.reduce_scatters(self.reduce_scatter_comm)
        self._scatter: collectives.GroupScatter | None = None  # GradientReduction.prepare_scatter
        self.prepare_scatter()
        self._partial: torch.Tensor | None = None  # HSDP: reduce-scattered, not yet all-reduced (summed)
        self._slots: tuple[int, list[int]] = (-1, [])  # shard_flat's address, the plain shards' addresses in it
        self._storage: tuple[torch.Tensor | None, torch.UntypedStorage | None] = (None, None)  # _storage_of

    # --- sharded storage -----------------------------------------------------------------------
    def sync(self) -> None:
        """Make every sharded parameter a view into ``shard_flat`` again, after
        ``load_state_dict(assign=True)``, ``to_empty`` or a moved module replaced it."""
        for p in self.params:
            module, name = p.users[0]
            current = module._parameters[name]
            if current is not p.sharded and current is not p.unsharded:
                p.adopt(current)
        plain = self._plain
        if not plain:
            return
        device = plain[0].sharded._local_tensor.device
        if device != self.shard_flat.device:
            if self.offload_to is None:
                self.device = device
            self.shard_flat = accounting.track_buffer(torch.zeros(self.shard_flat.numel(), dtype=torch.uint8, device=device))
            self.unsharded_flat, self._storage = None, (None, None)
            for p in self.params:
                p.forget_gathered()
            self._prepare_gather()
        base = self.shard_flat.data_ptr()
        if self._slots[0] != base:
            self._slots = (base, [base + p.shard_offset for p in plain])
        if list(map(_data_ptr, map(_local_of, map(_sharded_of, plain)))) == self._slots[1]:
            return  # the common case: nothing moved (C-level loops, run before every all-gather)
        with torch.no_grad():
            for p in plain:
                if p.sharded._local_tensor.data_ptr() != base + p.shard_offset:
                    slot = packing.shard_slot(self.shard_flat, p)
                    slot.copy_(p.sharded._local_tensor)
                    p.sharded._local_tensor = slot

    # --- SHARDED / SHARDED_POST_FORWARD -> UNSHARDING -------------------------------------------------
    def start_unshard(self) -> None:
        """Issue this group's all-gather (non-blocking); ``finish_unshard`` completes it.
        Nothing to do once it is in flight or done."""
        state = self.sharded_state
        if state is UNSHARDING or state is UNSHARDED:
            return
        if state is SHARDED_POST_FORWARD:  # gather the rows kept after forward over the subgroup
            kept, self._kept = self._kept, None
            self._meta = dict(self._kept_meta)
            self._start_gather(kept, self.post_forward_comm)
            return
        self.sync()
        if self._extensions or self.pieces is None:
            inputs, error = attempt(self._pre_all_gather)
            if self.pieces is None:  # the first gather: the subclasses' hooks ran alike on all ranks, or all raise
                self._make_layout(inputs, error)
            elif error is not None:
                raise error
        else:  # no extension, layout made: no all-gather inputs to make (no call)
            inputs = collectives.NO_INPUTS
        if not self.gathered:
            self._gather, self.sharded_state = (collectives.NO_GATHER, False), UNSHARDING
            return
        custom = self.custom_all_gather
        fast = custom is None and settings.fast_paths
        if self._placed is not None and fast:  # each rank's shards land in the unsharded parameters
            PLACED_GATHER.hits += 1
            self._ensure_unsharded_storage()
            self._gather, self.sharded_state = (self._placed.post(self.unsharded_flat), True), UNSHARDING
            return
        posted = self._posted if fast else None
        if self._in_place and custom is None:  # the unsharded parameter is the ranks' shards back to back
            self._ensure_unsharded_storage()
            if posted is not None:
                POSTED_GATHER.hits += 1
                self._gather, self.sharded_state = (posted.post(out=self.unsharded_flat), True), UNSHARDING
                return
            comm = self.info.shard_comm
            nbytes = self.gathered[0].local_numel * self.gathered[0].orig_dtype.itemsize
            handle = collectives.start_all_gather(None, self.shard_flat[:nbytes], comm,
                                                  self.unsharded_flat[:nbytes * comm.size])
            self._gather, self.sharded_state = (handle, True), UNSHARDING
            return
        if self.direct:  # shard_flat itself unless offloaded
            send = self.shard_flat if self.offload_to is None else self.shard_flat.to(self.device, non_blocking=True)
        else:
            for i, p in self._extensions:
                self._check_inputs(i, p, inputs[i])
            send = torch.zeros(self.gather_nbytes, dtype=torch.uint8, device=self.device)
            with torch.no_grad():
                packing.pack_send(send, self.gathered, self.pieces, inputs)
        if posted is not None:
            POSTED_GATHER.hits += 1
            self._gather = (posted.post(None if send is posted.send else send), False)
            self.sharded_state = UNSHARDING
            return
        self._start_gather(send, self.info.shard_comm)

    def _start_gather(self, send: torch.Tensor, comm: MPI.Comm) -> None:
        """Start gathering ``send`` over ``comm`` into a buffer of every shard rank's rows."""
        nbytes = self.gather_nbytes * self.info.shard_size
        out = collectives.allocate(self.custom_all_gather, (nbytes,), torch.uint8, self.device, reusable=True)
        handle = collectives.start_all_gather(self.custom_all_gather, send, comm, out)
        self._gather, self.sharded_state = (handle, False), UNSHARDING

    def _prepare_gather(self) -> None:
        """Once the layout is made, and again whenever ``shard_flat`` is replaced: whether
        the all-gather can write straight into ``unsharded_flat`` (``_in_place``: one plain
        parameter in its own dtype, split evenly along dim 0, its ranks' shards back to back,
        on the host; with torch's default collective), and the all-gather over the shard ranks
        prepared where it gathers host buffers over 2+ ranks: placed straight into
        ``unsharded_flat`` from ``shard_flat`` (``_placed``, ``PLACED_GATHER``) where the group
        is plain dim-0 shards in their own dtype (``packing.placed_pieces``) and that pays
        (``comm.placed.pays``), else posted into
        rows (``_posted``, ``POSTED_GATHER``): ``shard_flat`` its fixed send buffer unless a
        cast, an extension or offloading packs or moves one each time."""
        on_host = self.shard_flat.device.type == "cpu" and self.device.type == "cpu"
        self._in_place = self._rank_major and self.direct and self.offload_to is None and on_host
        comm, self._posted, self._placed = self.info.shard_comm, None, None
        if self.pieces is None or not on_host or comm.size == 1 or not self.gather_nbytes:
            return
        fixed = self.direct and self.offload_to is None
        placed = packing.placed_pieces(self.gathered, comm.size) if fixed and not self._in_place else None
        if placed is not None and placed_pays(placed[1]):
            self._placed = PlacedAllGather(comm, self.shard_flat, *placed)
            return
        only = self.gathered[0]
        nbytes = only.local_numel * only.orig_dtype.itemsize if self._in_place else self.gather_nbytes
        if nbytes:
            self._posted = PostedAllGather(comm, nbytes, self.shard_flat if fixed else None)

    def _ensure_unsharded_storage(self) -> None:
        """Allocate ``unsharded_flat`` (first gather) or give back its freed storage."""
        flat = self.unsharded_flat
        if flat is None:
            self.unsharded_flat = tracked_empty(self.unsharded_nbytes, torch.uint8, self.device)
            return
        held, storage = self._storage
        if held is not flat:
            storage = self._storage_of(flat)
        if not storage.nbytes():
            storage.resize_(self.unsharded_nbytes)  # new memory: advise it again (no call below the size it needs)
            accounting.track_resize(advise_huge_pages(flat) if self.unsharded_nbytes >= HUGE_PAGES_MIN else flat,
                                    storage, self.unsharded_nbytes)

    def _free_unsharded_storage(self) -> None:
        flat = self.unsharded_flat
        if flat is not None:
            held, storage = self._storage
            if held is not flat:
                storage = self._storage_of(flat)
            if storage.nbytes():
                storage.resize_(0)
                accounting.track_resize(flat, storage, 0)

    def _storage_of(self, flat: torch.Tensor) -> torch.UntypedStorage:
        """``flat``'s storage object, asked for once per ``unsharded_flat`` (kept in ``_storage``,
        which the callers read first: a resize keeps the object; each ``untyped_storage()``
        call makes a new one, and accounting keys storages by object id, which stays valid
        since the object lives as long as ``flat``)."""
        storage = flat.untyped_storage()
        self._storage = (flat, storage)
        return storage

    # --- all-gather extensions (fsdp_pre_all_gather / fsdp_post_all_gather) ---------------------------
    def _pre_all_gather(self) -> dict[int, tuple[torch.Tensor, ...]]:
        """The extension parameters' all-gather inputs (their metadata kept for the post hook)."""
        inputs = {}
        if not self._extensions:
            return inputs
        with whole_weight_scales([p.sharded._local_tensor for _, p in self._extensions], self.info.shard_comm):
            for i, p in self._extensions:
                inputs[i], self._meta[i] = p.pre_all_gather(self.info.mesh, self.mp)
        return inputs

    def _make_layout(self, inputs: dict[int, tuple[torch.Tensor, ...]] | None, error: Exception | None) -> None:
        """The all-gather input's layout (``packing.gather_pieces``). Extension inputs are laid
        out from every rank's input shapes (``_input_rows``: one small collective, first
        all-gather only), which also carries ``error``, a rank's failure to make its inputs."""
        rows = self._input_rows(inputs, error) if self._extensions else {}
        self._input_kinds = {i: [(t.dtype, tuple(t.shape)) for t in inputs[i]] for i, _ in self._extensions}
        self.pieces, self.gather_nbytes = packing.gather_pieces(self.gathered, inputs, rows)
        self.split_sizes = packing.split_sizes(self.gathered, self.pieces, self.info.shard_size)
        self._prepare_gather()

    def _input_rows(self, inputs: dict[int, tuple[torch.Tensor, ...]] | None,
                    error: Exception | None) -> dict[int, list[tuple[int, int]]]:
        """Per extension parameter and all-gather input, (gathered rows on dim 0, rows per
        rank in the send buffer), from every shard rank's input shapes (one ``allgather``),
        so that all ranks lay out, or refuse (``FSDPParam.input_rows``, a rank's ``error``), alike."""
        mine = None if error is not None else {i: [tuple(t.shape) for t in inputs[i]] for i, _ in self._extensions}
        every = exchange(self.info.shard_comm, mine, error)
        return {i: p.input_rows([shapes[i] for shapes in every]) for i, p in self._extensions}

    def _check_inputs(self, i: int, p: FSDPParam, inputs: tuple[torch.Tensor, ...]) -> None:
        """Each all-gather keeps the count, dtypes and shapes of the first."""
        kinds = [(t.dtype, tuple(t.shape)) for t in inputs]
        first = self._input_kinds[i]
        if kinds != first:
            raise ValueError(f"fsdp_pre_all_gather of {p.users[0][1]!r} returned inputs {kinds}, "
                             f"unlike the first all-gather's {first}")

    def _post_all_gather(self, i: int, p: FSDPParam, rows_of_ranks: torch.Tensor) -> None:
        """Copy an extension parameter's gathered pieces (padding dropped) into its
        persistent outputs and let the subclass build (or refresh) its unsharded tensor."""
        pieces = self.pieces[i]
        outputs = p.gather_outputs([(piece.dtype, (piece.rows, *piece.rest), self.device) for piece in pieces])
        packing.unpack_pieces(outputs, pieces, rows_of_ranks)
        self._kept_meta[i] = self._meta.pop(i)
        p.post_all_gather(self._kept_meta[i])

    # --- UNSHARDING -> UNSHARDED ------------------------------------------------------------------
    def finish_unshard(self) -> None:
        """Wait for the all-gather (starting it first if need be) and put the unsharded
        parameters on the modules."""
        if self.sharded_state is UNSHARDED:
            return
        if self.sharded_state is not UNSHARDING:
            self.start_unshard()
        handle, placed = self._gather
        out = handle.wait()
        self._gather = None
        self._ensure_unsharded_storage()
        try:  # every parameter unsharded before (the common case: C-level maps, no call per parameter)
            existing = list(map(_unsharded_of, self.params))
            versions, wrapped = list(map(_version_of, existing)), True
        except AttributeError:  # some not yet (None has no _version)
            existing = [p.unsharded for p in self.params if p.unsharded is not None]
            versions, wrapped = [t._version for t in existing], False
        # the copies between plain tensors that need no gradient record nothing in grad mode; grad
        # mode is turned off only for what may (the first wrap, replicated blocks, extensions' hooks)
        enabled = (not wrapped or bool(self._replicated or self._extensions)) and _grad_enabled()
        if enabled:
            _set_grad_enabled(False)  # ``torch.no_grad()`` without its ~14 Python calls (here and in _start_reduce)
        try:
            if not placed and out is not None:  # (placed: the all-gather wrote the parameters in place)
                # (a posted all-gather's output is its (ranks, bytes) rows already)
                rows_of_ranks = out if out.ndim == 2 else out.view(self.info.shard_size, self.gather_nbytes)
                if self.split_sizes is not None:  # every parameter in one copy
                    flat, views = self._split_views
                    if flat is not self.unsharded_flat:
                        views = self._split_outputs()
                    torch.split_with_sizes_copy(rows_of_ranks, self.split_sizes, dim=1, out=views)
                else:
                    self._copy_from_ranks(rows_of_ranks)
                for i, p in self._extensions:
                    self._post_all_gather(i, p, rows_of_ranks)
            if placed or out is not None:
                for p in self._plain:
                    if p.unsharded is None:
                        p.unsharded = p.wrap_unsharded(packing.unsharded_view(self.unsharded_flat, p).view(p.shape))
            for p in self._replicated:
                self._unshard_replica(p)
        finally:
            if enabled:
                _set_grad_enabled(True)
        torch._C._autograd._unsafe_set_version_counter(existing, versions)
        self.sharded_state = UNSHARDED
        self._install(unsharded=True)

    def _split_outputs(self) -> list[torch.Tensor]:
        """``packing.split_views`` of ``unsharded_flat``, made once per buffer (a view
        follows its storage through the resizes)."""
        flat, views = self._split_views
        if flat is not self.unsharded_flat:
            views = packing.split_views(self.unsharded_flat, self.gathered, self.split_sizes, self.info.shard_size)
            self._split_views = (self.unsharded_flat, views)
        return views

    def _copy_from_ranks(self, rows_of_ranks: torch.Tensor) -> None:
        """``packing.FromRanks``'s copy, its views made once per ``unsharded_flat``."""
        if self._from_ranks is None or self._from_ranks.unsharded_flat is not self.unsharded_flat:
            self._from_ranks = FromRanks(self.unsharded_flat, self.gathered, self.pieces, self.gather_nbytes)
        self._from_ranks.copy(rows_of_ranks)

    def _install(self, unsharded: bool) -> None:
        """Put every parameter's unsharded (else sharded) form on its user modules."""
        for module, name, p in self._users:
            module._parameters[name] = p.unsharded if unsharded else p.sharded

    def _unshard_replica(self, p: FSDPParam) -> None:
        """A replicated parameter's unsharded form: its local block itself (a copy in
        ``param_dtype``, or on the compute device when offloaded), rebuilt only when the
        local block was replaced."""
        local = p.sharded._local_tensor
        if p.unsharded is None or p.replica_src is not local:
            p.replica_src = local
            p.unsharded = p.wrap_unsharded(local.to(device=self.device, dtype=p.param_dtype))
        elif local.dtype != p.param_dtype or local.device != self.device:  # a copy: refresh it
            p.unsharded._local_tensor.copy_(local)  # (replicated parameters are TP DTensors)

    # --- UNSHARDED -> SHARDED_POST_FORWARD, any -> SHARDED ------------------------------------------
    def reshard_post_forward(self) -> None:
        """Reshard after forward: fully, or (``reshard_after_forward=k``) keeping this rank's
        ``world / k`` rows of the all-gather so that backward gathers over the k ranks of
        its subgroup only; the kept rows are rebuilt from the unsharded parameters."""
        if self.post_forward_comm is None or self.sharded_state is not UNSHARDED or not self.gathered:
            self.reshard()
            return
        k, world = self.post_forward_comm.size, self.info.shard_size
        kept = tracked_empty((world // k, self.gather_nbytes), torch.uint8, self.device)
        with torch.no_grad():
            packing.keep_rows(kept, self.gathered, self.pieces, self.unsharded_flat,
                              self.post_forward_comm.rank * (world // k))
        self.reshard()
        self._kept, self.sharded_state = kept.view(-1), SHARDED_POST_FORWARD

    def reshard(self) -> None:
        """Put the sharded parameters back and free the unsharded storage: from
        ``UNSHARDED``; from ``UNSHARDING`` (a prefetch nobody used) once its all-gather is
        done; from ``SHARDED_POST_FORWARD`` by dropping the kept rows."""
        state = self.sharded_state
        if state is SHARDED:
            return
        if state is SHARDED_POST_FORWARD:
            self._kept = None
        elif state is UNSHARDING:
            self._gather[0].wait()
            self._gather = None
            self._meta.clear()
            self._free_unsharded_storage()
        else:
            self._install(unsharded=False)
            for _, p in self._extensions:
                p.free_gathered()
            self._free_unsharded_storage()
        self.sharded_state = SHARDED

    def reset(self) -> None:
        """Back to the state between iterations, after an exception: finish and drop any
        collective in flight, drop held gradients (no_sync and HSDP partial sums), reshard."""
        if self._pending is not None:
            for handle in (self._pending[0], self._pending[2]):
                if handle is not None:
                    handle.wait()
            self._pending = None
        self._partial = None
        for p in self.params:
            p.grad_acc = None
            if p.unsharded is not None:
                p.unsharded.grad = None
        self.reshard()
