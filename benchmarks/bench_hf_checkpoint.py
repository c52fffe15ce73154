"""Hugging Face safetensors save/load throughput: mpidtensor's HuggingFaceStorageWriter /
HuggingFaceStorageReader on N ranks against transformers' save_pretrained /
from_pretrained in one process.

    mpiexec -n N python benchmarks/bench_hf_checkpoint.py [--layers 8] [--hidden 768] [--reps 3] [--dir DIR]

The model: a LlamaForCausalLM of random weights in float32 (about 325 MB at the
defaults: hidden 768, SwiGLU 2048, 8 layers, vocabulary 16000, untied head), built
from the same seed on every rank. mpidtensor saves its state dict with every tensor
row-sharded over the ranks (``Shard(0)``, what FSDP holds) as consolidated files
(``save_distributed=True, enable_consolidation=True``: each rank writes its rows straight
into the final files) and loads them back into that layout; it also loads
save_pretrained's ``model.safetensors`` into it. transformers (run with ``-n 1``, or
with ``--transformers`` by rank 0 alone while the others wait) saves the whole model
and loads it with ``from_pretrained`` (which also builds the model; the load columns
say so). A time is the median over ``--reps`` of the slowest rank's time after one
untimed run; every save first removes the previous one (inside the timed region) and
fsyncs its files (save_pretrained's, by an explicit fsync after it). Loads read files that
were just written, from the page cache. MB/s = the state dict's bytes / time. The
load average (``uptime``) is printed before and after: the cores may be shared.
"""
import argparse
import os
import sys

import torch
import transformers
from mpi4py import MPI

import mpidtensor
from mpidtensor.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import remove, scratch_directory, timed  # noqa: E402
from text_table import print_table, time_and_rate  # noqa: E402

world = MPI.COMM_WORLD
n, rank = world.size, world.rank


def config(args):
    return transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                    num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=12,
                                    vocab_size=16000, tie_word_embeddings=False)


def model(args):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config(args)).eval()


def bench_mpidtensor(args, directory, full):
    mesh = mpidtensor.init_device_mesh("cpu", (n,))
    state = {k: mpidtensor.distribute_tensor(v.detach(), mesh, [mpidtensor.Shard(0)]) for k, v in full.items()}
    path = os.path.join(directory, "mpidtensor")

    def save():
        remove(path)
        HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=True).write(state, world)

    save_time = timed(save, args.reps)
    load_time = timed(lambda: HuggingFaceStorageReader(path).read(state, world), args.reps)
    pretrained = os.path.join(directory, "pretrained")
    if rank == 0:
        model(args).save_pretrained(pretrained)
    world.Barrier()
    from_pretrained_file = timed(lambda: HuggingFaceStorageReader(pretrained).read(state, world), args.reps)
    return save_time, load_time, from_pretrained_file


def bench_transformers(args, directory):
    path = os.path.join(directory, "transformers")
    solo = world.Split(0 if rank == 0 else MPI.UNDEFINED)
    if solo == MPI.COMM_NULL:
        return None
    m = model(args)

    def save():
        remove(path, solo)
        m.save_pretrained(path)
        for name in os.listdir(path):  # synced like mpidtensor's files
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    save_time = timed(save, args.reps, solo)
    load_time = timed(lambda: transformers.LlamaForCausalLM.from_pretrained(path), args.reps, solo)
    return save_time, load_time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--transformers", action="store_true", help="also time transformers at more than one rank")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    full = model(args).state_dict()
    nbytes = sum(t.nbytes for t in full.values())
    with scratch_directory("bench-hf-", args.dir) as directory:
        md = bench_mpidtensor(args, directory, full)
        tf = bench_transformers(args, directory) if n == 1 or args.transformers else None
    if rank == 0:
        print(f"\nLlama {args.layers} layers, hidden {args.hidden}: {nbytes / 1e6:.0f} MB float32 on {n} ranks, "
              f"median of {args.reps}, slowest rank; load average before {load_before[0]:.1f}, "
              f"after {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
        rows = [("mpidtensor Shard(0) -> model-*.safetensors (fsync)", md[0], md[1]),
                ("mpidtensor <- save_pretrained's model.safetensors", None, md[2])]
        if tf:
            rows.append(("transformers save_pretrained (+fsync) / from_pretrained", *tf))
        print_table(["", "save s", "MB/s", "load s", "MB/s"],
                    [[name, *time_and_rate(save, nbytes, 1e6, "{:.0f}"), *time_and_rate(load, nbytes, 1e6, "{:.0f}")]
                     for name, save, load in rows])


if __name__ == "__main__":
    main()
