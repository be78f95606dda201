"""sam and normalize (fxtrain/contrib/_sam.py): Optax parity in both modes, Optax's SAM cases, errors."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, state_leaves_close

C = fx.contrib

ADV = {"sgd": ("sgd", {"learning_rate": 1e-2}), "adam": ("adam", {"learning_rate": 1e-3})}
VARIANTS = {
    "default": {},
    "sync3": {"sync_period": 3},
    "no_reset": {"sync_period": 3, "reset_state": False},
    "sync1": {"sync_period": 1},
}


def _build(lib, contrib, adv, outer=("sgd", {"learning_rate": 0.05, "momentum": 0.9}), **kwargs):
    name, kw = ADV[adv]
    return contrib.sam(getattr(lib, outer[0])(**outer[1]),
                       lib.chain(contrib.normalize(), getattr(lib, name)(**kw)), **kwargs)


PAIRS = [("default", "sgd"), ("default", "adam"), ("sync3", "adam"), ("no_reset", "adam"), ("sync1", "sgd")]


@pytest.mark.optax
@pytest.mark.parametrize("variant,adv", PAIRS, ids=[f"{v}-{a}" for v, a in PAIRS])
def test_transparent_mode_matches_optax(variant, adv):
    optax = pytest.importorskip("optax")
    kwargs = VARIANTS[variant]
    assert_parity(_build(fx, C, adv, **kwargs), _build(optax, optax.contrib, adv, **kwargs))


@pytest.mark.optax
def test_normalize_matches_optax():
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(C.normalize(), fx.scale(-0.1)), optax.chain(optax.contrib.normalize(), optax.scale(-0.1)))


TARGET = nested_params(seed=5)


def _grad_at(p):  # the gradient of |p - target|^2 / 2, the same on both sides
    return fx.tree.map(lambda x, t: x - t, p, TARGET)


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", [{}, {"sync_period": 3, "reset_state": False}], ids=["default", "sync3"])
def test_opaque_mode_matches_optax(kwargs):
    import jax
    optax = pytest.importorskip("optax")
    tx = _build(fx, C, "adam", opaque_mode=True, **kwargs)
    otx = _build(optax, optax.contrib, "adam", opaque_mode=True, **kwargs)
    calls = []

    def grad_fn(p, i):
        calls.append(i)
        return _grad_at(p)

    jtarget = to_jnp(TARGET)
    ograd_fn = lambda p, i: jax.tree.map(lambda x, t: x - t, p, jtarget)  # noqa: E731
    params, oparams = nested_params(), to_jnp(nested_params())
    state, ostate = tx.init(params), otx.init(oparams)
    for step in range(20):
        donate = step % 2 == 1  # the donated kernel on odd steps
        g = _grad_at(params)
        u, state = (fx.update_(tx, g, state, params, grad_fn=grad_fn) if donate
                    else tx.update(g, state, params, grad_fn=grad_fn))
        ou, ostate = otx.update(_grad_at_jax(oparams, jtarget), ostate, oparams, grad_fn=ograd_fn)
        assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
        params, oparams = fx.apply_updates(params, u), optax.apply_updates(oparams, ou)
    state_leaves_close(state, ostate)
    assert calls == list(range(kwargs.get("sync_period", 2) - 1)) * 20


def _grad_at_jax(p, t):
    import jax
    return jax.tree.map(lambda x, y: x - y, p, t)


def _parabola(tx, steps, opaque):  # Optax's test_optimization, with larger rates: 200 updates, not 50000
    target = torch.tensor([1.0, -1.0, 1.0])
    params = torch.tensor([-1.0, 10.0, 1.0])
    state = tx.init(params)
    grad = lambda p: 2 * (p - target)  # noqa: E731
    for _ in range(steps):
        extra = {"grad_fn": lambda p, i: grad(p)} if opaque else {}
        u, state = tx.update(grad(params), state, params, **extra)
        params = fx.apply_updates(params, u)
    return params, target


@pytest.mark.parametrize("opaque", [False, True], ids=["transparent", "opaque"])
@pytest.mark.parametrize("adv", ADV)
def test_optimization_reaches_the_minimum(adv, opaque):
    tx = _build(fx, C, adv, outer=("sgd", {"learning_rate": 0.1}), opaque_mode=opaque)
    params, target = _parabola(tx, 200, opaque)
    assert_trees_close(params, target, rtol=3e-2, atol=3e-2)


def test_opaque_mode_returns_only_outer_steps():
    # One opaque call equals the two transparent calls of a period (the adversarial one and the outer one).
    target = nested_params(seed=5)
    grad = lambda p: fx.tree.map(lambda x, t: x - t, p, target)  # noqa: E731
    opaque, transparent = _build(fx, C, "sgd", opaque_mode=True), _build(fx, C, "sgd")
    p0 = nested_params()
    u, _ = opaque.update(grad(p0), opaque.init(p0), p0, grad_fn=lambda p, i: grad(p))
    s = transparent.init(p0)
    u1, s = transparent.update(grad(p0), s, p0)
    p1 = fx.apply_updates(p0, u1)
    u2, s = transparent.update(grad(p1), s, p1)
    assert_trees_close(fx.apply_updates(p0, u), fx.apply_updates(p1, u2))
    assert int(s.steps_since_sync) == 0


def test_pure_dtypes_and_none_leaves():  # transparent mode (opaque mode needs grad_fn: tested above)
    tx = _build(fx, C, "adam", sync_period=3)
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


def test_traits():
    assert fx.traits(_build(fx, C, "adam")).elementwise is False  # normalize reduces over all leaves
    plain = C.sam(fx.sgd(0.1), fx.sgd(0.01))
    assert fx.traits(plain).elementwise and fx.traits(plain).extra_args
    assert not fx.traits(C.sam(fx.sgd(0.1), fx.sgd(0.01), opaque_mode=True)).elementwise


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"sam: sync_period=0 must be an int >= 1"):
        C.sam(fx.sgd(0.1), fx.sgd(0.1), sync_period=0)
    with pytest.raises(ValueError, match=r"sam: batch_axis_name='batch'"):
        C.sam(fx.sgd(0.1), fx.sgd(0.1), batch_axis_name="batch")
    tx = C.sam(fx.sgd(0.1), fx.sgd(0.1), opaque_mode=True)
    p = torch.ones(2)
    with pytest.raises(ValueError, match=r"sam: opaque_mode=True needs the gradient function"):
        tx.update(p, tx.init(p), p)
