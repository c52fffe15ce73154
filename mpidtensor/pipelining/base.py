"""What every schedule shares: arguments, the agreed checks, ``step`` and ``eval``.

A schedule family (``single``, ``interleaved``, ``vshape``) only says, for each rank, the
order of its actions (``_order``) and its own rules on the micro-batch count
(``_rules``); :class:`.runtime.Runtime` executes the order. Construction is collective over
the pipeline group: the ranks check their arguments together (one ``allgather``) and every
rank raises the same error for a bad one. Each ``step`` ends with one more small
``allgather``, the step's agreement: a failure anywhere (a stage's code, a bad batch, an
output whose shape changed) is raised on every rank, after the failing rank has notified
the others so that none waits for a message that will not come.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm.p2p import Channel, PeerFailed
from ..runtime.agreement import attempt, on_rank0, raise_agreed, raise_found, raise_listed, require_same
from ..runtime import watchdog
from . import meta, schedule_file
from .actions import Action, rank_to_stages, stage_to_rank
from .microbatch import split_args_kwargs, merge_chunks, split_tensor
from .runtime import Runtime


class _PipelineSchedule:
    """Base of every schedule: holds this rank's stages and runs a step on them."""

    style = "loop"  # how stages are placed on ranks (actions.stage_to_rank)
    stages_per_rank: int | None = None  # a family that needs a fixed number says so
    _csv_formats: tuple[str, ...] = ("compute_only",)  # what _load_csv reads (torch's rule)

    def __init__(self, stages: list, n_microbatches: int, loss_fn: Callable[..., torch.Tensor] | None = None,
                 args_chunk_spec: tuple | None = None, kwargs_chunk_spec: dict | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True, **torch_options: Any) -> None:
        # torch_options: torch's runtime knobs (backward_requires_autograd, defer_pp_recv,
        # use_full_backward) have no meaning here; accepted so torch code runs unchanged.
        self._stages = list(stages)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None
        self._args_chunk_spec, self._kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        first = self._stages[0]
        self._comm = first.comm
        self.rank, self.pp_group_size = self._comm.rank, self._comm.size
        self._num_stages = first.num_stages
        self._check()
        self._ctl = watchdog.call("the pipeline schedule's control communicator (Dup)", self._comm, self._comm.Dup)
        self._channel = Channel(self._comm)
        self._ready = False
        self.pipeline_order: dict[int, list[Action]] = {}
        self.stage_index_to_group_rank: dict[int, int] = {}
        self._runtime: Runtime | None = None
        if not self._order_from_file:
            self._use_order({r: self._order(r) for r in range(self.pp_group_size)},
                            stage_to_rank(self.pp_group_size, self._num_stages, self.style))

    def _use_order(self, orders: dict[int, list[Action]], placement: dict[int, int]) -> None:
        """Run ``orders`` (every rank's actions) with stages on the ranks ``placement`` says."""
        self.pipeline_order, self.stage_index_to_group_rank = orders, placement
        for st in self._stages:
            st.stage_index_to_group_rank = placement
        self._runtime = Runtime({st.stage_index: st for st in self._stages}, orders[self.rank], placement, self.rank)
        self._ready = False  # the first step finds the crossing shapes along this placement

    # -- schedules in torch's CSV files (schedule_file) -----------------------------------------
    @property
    def _order_from_file(self) -> bool:
        """Whether this class has no order of its own (torch's ``PipelineScheduleMulti`` and
        ``_PipelineScheduleRuntime``): it runs what :meth:`_load_csv` gives."""
        return type(self)._order is _PipelineSchedule._order

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:  # noqa: A002  (torch's keyword)
        """Run the order of torch's CSV schedule ``filename`` (one row per pipeline rank) from
        now on, placing stages as the file does; collective over the pipeline group. Rank 0
        reads the file; a file that cannot be read, or an order that is not a whole schedule
        for the stages the ranks hold, raises ``ValueError`` on every rank."""
        if format not in self._csv_formats:
            raise ValueError(f"{type(self).__name__} loads {' or '.join(self._csv_formats)} schedules, "
                             f"got format={format!r} (_PipelineScheduleRuntime also reads compute_comms files)")
        orders = on_rank0(self._comm, schedule_file.read, filename, format, self.pp_group_size)
        held = watchdog.call("the stages each pipeline rank holds (allgather)", self._comm, self._comm.allgather,
                      sorted(st.stage_index for st in self._stages))
        placement, problems = schedule_file.check(orders, held, self._num_stages, self._n_microbatches)
        raise_listed([f"{filename}: {p}" for p in problems])
        self._use_order(orders, placement)

    def _dump_csv(self, filename: str, format: str = "compute_only") -> None:  # noqa: A002  (torch's keyword)
        """Write this schedule's order as torch's compute-only CSV (rank 0 writes).
        ``compute_comms`` is refused: the runtime places messages itself, not in the order."""
        if format != "compute_only":
            raise ValueError("only compute_only schedules are written: mpidtensor's runtime posts the messages "
                             "itself (receives ahead of use, sends at once), so there is no communication order")
        on_rank0(self._comm, schedule_file.write, filename, self.pipeline_order)

    # -- what a family provides ------------------------------------------------------------
    def _order(self, rank: int) -> list[Action]:
        """This rank's actions; a family defines it (without one, :meth:`_load_csv` gives them)."""
        raise NotImplementedError

    def _rules(self) -> list[str]:
        """Problems with the micro-batch count for this schedule (torch's rules)."""
        return []

    # -- construction checks (collective) --------------------------------------------------
    def _check(self) -> None:
        name, n, P = type(self).__name__, self._n_microbatches, self.pp_group_size
        problems = []
        if n < 1:
            problems.append(f"{name} needs n_microbatches >= 1, got {n}")
        if any(st.num_stages != self._num_stages or st.comm.size != P for st in self._stages):
            problems.append(f"the stages of rank {self.rank} disagree on num_stages or the pipeline group")
        local = len(self._stages)
        if self.stages_per_rank is not None and local != self.stages_per_rank:
            problems.append(f"{name} needs {self.stages_per_rank} stages per rank, rank {self.rank} has {local}")
        elif self._num_stages != P * local:
            problems.append(f"num_stages is {self._num_stages} but the pipeline group has {P} ranks x "
                            f"{local} stage(s) per rank = {P * local}")
        elif not self._order_from_file:  # a file places its stages itself (checked as it loads)
            want = rank_to_stages(P, self._num_stages, self.style)[self.rank]
            have = sorted(st.stage_index for st in self._stages)
            if have != want:
                problems.append(f"{name} places stages {want} on rank {self.rank}, which has {have}")
        if n >= 1 and not problems:
            problems += self._rules()
        raise_found(self._comm, problems)

        def loss_message(seen: list) -> str:
            if len({s[:3] for s in seen}) > 1:
                return "ranks disagree on the schedule: " + "; ".join(
                    f"rank {r}: {s[0]}(n_microbatches={s[1]}, num_stages={s[2]})" for r, s in enumerate(seen))
            given = [r for r, s in enumerate(seen) if s[3]]
            lacking = [r for r, s in enumerate(seen) if not s[3]]
            return (f"loss_fn is given on ranks {given} but not on ranks {lacking}: give it on every pipeline "
                    "rank (it runs on the last stage only; the backward involves every stage)")

        require_same(self._comm, (name, n, self._num_stages, self._has_backward), loss_message)

    # -- a step ---------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, **kwargs: Any) -> Any:
        """One training step (forward only after :meth:`eval`-style use) over the whole batch:
        split into ``n_microbatches``, run by the schedule, gradients accumulated (and divided
        by ``n_microbatches`` when ``scale_grads``). Returns the merged output on the rank of
        the last stage, else ``None``; ``losses`` gets each micro-batch's loss there.
        Collective over the pipeline group."""
        if self._runtime is None:  # alike on every rank: loading is collective
            raise RuntimeError(f"{type(self).__name__} has no order of actions yet: load one with "
                               f"_load_csv(filename), on every pipeline rank")
        for st in self._stages:
            st.has_backward = self._has_backward
            st.clear_runtime_states()
        split, error = attempt(self._split, args, kwargs, target)
        arg_mbs, kwarg_mbs, target_mbs = split or (None, None, None)
        if error is None and self._has_backward and not torch.is_grad_enabled():
            error = RuntimeError("step() runs a backward and needs gradients enabled; use eval() under no_grad")
        if not self._ready:
            meta.infer(self._stages, self.stage_index_to_group_rank, self._ctl,
                       arg_mbs[0] if arg_mbs else None, kwarg_mbs[0] if kwarg_mbs else None, error)
            self._ready = True
        got = {}
        self._channel.open()
        if error is None:
            try:
                got = self._runtime.run(self._channel, arg_mbs, kwarg_mbs, target_mbs, self._loss_fn, loss_kwargs,
                                        self._has_backward, return_outputs)
            except PeerFailed:
                pass  # another rank's error is raised below
            except Exception as err:  # noqa: BLE001  (raised on every rank below)
                error = err
        if error is not None:
            self._channel.notify()
        self._agree(error)
        last = [st for st in self._stages if st.is_last]
        if last and losses is not None and len(got) == self._n_microbatches:
            losses.clear()
            losses.extend(got[m] for m in range(self._n_microbatches))
        if self._has_backward:
            for st in self._stages:
                st.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)
        if last and return_outputs and last[0].output_chunks:
            return merge_chunks(last[0].output_chunks, self._output_merge_spec)
        return None

    def eval(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """A step of forwards only, without gradients (the losses still computed where a
        ``loss_fn`` and ``target`` are given)."""
        has_backward, self._has_backward = self._has_backward, False
        try:
            with torch.no_grad():
                return self.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._has_backward = has_backward

    def _split(self, args: tuple, kwargs: dict, target: Any) -> tuple[list, list, list | None]:
        n = self._n_microbatches
        if args or kwargs:
            arg_mbs, kwarg_mbs = split_args_kwargs(args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec)
        else:
            arg_mbs, kwarg_mbs = [()] * n, [{}] * n
        target_mbs = split_tensor(target, 0, n, "target") if isinstance(target, torch.Tensor) else None
        if any(st.is_first for st in self._stages) and not args:
            raise ValueError("the rank of the first stage must pass the batch to step()")
        return arg_mbs, kwarg_mbs, target_mbs

    def _agree(self, error: BaseException | None) -> None:
        """The step's agreement: raise on every rank the error any rank met; after one, the
        channel (with whatever was left in flight) is replaced by a fresh one."""
        try:
            raise_agreed(self._ctl, error)
            self._channel.close()
        except BaseException:
            self._channel.abandon()
            self._channel = Channel(self._comm)
            for st in self._stages:
                st.clear_runtime_states()
            raise


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule of one stage per rank (torch's base of ``ScheduleGPipe``, ``Schedule1F1B``)."""

    stages_per_rank = 1

    def __init__(self, stage: Any, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple | None = None, kwargs_chunk_spec: dict | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True, **torch_options: Any) -> None:
        self._stage = stage
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **torch_options)


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule of a list of stages per rank (virtual stages)."""


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """torch's runtime for schedules given as files: stages placed anyhow (the file says
    where), its order from :meth:`_load_csv`, in torch's ``compute_only`` or
    ``compute_comms`` form (the latter's communication cells are passed over:
    :mod:`.schedule_file`)."""

    _csv_formats = schedule_file.FORMATS
