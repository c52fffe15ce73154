"""Model + optimizer state saved mid-training and resumed (same or other layout): the
training goes on with the losses of an uninterrupted run. The get_/set_ helpers."""

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close
import mpidtensor.checkpoint as dcp
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.checkpoint import StateDictOptions
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD = MPI.COMM_WORLD
R = Replicate()


class MLP(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _distribute_params(model: nn.Module, mesh, layout: dict) -> nn.Module:
    for name, module in model.named_children():
        for pname, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p.detach(), mesh, layout[f"{name}.{pname}"])
            setattr(module, pname, nn.Parameter(dt))
    return model


def make_model(kind: str, seed: int, mesh1d, mesh2d) -> nn.Module:
    model = MLP(seed)
    if kind == "tp":
        return parallelize_module(model, mesh1d, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if kind == "2d":
        return _distribute_params(model, mesh2d, {
            "fc1.weight": [Shard(0), Shard(1)], "fc1.bias": [R, Shard(0)],
            "fc2.weight": [Shard(1), R], "fc2.bias": [Shard(0), Shard(0)]})
    if kind == "fsdp":
        from mpidtensor.fsdp import fully_shard

        fully_shard(model.fc1, mesh=mesh1d)
        fully_shard(model.fc2, mesh=mesh1d)
        return fully_shard(model, mesh=mesh1d)
    if kind.startswith("fsdp_tp"):  # FSDP x TP; "fsdp_tp_dim1": fc1's weight on dim 1, the layout before round 15
        from mpidtensor.fsdp import fully_shard

        parallelize_module(model, mesh2d["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        dim1 = (lambda p: Shard(1) if p.ndim == 2 and p.placements == (Shard(0),) else None) if kind.endswith("dim1") \
            else None
        return fully_shard(model, mesh=mesh2d["dp"], shard_placement_fn=dim1)
    return model  # "plain": every rank holds the whole model


def batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)


def train(model, optim, steps) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        x, y = batch(step)
        out = model(x)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        loss = F.mse_loss(out, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def make_optim(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def checkpoint_state(model, optim) -> dict:
    return {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, optim),
            "step": 0}


@pytest.fixture
def mesh2d_or_none():
    if WORLD.size != 4:
        return None
    from mpidtensor import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


RESUMES = [("tp", "tp"), ("tp", "plain"), ("plain", "tp"), ("2d", "2d"), ("2d", "tp"), ("fsdp", "fsdp"),
           ("fsdp", "tp"), ("fsdp_tp", "fsdp_tp"), ("fsdp_tp_dim1", "fsdp_tp"), ("fsdp_tp", "tp")]


@pytest.mark.parametrize("saved,resumed", RESUMES)
def test_resume_continues_with_same_losses(mesh1d, mesh2d_or_none, ckpt_dir, saved, resumed):
    if any(k in ("2d", "fsdp_tp", "fsdp_tp_dim1") for k in (saved, resumed)) and mesh2d_or_none is None:
        pytest.skip("2-D mesh tests run with 4 ranks")
    if "fsdp" in (saved, resumed):
        pytest.importorskip("mpidtensor.fsdp")
    uninterrupted = make_model(saved, 0, mesh1d, mesh2d_or_none)
    expected = train(uninterrupted, make_optim(uninterrupted), range(6))

    model = make_model(saved, 0, mesh1d, mesh2d_or_none)
    optim = make_optim(model)
    first = train(model, optim, range(3))
    state = checkpoint_state(model, optim)
    state["step"] = 3
    dcp.save(state, ckpt_dir)

    fresh = make_model(resumed, 1, mesh1d, mesh2d_or_none)  # other initial values
    fresh_opt = make_optim(fresh)
    target = checkpoint_state(fresh, fresh_opt)
    dcp.load(target, ckpt_dir)
    dcp.set_model_state_dict(fresh, target["model"])
    dcp.set_optimizer_state_dict(fresh, fresh_opt, target["optim"])
    assert_all_ranks(target["step"] == 3)
    rest = train(fresh, fresh_opt, range(3, 6))
    same_layout = saved == resumed  # then bit for bit; else up to the order of float sums
    assert_close(torch.stack(first + rest), torch.stack(expected),
                 **(dict(atol=0, rtol=0) if same_layout else dict(atol=1e-5, rtol=1e-5)))


def test_full_state_dict_broadcast_from_rank0(mesh1d):
    """A full CPU state dict (rank 0 only) goes back into a sharded model and optimizer."""
    model = make_model("tp", 0, mesh1d, None)
    optim = make_optim(model)
    train(model, optim, range(2))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = dcp.get_model_state_dict(model, options=full)
    osd = dcp.get_optimizer_state_dict(model, optim, options=full)
    assert_all_ranks((len(msd) == 4) == (WORLD.rank == 0) and bool(osd) == (WORLD.rank == 0))
    assert_all_ranks(all(not isinstance(v, DTensor) for v in msd.values()))

    fresh = make_model("tp", 1, mesh1d, None)
    fresh_opt = make_optim(fresh)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(ValueError, match="needs a full state dict"):
        dcp.set_model_state_dict(fresh, dcp.get_model_state_dict(model), options=load)
    dcp.set_model_state_dict(fresh, msd, options=load)
    dcp.set_optimizer_state_dict(fresh, fresh_opt, osd, options=load)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert_close(q.full_tensor(), p.full_tensor(), atol=0, rtol=0)
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close(fresh_opt.state[q][k].full_tensor(), optim.state[p][k].full_tensor(), atol=0, rtol=0)
    assert_close(torch.stack(train(fresh, fresh_opt, range(2, 4))), torch.stack(train(model, optim, range(2, 4))),
                 atol=0, rtol=0)


def test_optimizer_state_dict_is_keyed_by_fqn(mesh1d):
    model = make_model("tp", 0, mesh1d, None)
    optim = make_optim(model)
    osd = dcp.get_optimizer_state_dict(model, optim)  # fresh: creates the state
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert_all_ranks(list(osd["state"]) == names and osd["param_groups"][0]["params"] == names)
    assert_all_ranks(isinstance(osd["state"]["fc1.weight"]["exp_avg"], DTensor))
    with pytest.raises(KeyError, match="missing keys"):
        dcp.set_model_state_dict(model, {"fc1.weight": torch.zeros(10, 6)})
    keys = dcp.set_model_state_dict(model, {"fc1.weight": torch.ones(10, 6)},
                                    options=StateDictOptions(strict=False))
    assert_all_ranks(keys.missing_keys == names[1:])
    assert_close(model.fc1.weight.full_tensor(), torch.ones(10, 6))


def test_optimizer_param_groups_match_in_any_order(mesh1d):
    """A param group's ``params`` are matched as a set, as torch's set_optimizer_state_dict
    does (FSDP1's ``rekey_optim_state_dict`` to names sorts them; Lightning's Trainer reloads
    its full checkpoints so): the state goes to the right parameters and training continues
    as from the original."""
    model = make_model("tp", 0, mesh1d, None)
    optim = make_optim(model)
    train(model, optim, range(2))
    osd = dcp.get_optimizer_state_dict(model, optim)
    reordered = {**osd, "param_groups": [{**g, "params": sorted(g["params"])} for g in osd["param_groups"]]}
    assert_all_ranks(reordered["param_groups"][0]["params"] != osd["param_groups"][0]["params"])
    fresh = make_model("tp", 1, mesh1d, None)
    fresh_opt = make_optim(fresh)
    dcp.set_model_state_dict(fresh, dcp.get_model_state_dict(model))
    dcp.set_optimizer_state_dict(fresh, fresh_opt, reordered)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close(fresh_opt.state[q][k].full_tensor(), optim.state[p][k].full_tensor(), atol=0, rtol=0)
    assert_close(torch.stack(train(fresh, fresh_opt, range(2, 4))), torch.stack(train(model, optim, range(2, 4))),
                 atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["tp", "fsdp"])
def test_optimizer_own_state_dict_form(mesh1d, kind):
    """``set_state_dict`` takes an optimizer's own ``state_dict()`` (parameters numbered,
    not named), as torch's does: torchtune 0.6.1 resumes from its distributed checkpoint
    so. The state goes to the parameters at the same positions and training continues as
    from the original; group sizes that differ are a ``ValueError``."""
    model = make_model(kind, 0, mesh1d, None)
    optim = make_optim(model)
    train(model, optim, range(2))
    fresh = make_model(kind, 1, mesh1d, None)
    fresh_opt = make_optim(fresh)
    try:
        dcp.set_state_dict(fresh, fresh_opt, model_state_dict=model.state_dict(), optim_state_dict=optim.state_dict())
        problem = None
    except Exception as err:  # noqa: BLE001 (reported on every rank)
        problem = f"{type(err).__name__}: {err}"
    assert_all_ranks(problem is None, problem or "")
    for p, q in zip(model.parameters(), fresh.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close(fresh_opt.state[q][k].full_tensor(), optim.state[p][k].full_tensor(), atol=0, rtol=0)
    assert_close(torch.stack(train(fresh, fresh_opt, range(2, 4))), torch.stack(train(model, optim, range(2, 4))),
                 atol=0, rtol=0)
    own = optim.state_dict()
    own["param_groups"][0]["params"] = own["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="param groups do not match"):
        dcp.set_optimizer_state_dict(fresh, fresh_opt, own)
