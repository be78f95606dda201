"""scale_by_polyak and polyak_sgd (fxtrain/transforms/_polyak.py): Optax parity (20 steps, ``value=`` passed),
Optax's own cases, vmap and grad against jax.vmap / jax.grad (the composable harness passes no value)."""

from __future__ import annotations

import pytest
import torch

import fxtrain as fx
from fxtrain import tree
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests._parity import grads as parity_grads
from tests._parity import noise


def objective(params):
    """``0.5 * sum(p**2)``: the value passed with the parity harness's gradients (``0.5 p + noise``)."""
    return 0.5 * sum((p ** 2).sum() for p in tree.leaves(params))


def run_both(tx, otx, steps=20):
    """``steps`` updates of ``tx`` and of Optax's ``otx`` on the same params, gradients and values."""
    import jax
    import optax

    params = nested_params()
    p, state, ostate = to_jnp(params), tx.init(params), otx.init(to_jnp(params))
    for k in range(steps):
        g = parity_grads(params, k)
        du, _ = fx.update_(tx, tree.clone(g), tree.clone(state), params, value=objective(params))  # donated
        u, state = tx.update(g, state, params, value=objective(params))
        assert_trees_close(du, u, rtol=1e-6, atol=1e-7)
        with jax.disable_jit():
            og = jax.tree.map(lambda x, n: 0.5 * x + n, p, to_jnp(noise(k)))
            ou, ostate = otx.update(og, ostate, p, value=0.5 * sum((x ** 2).sum() for x in jax.tree.leaves(p)))
        try:
            assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"step {k}: {e}") from None
        params, p = fx.apply_updates(params, u), optax.apply_updates(p, ou)


VARIANTS = {
    "default": {},
    "sps_plus_f_min": {"variant": "sps+", "f_min": 5.0},
    "eps_max_lr": {"eps": 0.5, "max_learning_rate": 0.05},
}


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_scale_by_polyak_matches_optax(kwargs):
    optax = pytest.importorskip("optax")
    run_both(fx.chain(fx.scale_by_polyak(**kwargs), fx.scale(-1.0)),
             optax.chain(optax.scale_by_polyak(**kwargs), optax.scale(-1.0)))


@pytest.mark.optax
def test_polyak_sgd_matches_optax():
    optax = pytest.importorskip("optax")
    run_both(fx.polyak_sgd(max_learning_rate=0.8, scaling=fx.linear_schedule(1.0, 0.5, 10), f_min=0.1, eps=1e-3),
             optax.polyak_sgd(max_learning_rate=0.8, scaling=optax.linear_schedule(1.0, 0.5, 10), f_min=0.1, eps=1e-3))


def test_pure_and_donated_agree():
    tx = fx.polyak_sgd(max_learning_rate=0.5, variant="sps+")
    params = nested_params()
    state = tx.init(params)
    g = parity_grads(params, 0)
    before = tree.clone(g)
    u, _ = tx.update(g, state, params, value=objective(params))
    assert_trees_close(g, before, rtol=0, atol=0)
    du, _ = fx.update_(tx, tree.clone(g), state, params, value=objective(params))
    assert_trees_close(du, u, rtol=1e-6, atol=1e-7)


def test_l1_norm_in_one_step():
    """Optax's test_scale_by_polyak_l1_norm: on |x|_1 Polyak's step is exact, one step reaches the minimum;
    without value= the update refuses."""
    x = torch.tensor([1.0, -1.0])
    tx = fx.scale_by_polyak()
    with pytest.raises(TypeError, match=r"scale_by_polyak.update needs value="):
        tx.update(x, tx.init(x), x)
    value, grad = x.abs().sum(), torch.sign(x)
    u, _ = tx.update(grad, tx.init(x), x, value=value)
    assert (x - u).abs().sum() < 1e-10


def test_parabola_converges():
    """Optax's alias_test optimization case for polyak_sgd(max_learning_rate=1.0): the parabola's minimum."""
    target = torch.tensor([1.0, -1.0, 1.0])
    params = torch.tensor([-1.0, 10.0, 1.0])
    tx = fx.polyak_sgd(max_learning_rate=1.0)
    state = tx.init(params)
    for _ in range(100):
        value, grad = ((params - target) ** 2).sum(), 2 * (params - target)
        u, state = tx.update(grad, state, params, value=value)
        params = fx.apply_updates(params, u)
    assert_trees_close(params, target, rtol=1e-2, atol=1e-2)


def test_zero_gradient_gives_zero_step():
    """A zero gradient (and eps=0) gives a zero update, not NaN (Optax's guard below float64's epsilon)."""
    tx = fx.scale_by_polyak()
    g = {"w": torch.zeros(3)}
    u, _ = tx.update(g, tx.init(g), value=torch.tensor(2.0))
    assert u["w"].tolist() == [0.0, 0.0, 0.0]


def test_variant_is_checked():
    with pytest.raises(ValueError, match="scale_by_polyak: variant='sps-' must be one of"):
        fx.scale_by_polyak(variant="sps-")
    with pytest.raises(ValueError, match=r"polyak_sgd: eps=-1.0 must be >= 0"):
        fx.polyak_sgd(eps=-1.0)
    assert not fx.is_elementwise(fx.polyak_sgd())


@pytest.mark.optax
def test_vmap_and_grad_match_jax():
    """vmap over 4 (params, values) of 5 updates, and grad of a loss after 3 updates w.r.t. the initial params
    and w.r.t. a tensor max_learning_rate, against jax.vmap / jax.grad of Optax's polyak_sgd."""
    optax = pytest.importorskip("optax")
    import jax

    def run(m, tx, x, steps, grad):
        state = tx.init(x)
        for _ in range(steps):
            loss = lambda x: (x ** 4 + x ** 2).sum()  # noqa: E731
            u, state = tx.update(grad(loss)(x), state, x, value=loss(x))
            x = x + u
        return x

    xs = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    ours = torch.func.vmap(lambda x: run(fx, fx.polyak_sgd(max_learning_rate=0.3), x, 5, torch.func.grad))(xs)
    with jax.disable_jit():
        theirs = jax.vmap(lambda x: run(optax, optax.polyak_sgd(max_learning_rate=0.3), x, 5, jax.grad))(to_jnp(xs))
    assert_trees_close(ours, from_jnp(theirs), rtol=1e-5, atol=1e-6)

    def meta(m, grad, x, lr):
        return (run(m, m.polyak_sgd(max_learning_rate=lr, f_min=-0.1), x, 3, grad) ** 2).sum()

    lr = torch.tensor(0.3)
    ours = torch.func.grad(lambda x, lr: meta(fx, torch.func.grad, x, lr), argnums=(0, 1))(xs[0], lr)
    with jax.disable_jit():
        theirs = jax.grad(lambda x, lr: meta(optax, jax.grad, x, lr), argnums=(0, 1))(to_jnp(xs[0]), to_jnp(lr))
    assert_trees_close(list(ours), [from_jnp(t) for t in theirs], rtol=1e-4, atol=1e-5)
