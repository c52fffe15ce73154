"""Train the Llama-style model of llama.py with tensor + sequence parallelism on all ranks.

    mpiexec -n 4 python examples/train_llama.py [--steps 10] [--batch 4] [--seq 48]

The model is sharded over a 1-D mesh of every rank with ``parallelize_llama`` and trained
with AdamW on synthetic tokens: each sequence follows a fixed random successor table
(token t is followed by ``table[t]``), so the loss falls as the model learns the table.
Every rank draws the same batches from one seed. Beside it, each rank trains the same
model unsharded from the same seed; per step, rank 0 prints the loss, the throughput
(tokens per second of the sharded step, slowest rank), the collectives of the step
(CommDebugMode) and the largest difference from the unsharded run in the loss and in
any parameter (``full_tensor()``). Exits 1 if a difference exceeds ``--tol``.
"""
import argparse
import copy
import sys
from collections import Counter
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import LlamaConfig, batches, build_model, cross_entropy, parallelize_llama  # noqa: E402

from mpidtensor import init_device_mesh  # noqa: E402
from mpidtensor.debug import CommDebugMode  # noqa: E402
from mpidtensor.parallel import loss_parallel  # noqa: E402

world = MPI.COMM_WORLD


def main() -> int:
    n = world.size
    kv = 4 if 4 % n == 0 else n  # both head counts must divide by the TP size
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=48, help="a multiple of the rank count")
    parser.add_argument("--dim", type=int, default=16 * kv)
    parser.add_argument("--kv-heads", type=int, default=kv)
    parser.add_argument("--heads", type=int, default=2 * kv)
    parser.add_argument("--hidden", type=int, default=192, help="SwiGLU width, a multiple of the rank count")
    parser.add_argument("--vocab", type=int, default=257)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tol", type=float, default=1e-4)
    args = parser.parse_args()
    if args.seq % n or args.hidden % n:
        parser.error(f"--seq and --hidden must be multiples of the rank count {n}")

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, hidden_dim=args.hidden, max_seq_len=args.seq)
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    ref = build_model(cfg, seed=0)
    model = parallelize_llama(copy.deepcopy(ref), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    if world.rank == 0:
        print(f"{n} ranks, TP + SP on {mesh}\n{cfg}, batch {args.batch} x seq {args.seq}", flush=True)

    worst = 0.0
    for step, tokens in zip(range(args.steps), batches(cfg, args.batch, args.seq, seed=1)):
        world.Barrier()
        start = MPI.Wtime()
        with CommDebugMode() as comm:
            logits = model(tokens[:, :-1])
            with loss_parallel():
                loss = cross_entropy(logits, tokens[:, 1:])
                loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach().full_tensor().item()
        elapsed = world.allreduce(MPI.Wtime() - start, op=MPI.MAX)

        ref_loss = cross_entropy(ref(tokens[:, :-1]), tokens[:, 1:])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        param_diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        diff = max(abs(loss - ref_loss.item()), param_diff)
        worst = max(worst, diff)
        if world.rank == 0:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(Counter(comm.get_comm_counts()).items()))
            print(f"step {step:3d}  loss {loss:.4f}  {args.batch * args.seq / elapsed:8.0f} tokens/s  "
                  f"[{counts}]  max diff from one process {diff:.1e}", flush=True)
    ok = worst <= args.tol
    if world.rank == 0:
        print(f"largest difference from one process: {worst:.1e} ({'ok' if ok else 'ABOVE'} --tol {args.tol})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
