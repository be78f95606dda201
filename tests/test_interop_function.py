"""fxtrain/interop/_function.py: JAX functions in torch losses, gradients through jax.vjp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain import tree
from fxtrain.interop import jax_function
from fxtrain.testing import assert_trees_close

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytestmark = pytest.mark.jax


def jax_mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"].T + params["b1"])
    logits = h @ params["w2"].T + params["b2"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def torch_mlp_loss(params, x, y):
    h = torch.tanh(x @ params["w1"].T + params["b1"])
    return F.cross_entropy(h @ params["w2"].T + params["b2"], y.long())


def make():
    params = {"w1": torch.randn(8, 5) * 0.5, "b1": torch.zeros(8), "w2": torch.randn(3, 8) * 0.5, "b2": torch.zeros(3)}
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,), dtype=torch.int32)
    return params, x, y


@pytest.mark.parametrize("jit", [True, False])
def test_gradient_matches_the_same_function_in_torch(jit):
    params, x, y = make()
    p1 = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = jax_function(jit=jit)(jax_mlp_loss)(p1, x, y)
    loss.backward()
    p2 = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = torch_mlp_loss(p2, x, y)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert_trees_close({k: v.grad for k, v in p1.items()}, {k: v.grad for k, v in p2.items()})


def test_trains_under_train_step_like_the_torch_loss():
    params, x, y = make()
    jloss = jax_function(jax_mlp_loss)
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(0.05))
    step_j = fx.train_step(lambda p, b: jloss(p, *b), tx)
    step_t = fx.train_step(lambda p, b: torch_mlp_loss(p, *b), tx)
    pj, sj = tree.clone(params), tx.init(params)
    pt, st = tree.clone(params), tx.init(params)
    for _ in range(5):
        pj, sj, mj = step_j(pj, sj, (x, y))
        pt, st, mt = step_t(pt, st, (x, y))
    assert_trees_close(pj, pt, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mj["loss"], mt["loss"], rtol=1e-5, atol=1e-6)
    assert float(mj["loss"]) < 1.0


def test_a_jax_layer_with_a_tree_of_outputs_one_integer():
    @jax_function
    def layer(w, x):  # a pytree of outputs, one of them integer
        z = x @ w
        return {"act": jax.nn.gelu(z, approximate=False), "argmax": jnp.argmax(z, axis=-1)}

    w = torch.randn(4, 3)
    x = torch.randn(6, 4)

    def f(w):
        out = layer(w, x)
        assert out["argmax"].dtype == torch.int32 and not out["argmax"].requires_grad
        return (out["act"] ** 2).sum()

    wj = w.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(wj), wj)
    wt = w.clone().requires_grad_()
    (F.gelu(x @ wt, approximate="none") ** 2).sum().backward()
    torch.testing.assert_close(g, wt.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # no gradient needed: forward only, no VJP kept
        out = layer(w, x)
    assert out["act"].shape == (6, 3)


def test_bf16_and_unused_outputs():
    @jax_function
    def two(x):
        return x * 2, jnp.sin(x)

    x = torch.randn(5, dtype=torch.bfloat16, requires_grad=True)
    a, _ = two(x)  # the second output takes no part in the loss: zero cotangent
    a.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.tolist() == [2.0] * 5


def test_static_arguments_must_be_hashable():
    f = jax_function(lambda x, cfg: x * len(cfg))
    assert f(torch.ones(2), "abc").tolist() == [3.0, 3.0]
    with pytest.raises(TypeError, match="static and must be hashable"):
        f(torch.ones(2), bytearray(b"a"))
