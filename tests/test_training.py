"""A small MLP and a small attention block train on sharded inputs and parameters
with the same losses as a single-process run."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, global_tensor
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor

R = Replicate()


def mlp(p, x):
    h = F.gelu(F.linear(x, p["w1"], p["b1"]))
    return F.linear(h, p["w2"], p["b2"])


def attention(p, x, heads=4):
    batch, seq, embed = x.shape
    h = F.layer_norm(x, (embed,), p["ln_w"], p["ln_b"])

    def split(t):
        return t.view(batch, seq, heads, embed // heads).transpose(1, 2)

    q, k, v = (split(F.linear(h, p[w])) for w in ("wq", "wk", "wv"))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = o.transpose(1, 2).reshape(batch, seq, embed)
    return x + F.linear(o, p["wo"])


def train(model, params, x, target, loss_fn, steps=4):
    params = {k: torch.nn.Parameter(v.detach().clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=0.01)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(params, x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor() if isinstance(loss, DTensor) else loss.detach())
    return torch.stack(losses), params


def distributed(tensors: dict, layout: dict, mesh):
    return {k: distribute_tensor(t, mesh, layout[k]) for k, t in tensors.items()}


def mlp_data():
    params = {"w1": global_tensor((9, 5), seed=1) * 0.4, "b1": global_tensor((9,), seed=2) * 0.1,
              "w2": global_tensor((3, 9), seed=3) * 0.3, "b2": global_tensor((3,), seed=4) * 0.1}
    x = global_tensor((7, 5), seed=5)
    target = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(6))
    return params, x, target


MLP_LAYOUTS_1D = {
    "tensor parallel": ({"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)], "b2": [R]}, [R], [R]),
    "data parallel": ({"w1": [R], "b1": [R], "w2": [R], "b2": [R]}, [Shard(0)], [Shard(0)]),
}


@pytest.mark.parametrize("name", list(MLP_LAYOUTS_1D))
def test_mlp_1d(mesh1d, name):
    layout, x_layout, t_layout = MLP_LAYOUTS_1D[name]
    params, x, target = mlp_data()
    ref_losses, ref_params = train(mlp, params, x, target, F.cross_entropy)
    dist_losses, dist_params = train(
        mlp, distributed(params, layout, mesh1d), distribute_tensor(x, mesh1d, x_layout),
        distribute_tensor(target, mesh1d, t_layout), F.cross_entropy,
    )
    assert_close(dist_losses, ref_losses, atol=1e-5, rtol=1e-5)
    for k in params:
        assert_close(dist_params[k].full_tensor(), ref_params[k].detach(), atol=1e-5, rtol=1e-5)


def test_mlp_2d(mesh2d):
    layout = {"w1": [R, Shard(0)], "b1": [R, Shard(0)], "w2": [R, Shard(1)], "b2": [R, R]}
    params, x, target = mlp_data()
    ref_losses, _ = train(mlp, params, x, target, F.cross_entropy)
    dist_losses, _ = train(
        mlp, distributed(params, layout, mesh2d), distribute_tensor(x, mesh2d, [Shard(0), R]),
        distribute_tensor(target, mesh2d, [Shard(0), R]), F.cross_entropy,
    )
    assert_close(dist_losses, ref_losses, atol=1e-5, rtol=1e-5)


def attention_data(embed=8):
    params = {w: global_tensor((embed, embed), seed=i) * 0.3 for i, w in enumerate(("wq", "wk", "wv", "wo"))}
    params["ln_w"] = 1 + 0.1 * global_tensor((embed,), seed=7)
    params["ln_b"] = 0.1 * global_tensor((embed,), seed=8)
    x = global_tensor((3, 5, embed), seed=9)
    target = global_tensor((3, 5, embed), seed=10)
    return params, x, target


@pytest.mark.parametrize("name", ["heads sharded", "batch sharded"])
def test_attention_1d(mesh1d, name):
    params, x, target = attention_data()
    if name == "heads sharded":
        layout = {"wq": [Shard(0)], "wk": [Shard(0)], "wv": [Shard(0)], "wo": [Shard(1)], "ln_w": [R], "ln_b": [R]}
        x_layout = [R]
    else:
        layout = {k: [R] for k in params}
        x_layout = [Shard(0)]
    ref_losses, _ = train(attention, params, x, target, F.mse_loss)
    dist_losses, _ = train(
        attention, distributed(params, layout, mesh1d), distribute_tensor(x, mesh1d, x_layout),
        distribute_tensor(target, mesh1d, x_layout), F.mse_loss,
    )
    assert_close(dist_losses, ref_losses, atol=1e-5, rtol=1e-5)
