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


# --- under torch.func: the stateless path (grad, vjp, vmap via jax.vmap, double backward); float32 tolerance
# rtol=1e-5, atol=1e-5 (XLA and ATen reduce in different orders), gradients of gradients atol=1e-4.

def jax_act(w, x):
    return jnp.tanh(x @ w) ** 2


def torch_act(w, x):
    return torch.tanh(x @ w) ** 2


@pytest.mark.parametrize("jit", [True, False])
def test_torch_func_grad_vjp_and_jacrev_match_torch(jit):
    w, x = torch.randn(3, 2), torch.randn(4, 3)
    f = jax_function(jit=jit)(jax_act)
    g = torch.func.grad(lambda w: f(w, x).sum())(w)
    torch.testing.assert_close(g, torch.func.grad(lambda w: torch_act(w, x).sum())(w), rtol=1e-5, atol=1e-5)
    ct = torch.randn(4, 2)
    out, pull = torch.func.vjp(lambda w: f(w, x), w)
    torch.testing.assert_close(out, torch_act(w, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pull(ct)[0], torch.func.vjp(lambda w: torch_act(w, x), w)[1](ct)[0],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.func.jacrev(lambda w: f(w, x))(w),
                               torch.func.jacrev(lambda w: torch_act(w, x))(w), rtol=1e-5, atol=1e-5)


def test_vmap_runs_jax_vmap_and_composes_with_grad():
    W, x, xs = torch.randn(5, 3, 2), torch.randn(4, 3), torch.randn(6, 4, 3)
    f = jax_function(jax_act)
    for transform, ref in [
        (torch.func.vmap(lambda w: f(w, x)), torch.func.vmap(lambda w: torch_act(w, x))),
        (torch.func.vmap(torch.func.grad(lambda w: f(w, x).sum())),
         torch.func.vmap(torch.func.grad(lambda w: torch_act(w, x).sum()))),
        (torch.func.grad(lambda W: torch.func.vmap(lambda w: f(w, x))(W).sum()),
         torch.func.grad(lambda W: torch.func.vmap(lambda w: torch_act(w, x))(W).sum())),
    ]:
        torch.testing.assert_close(transform(W), ref(W), rtol=1e-5, atol=1e-5)
    # batched over the data only (in_dims (None, 0)), the weights shared
    torch.testing.assert_close(torch.func.vmap(lambda xi: f(W[0], xi))(xs), torch_act(W[0], xs), rtol=1e-5, atol=1e-5)


def test_grad_of_grad_through_jax():
    w, x = torch.randn(3, 2), torch.randn(4, 3)
    f = jax_function(jax_act)
    gg = torch.func.grad(lambda w: torch.func.grad(lambda w: f(w, x).sum())(w).pow(2).sum())(w)
    ref = torch.func.grad(lambda w: torch.func.grad(lambda w: torch_act(w, x).sum())(w).pow(2).sum())(w)
    torch.testing.assert_close(gg, ref, rtol=1e-4, atol=1e-4)


def test_forward_mode_is_refused_in_one_line():
    f = jax_function(jax_act)
    with pytest.raises(NotImplementedError, match=r"torch.func.jvp, jacfwd\) is not supported; use torch.func.vjp"):
        torch.func.jvp(lambda w: f(w, torch.ones(4, 3)), (torch.ones(3, 2),), (torch.ones(3, 2),))


def test_pure_step_trains_vmaps_and_gives_hypergradients_like_torch():
    params, x, y = make()
    jloss = jax_function(jax_mlp_loss)

    def run(loss, lr, p):
        tx = fx.chain(fx.clip_by_global_norm(1.0), fx.inject_hyperparams(fx.adamw)(learning_rate=lr))
        step = fx.train_step(lambda p, b: loss(p, *b), tx, donate=False)
        s = tx.init(p)
        for _ in range(3):
            p, s, m = step(p, s, (x, y))
        return loss(p, x, y)

    lr = torch.tensor(0.05)
    torch.testing.assert_close(run(jloss, lr, params), run(torch_mlp_loss, lr, params), rtol=1e-5, atol=1e-5)
    hj = torch.func.grad(lambda lr: run(jloss, lr, params))(lr)
    ht = torch.func.grad(lambda lr: run(torch_mlp_loss, lr, params))(lr)
    assert torch.isfinite(hj) and hj != 0
    torch.testing.assert_close(hj, ht, rtol=1e-4, atol=1e-5)
    ens = tree.map(lambda v: torch.stack([v, v * 0.5]), params)  # an ensemble of 2 under vmap
    lj = torch.func.vmap(lambda p: run(jloss, lr, p))(ens)
    lt = torch.func.vmap(lambda p: run(torch_mlp_loss, lr, p))(ens)
    torch.testing.assert_close(lj, lt, rtol=1e-5, atol=1e-5)
