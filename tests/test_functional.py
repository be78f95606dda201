"""fx.functional: a module as a pure function of (params, buffers), buffers threaded as state."""

import pytest
import torch
from torch import nn

import fxtrain as fx
from fxtrain.models import TransformerLM
from fxtrain.testing import assert_trees_close


def bn_net():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def snapshot(t):
    return {k: v.clone() for k, v in t.items()}


def test_trees_are_the_named_tensors():
    net = bn_net()
    apply, params, buffers = fx.functional(net)
    assert list(params) == [n for n, _ in net.named_parameters()]
    assert list(buffers) == [n for n, _ in net.named_buffers()]
    assert all(not p.requires_grad for p in params.values())
    # No copy: the trees share storage with the module (a donated step updates them in place).
    assert params["0.weight"].data_ptr() == net[0].weight.data_ptr()


def test_train_mode_returns_new_buffers_and_mutates_nothing():
    net = bn_net()
    apply, params, buffers = fx.functional(net)
    before_params, before_buffers = snapshot(params), snapshot(buffers)
    module_stats = net[1].running_mean.clone()
    x = torch.randn(16, 3) * 3 + 1

    out, new = apply(params, buffers, x, train=True)

    assert out.shape == (16, 2)
    assert_trees_close(buffers, before_buffers, rtol=0, atol=0)      # the caller's tree is untouched
    assert_trees_close(params, before_params, rtol=0, atol=0)
    assert torch.equal(net[1].running_mean, module_stats)           # and so is the module
    assert int(new["1.num_batches_tracked"]) == 1
    assert not torch.allclose(new["1.running_mean"], buffers["1.running_mean"])
    # Same numbers as the stateful module in train mode.
    ref = bn_net()
    ref.load_state_dict(net.state_dict())
    ref.train()
    torch.testing.assert_close(ref(x), out)
    torch.testing.assert_close(ref[1].running_var, new["1.running_var"])


def test_eval_mode_uses_running_stats_and_restores_the_module_mode():
    net = bn_net().train()
    apply, params, buffers = fx.functional(net)
    _, buffers = apply(params, buffers, torch.randn(32, 3), train=True)
    x = torch.randn(5, 3)
    out, same = apply(params, buffers, x, train=False)
    assert same is buffers
    assert net.training                                               # mode restored
    ref = bn_net()
    ref.load_state_dict({**params, **buffers})
    torch.testing.assert_close(ref.eval()(x), out)


def test_mode_must_be_explicit():
    apply, params, buffers = fx.functional(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="train"):
        apply(params, buffers, torch.zeros(1, 2))
    with pytest.raises(TypeError, match="train must be True or False"):
        apply(params, buffers, torch.zeros(1, 2), train="yes")


def test_gradients_match_the_module():
    torch.manual_seed(0)
    net = bn_net()
    apply, params, buffers = fx.functional(net)
    x, y = torch.randn(8, 3), torch.randn(8, 2)

    def loss(p):
        out, _ = apply(p, buffers, x, train=True)
        return ((out - y) ** 2).mean()

    grads = torch.func.grad(loss)(params)
    ((net.train()(x) - y) ** 2).mean().backward()
    assert_trees_close(grads, {n: p.grad for n, p in net.named_parameters()}, rtol=1e-5, atol=1e-7)


def test_missing_param_is_an_error_not_a_silent_fallback():
    apply, params, buffers = fx.functional(nn.Linear(2, 2))
    del params["bias"]
    with pytest.raises(RuntimeError, match="bias"):
        apply(params, buffers, torch.zeros(1, 2), train=False)


def test_tied_weights_appear_once_and_stay_tied():
    lm = TransformerLM(vocab_size=11, context=4, d_model=8, n_layers=1, n_heads=2)
    apply, params, _ = fx.functional(lm)
    assert "tok.weight" in params and "head.weight" not in params
    idx = torch.tensor([[1, 2, 3]])
    zeroed = {**params, "tok.weight": torch.zeros_like(params["tok.weight"])}
    out, _ = apply(zeroed, {}, idx, train=False)
    assert torch.count_nonzero(out) == 0                             # the head used the zeroed embedding


def test_buffers_thread_through_train_step():
    torch.manual_seed(0)
    apply, params, buffers = fx.functional(bn_net())
    x = torch.randn(64, 3)
    y = (x[:, 0] > 0).long()

    def loss_fn(params, batch):
        buffers, x, y = batch
        out, buffers = apply(params, buffers, x, train=True)
        return nn.functional.cross_entropy(out, y), {"buffers": buffers}

    tx = fx.adam(1e-2)
    step = fx.train_step(loss_fn, tx, has_aux=True)
    opt_state = tx.init(params)
    losses = []
    for _ in range(30):
        params, opt_state, metrics = step(params, opt_state, (buffers, x, y))
        buffers = metrics["aux"]["buffers"]
        losses.append(float(metrics["loss"]))
    assert int(buffers["1.num_batches_tracked"]) == 30
    assert losses[-1] < 0.8 * losses[0]


def test_dtensor_params(tmp_path):
    dist = torch.distributed
    from torch.distributed.tensor import Replicate, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        net = nn.Linear(3, 2)
        apply, params, buffers = fx.functional(net)
        dparams = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in params.items()}
        xs = [p.detach().requires_grad_() for p in dparams.values()]
        x = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])
        out, _ = apply(dict(zip(dparams, xs)), buffers, x, train=True)
        grads = torch.autograd.grad(out.sum(), xs)
        ref = torch.autograd.grad(net(x.full_tensor()).sum(), list(net.parameters()))
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g.full_tensor(), r)
    finally:
        dist.destroy_process_group()
