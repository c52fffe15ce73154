"""``mesh.exchange.exchange_rows``: the all-to-all of a token dispatch, counts per rank."""
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, raises_everywhere
from mpidtensor.comm.exchange import exchange_rows

WORLD = MPI.COMM_WORLD


def _rows(src: int, dst: int) -> int:
    """Rows rank ``src`` sends rank ``dst``: uneven, zero for some pairs."""
    return (src + 2 * dst) % 3


def test_rows_arrive_in_rank_order():
    n, me = WORLD.size, WORLD.rank
    send = [_rows(me, k) for k in range(n)]
    recv = [_rows(k, me) for k in range(n)]
    # row j sent to rank k: (sender, receiver, j) in a row of 3 values, as bfloat16 (bytes only)
    x = torch.tensor([[me, k, j] for k in range(n) for j in range(send[k])], dtype=torch.bfloat16).reshape(-1, 3)
    out = exchange_rows(x, WORLD, send_rows=send, recv_rows=recv)
    want = torch.tensor([[k, me, j] for k in range(n) for j in range(recv[k])], dtype=torch.bfloat16).reshape(-1, 3)
    assert_all_ranks(out.dtype == torch.bfloat16 and torch.equal(out, want), f"got {out.tolist()}, want {want.tolist()}")


def test_bad_counts_raise_everywhere():
    n = WORLD.size
    x = torch.zeros(3, 2)
    raises_everywhere(ValueError, lambda: exchange_rows(x, WORLD, send_rows=[3] + [0] * n, recv_rows=[0] * n),
                      match="counts")
    raises_everywhere(ValueError, lambda: exchange_rows(x, WORLD, send_rows=[0] * (n - 1) + [5], recv_rows=[0] * n),
                      match="add up")
