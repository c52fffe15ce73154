"""``mpidtensor.backend.process_group``: torch.distributed's collectives carried by MPI, for
third-party code that calls them, checked against what each rank can compute alone; and
Hugging Face ``generate(synced_gpus=True)`` on an FSDP model whose ranks stop at
different lengths (without the synced loop the ones that stop early leave the others
blocked in FSDP's all-gathers)."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from mpi4py import MPI

from helpers import assert_all_ranks, raises_everywhere
from mpidtensor import init_device_mesh
from zoo_models import ZOO, fully_shard_zoo

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank


def test_collectives_match_what_each_rank_computes(mpi_group):
    ranks = torch.arange(N, dtype=torch.float32)
    bad = []

    def check(name, got, want):
        if not torch.equal(torch.as_tensor(got), torch.as_tensor(want)):
            bad.append(f"{name}: {got} != {want}")

    t = torch.full((3,), RANK + 1.0)
    dist.all_reduce(t)
    check("all_reduce sum", t, torch.full((3,), N * (N + 1) / 2))
    t = torch.tensor([RANK + 1.0], dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    check("all_reduce max bf16", t, torch.tensor([float(N)], dtype=torch.bfloat16))
    t = torch.tensor([RANK + 1.0])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check("all_reduce avg", t, torch.tensor([(N + 1) / 2]))
    t = torch.tensor([float(RANK)])
    dist.broadcast(t, src=N - 1)
    check("broadcast", t, torch.tensor([N - 1.0]))
    outs = [torch.zeros(2) for _ in range(N)]
    dist.all_gather(outs, torch.tensor([RANK, RANK + 0.5]))
    check("all_gather", torch.stack(outs), torch.stack([ranks, ranks + 0.5], 1))
    out = torch.zeros(2 * N)
    dist.all_gather_into_tensor(out, torch.tensor([RANK, RANK + 0.5]))
    check("all_gather_into_tensor", out, torch.stack([ranks, ranks + 0.5], 1).reshape(-1))
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * N))
    check("reduce_scatter_tensor", out, N * torch.arange(2.0 * RANK, 2.0 * RANK + 2))
    out = torch.zeros(1)
    dist.reduce_scatter(out, [torch.tensor([float(k)]) for k in range(N)])
    check("reduce_scatter", out, torch.tensor([float(N * RANK)]))
    out = torch.zeros(N)
    dist.all_to_all_single(out, torch.full((N,), float(RANK)))
    check("all_to_all_single", out, ranks)
    sizes = [k + 1 for k in range(N)]  # rank r sends k + 1 rows to rank k, gets r + 1 from each
    out = torch.zeros(N * (RANK + 1))
    dist.all_to_all_single(out, torch.full((sum(sizes),), float(RANK)), [RANK + 1] * N, sizes)
    check("all_to_all_single uneven", out, ranks.repeat_interleave(RANK + 1))
    dist.barrier()
    check("functional all_reduce", funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD), torch.full((2,), float(N)))
    if N > 1:
        group = dist.new_group([0, 1])
        if RANK < 2:
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            check("new_group all_reduce", t, torch.tensor([2.0]))
    assert_all_ranks(not bad, "; ".join(bad))



def test_all_to_all_splits_that_do_not_match_raise_everywhere(mpi_group):
    """The last rank expects one row more from rank 0 than rank 0 sends it: every rank
    raises (one rank alone in the Alltoallv would truncate or hang)."""
    recv = [1] * N
    if RANK == N - 1:
        recv[0] = 2
    out = torch.zeros(sum(recv))
    raises_everywhere(ValueError, lambda: dist.all_to_all_single(out, torch.zeros(N), recv, [1] * N),
                      match=f"rank {N - 1} expects")


# Arguments only the last rank gets wrong: (input, output, input splits, output splits) of
# all_to_all_single on that rank, the others passing even rows; how the error begins.
ONE_RANK_WRONG = {
    "splits for too many ranks": (lambda: (torch.zeros(N + 1), torch.zeros(N), [1] * (N + 1), None),
                                  "Split sizes doesn't match"),
    "rows that do not divide": (lambda: (torch.zeros(N + 1), torch.zeros(N), None, None),
                                "Tensor's dim 0 does not divide"),
}  # (an output of another dtype: torch's all_to_all_single refuses it on that rank alone, before any backend)


@pytest.mark.parametrize("case", sorted(ONE_RANK_WRONG))
def test_all_to_all_arguments_one_rank_gets_wrong_raise_everywhere(mpi_group, case):
    """Splits or rows that only the last rank gets wrong raise torch's RuntimeError
    on every rank, naming that rank (checked on one rank alone, the others would be left in
    the exchange); for the process group's call and the functional collective's."""
    if N == 1:
        pytest.skip("needs a rank that differs from the others")
    make, words = ONE_RANK_WRONG[case]
    args = make() if RANK == N - 1 else (torch.zeros(N), torch.zeros(N), None, None)
    t, out, send, recv = args
    raises_everywhere(RuntimeError, lambda: dist.all_to_all_single(out, t, recv, send),
                      match=f"all_to_all_single on rank {N - 1}: {words}")
    if case == "rows that do not divide":  # (torch's functional form asserts on one split list given, alone)
        # it makes the even splits itself, by floor division: the backend refuses those
        raises_everywhere(RuntimeError, lambda: funcol.all_to_all_single(t, recv, send, dist.group.WORLD),
                          match=f"all_to_all_single on rank {N - 1}: ")
    dist.barrier()  # nothing left in flight: the group still works
    out = torch.empty(N)
    dist.all_to_all_single(out, torch.full((N,), float(RANK)))
    assert_all_ranks(out.tolist() == [float(r) for r in range(N)], f"after the refusal: {out.tolist()}")


def test_generate_synced_over_fsdp_with_different_lengths(mpi_group):
    """Rank r generates ``2 + r`` tokens: with ``synced_gpus=True`` (the flag all-reduced
    through this backend) the ranks that finish keep joining the others' forwards; each
    rank's tokens are the unsharded model's."""
    zoo = ZOO["llama"]
    ref = zoo.build().eval()
    model = copy.deepcopy(ref)
    fully_shard_zoo(model, zoo, init_device_mesh("cpu", (N,)))
    prompt = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(RANK))
    kwargs = dict(max_new_tokens=2 + RANK, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(prompt, synced_gpus=True, **kwargs)
        want = ref.generate(prompt, **kwargs)
    assert_all_ranks(torch.equal(got, want), f"generated {got.tolist()}, one process {want.tolist()}")


def test_a_receive_waited_with_a_timeout_raises_torch_runtime_error_and_stays_pending(mpi_group):
    """``irecv(...).wait(timeout=...)`` whose sender has not sent: torch's ``RuntimeError``
    (``Work.wait``'s) once the timeout passes, the receive still pending; a later ``wait()``
    completes it with the sent values."""
    from datetime import timedelta

    if N < 2:
        pytest.skip("a sender and a receiver: 2 ranks or more")
    problems = []
    t = torch.zeros(3)
    if RANK == 0:
        work = dist.irecv(t, src=1)
        try:
            work.wait(timeout=timedelta(seconds=0.3))
            problems.append("wait(timeout=0.3 s) returned with no message sent")
        except Exception as err:  # noqa: BLE001  (judged below; rank 1 must be released all the same)
            if not isinstance(err, RuntimeError) or "Timed out waiting 300ms" not in str(err):
                problems.append(f"{type(err).__name__}: {err}")
        WORLD.send(None, dest=1, tag=77)  # now rank 1 may send
        work.wait()
        if not torch.equal(t, torch.arange(3.0)):
            problems.append(f"received {t}")
    elif RANK == 1:
        WORLD.recv(source=0, tag=77)
        dist.send(torch.arange(3.0), dst=0)
    assert_all_ranks(not problems, str(problems))
