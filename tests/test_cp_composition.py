"""Context parallelism composes with FSDP and TP: the Llama-style model of
examples/llama.py on a 3-D ("dp", "cp", "tp") mesh (FSDP over dp and cp together, ring
attention over cp, TP + SP over tp; examples/train_context_parallel.py builds it) trains
like one process: losses, gradients and parameters over 2 AdamW steps, in float64, with
the key/value blocks passed around the ring ("alltoall") or all-gathered ("allgather")."""
import copy
import sys
from pathlib import Path

import pytest
import torch

from helpers import WORLD, assert_all_ranks, assert_close, raises_everywhere
from mpidtensor.experimental import set_rotate_method
from mpidtensor.experimental._context_parallel.api import _cp_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import LlamaConfig, batches, build_model, cross_entropy  # noqa: E402
from train_context_parallel import (Layout, check_sizes, forward_backward, make_meshes, parse_args,  # noqa: E402
                                    run, shard_model, split_batch)

STEPS = 2
SEQ = 24  # divides by 2 * cp * tp for every layout below
BATCH = 2
# float64 throughout: the sharded sums (ring attention's log-sum-exp merges, FSDP's
# gradient averages, TP's partial sums) differ from one process by rounding only
TOL = dict(atol=1e-10, rtol=1e-9)

# (dp, cp, tp, rotate method): both methods at every world size with a cp dim
LAYOUTS = [(1, 1, 1, "allgather"), (1, 2, 1, "allgather"), (1, 2, 1, "alltoall"), (2, 1, 1, "allgather"),
           (1, 3, 1, "allgather"), (1, 3, 1, "alltoall"), (1, 2, 2, "alltoall"), (2, 2, 1, "allgather"),
           (1, 4, 1, "alltoall"), (2, 1, 2, "allgather")]


# heads and KV heads (grouped: 2 query heads per KV head) divide by tp; the vocabulary
# (53) is uneven over the TP ranks; the rotary table has one row per position, so that
# context_parallel shards it with the tokens
CONFIG = LlamaConfig(vocab_size=53, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=SEQ)


def _compare_grads(model, ref) -> dict:
    """Parameter name -> largest gradient difference, for those outside TOL."""
    differ = {}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.full_tensor()
        if not torch.allclose(grad, p_ref.grad, **TOL):
            differ[name] = (grad - p_ref.grad).abs().max().item()
    return differ


@pytest.fixture
def rotate_method():
    """``set_rotate_method`` for one test; the process-wide setting restored after."""
    before = _cp_options.rotate_method
    yield set_rotate_method
    set_rotate_method(before)


@pytest.mark.every_case  # at each world size only its own layouts run; the rest skip
@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: "dp{}-cp{}-tp{}-{}".format(*c))
def test_llama_3d_matches_single_process(case, rotate_method):
    layout = Layout(*case[:3])
    if layout.dp * layout.cp * layout.tp != WORLD.size:
        pytest.skip(f"layout {case[:3]} needs {layout.dp * layout.cp * layout.tp} ranks")
    rotate_method(case[3])
    check_sizes(layout, CONFIG, BATCH, SEQ)
    meshes = make_meshes(layout)
    ref = build_model(CONFIG, seed=7).double()
    model = shard_model(copy.deepcopy(ref), meshes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for _, tokens in zip(range(STEPS), batches(CONFIG, BATCH, SEQ, seed=3)):
        inputs, labels = split_batch(tokens, meshes)
        losses.append(forward_backward(model, inputs, labels, meshes))
        # the inputs stay sharded (no_restore_buffers), the rotary table is restored
        assert_all_ranks(inputs.shape == (BATCH // layout.dp, SEQ // layout.cp), f"inputs {inputs.shape}")
        assert_all_ranks(model.rope.shape[0] == SEQ, f"rope {model.rope.shape}")
        loss = cross_entropy(ref(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        ref_losses.append(loss.item())
        differ = _compare_grads(model, ref)
        assert_all_ranks(not differ, f"gradients differ from one process (max abs diff): {differ}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    differ = {name: (p.full_tensor() - p_ref).abs().max().item()
              for (name, p), p_ref in zip(model.named_parameters(), ref.parameters())
              if not torch.allclose(p.full_tensor(), p_ref, **TOL)}
    assert_all_ranks(not differ, f"parameters differ from one process (max abs diff): {differ}")


def test_example_trains_like_one_process():
    """The example's default layout for this world size, with its own check (float32)."""
    args = parse_args(["--seq", "24", "--steps", "2", "--dim", "32", "--hidden", "64", "--vocab", "64",
                       "--layers", "1", "--check", "--skip-cp1"])
    diff = run(args, say=lambda *a: None)
    assert_all_ranks(diff <= args.tol, f"largest difference from one process {diff}")


def test_bad_layout_raises_everywhere():
    raises_everywhere(ValueError, lambda: make_meshes(Layout(WORLD.size, 2, 1)), match="must equal")
    raises_everywhere(ValueError, lambda: check_sizes(Layout(1, 2, 1), CONFIG, BATCH, 18),
                      match="2 * cp * tp")
