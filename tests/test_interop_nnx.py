"""fxtrain/interop/_nnx.py: torch modules <-> Flax NNX modules with the same layers, and nnx.Optimizer states.

Checked against flax.nnx itself: outputs of the two models after to_nnx / from_nnx, and training continued
across the boundary (the optimizer state converted) against training that never crossed it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxtrain as fx
from fxtrain.interop import (from_jax, from_nnx, state_from_nnx_optimizer, state_to_nnx_optimizer, to_jax,
                             to_nnx)

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
pytestmark = pytest.mark.jax

TOL = dict(rtol=1e-5, atol=1e-5)  # float32 rounding: the two frameworks sum in different orders


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 3)])

    def forward(self, ids):
        x = self.conv(self.emb(ids).transpose(1, 2))
        x = self.ln(self.bn(x).transpose(1, 2))
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.layers[1](torch.relu(self.layers[0](x))).mean(1)


class NNet(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(11, 8, rngs=rngs)
        self.conv = nnx.Conv(8, 8, (3,), rngs=rngs)
        self.bn = nnx.BatchNorm(8, use_running_average=True, epsilon=1e-5, rngs=rngs)
        self.ln = nnx.LayerNorm(8, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)])

    def __call__(self, ids):
        x = self.ln(self.bn(self.conv(self.emb(ids))))
        x = x + self.attn(x)
        return self.layers[1](jax.nn.relu(self.layers[0](x))).mean(1)


def _torch_net():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():  # norms init to ones/zeros: make every leaf matter
            p.add_(0.3 * torch.randn_like(p))
        net(torch.randint(0, 11, (4, 6)))  # running statistics away from their init
    return net.eval()


def test_to_nnx_gives_torch_outputs():
    net = _torch_net()
    ids = torch.randint(0, 11, (3, 7))
    _, params, buffers = fx.functional(net)
    model = to_nnx(params, net, NNet(nnx.Rngs(0)), buffers=buffers)
    assert torch.equal(from_jax(model.bn.mean[...]), buffers["bn.running_mean"])
    with torch.no_grad():
        expected = net(ids)
    torch.testing.assert_close(from_jax(model(to_jax(ids.int()))), expected, **TOL)


def test_from_nnx_gives_nnx_outputs():
    model = NNet(nnx.Rngs(1))
    model.bn.mean[...] = jnp.arange(8.0) / 10  # running statistics that matter
    model.bn.var[...] = 1 + jnp.arange(8.0) / 5
    net = Net().eval()
    loaded = from_nnx(model, net, buffers=True)
    assert [k for k in loaded if "running" not in k] == [k for k, _ in net.named_parameters()]
    result = net.load_state_dict(loaded, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == []  # BatchNorm fills num_batches_tracked
    ids = torch.randint(0, 11, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), from_jax(model(to_jax(ids.int()))), **TOL)
    # the same from the state, and from its pure dict
    for state in (nnx.state(model), nnx.to_pure_dict(nnx.state(model))):
        again = from_nnx(state, net, buffers=True)
        assert all(torch.equal(again[k], v) for k, v in loaded.items())


def test_sequential_and_round_trip():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    params = {k: p.detach() for k, p in net.named_parameters()}
    back = from_nnx(to_nnx(params, net, model), net)
    assert list(back) == list(params) and all(torch.equal(back[k], v) for k, v in params.items())


def test_errors_name_the_path():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    wrong = nnx.Sequential(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(5, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"'layers/0/kernel' has the shape \(3, 5\) in the NNX model"):
        to_nnx(dict(net.named_parameters()), net, wrong)
    bigger = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(4, 2, rngs=nnx.Rngs(0)),
                            nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"the NNX Param 'layers/3/bias' gets no torch parameter"):
        to_nnx(dict(net.named_parameters()), net, bigger)
    with pytest.raises(ValueError, match=r"'params/3/bias' is not a parameter of Sequential"):
        from_nnx(bigger, net)


# --- nnx.Optimizer state <-> fxtrain state: training continues across the boundary --------------------

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 2)])
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return self.layers[1](torch.tanh(self.ln(self.layers[0](x))))


class NMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)])
        self.ln = nnx.LayerNorm(8, epsilon=1e-5, rngs=rngs)

    def __call__(self, x):
        return self.layers[1](jnp.tanh(self.ln(self.layers[0](x))))


LR, WD, STEPS = 0.03, 0.1, 4


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def _nnx_steps(model, opt, n):
    x, y = (to_jax(t) for t in _data())

    def loss(m):
        return jnp.mean((m(x) - y) ** 2)

    for _ in range(n):
        opt.update(model, nnx.grad(loss)(model))


def _txs():
    return (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=WD)),
            fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(LR, weight_decay=WD)))


def test_nnx_optimizer_state_continues_in_fxtrain(mse_steps):
    otx, tx = _txs()
    model = NMLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, otx, wrt=nnx.Param)
    _nnx_steps(model, opt, STEPS)
    net = MLP()
    params = {k: v.clone() for k, v in from_nnx(model, net).items()}
    state = state_from_nnx_optimizer(opt, net, tx.init(params))
    assert int(state[1][0].count) == STEPS
    params, _ = mse_steps(net, tx, params, state, STEPS, _data())
    _nnx_steps(model, opt, STEPS)  # the run that never crossed
    fx_tol = dict(rtol=1e-5, atol=1e-6)
    for k, v in from_nnx(model, net).items():
        torch.testing.assert_close(params[k], v, **fx_tol)


def test_fxtrain_state_continues_in_nnx(mse_steps):
    otx, tx = _txs()
    torch.manual_seed(0)
    net = MLP()
    params = {k: p.detach().clone() for k, p in net.named_parameters()}
    params, state = mse_steps(net, tx, params, tx.init(params), STEPS, _data())
    model = to_nnx(params, net, NMLP(nnx.Rngs(0)))
    opt = state_to_nnx_optimizer(state, net, nnx.Optimizer(model, otx, wrt=nnx.Param))
    assert int(opt.step[...]) == STEPS
    torch.testing.assert_close(from_jax(opt.opt_state[1][0].mu["layers"][0]["kernel"][...]),
                               state[1][0].mu["layers.0.weight"].T)
    _nnx_steps(model, opt, STEPS)
    params, _ = mse_steps(net, tx, params, state, STEPS, _data())  # the run that never crossed
    for k, v in from_nnx(model, net).items():
        torch.testing.assert_close(v, params[k], rtol=1e-5, atol=1e-6)
