"""lookahead (fxtrain/transforms/_lookahead.py): Optax's analytic cases, parity over 20 steps, torch.func."""

from typing import Any, NamedTuple

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests._parity import noise
from tests.cases.wrappers import reads_value


class _TestState(NamedTuple):
    aggregate_grads: Any
    is_reset: torch.Tensor  # a tensor (Optax's test keeps a Python bool): reset on device


def _test_optimizer(step_size):
    """Optax's lookahead_test fast optimizer: sgd with a state that shows whether it was reset."""
    def init_fn(params):
        return _TestState(fx.tree.map(torch.zeros_like, params), torch.tensor(True))

    def update_fn(updates, state, params):
        assert fx.tree.structure(updates) == fx.tree.structure(params)
        return (fx.tree.map(lambda u: step_size * u, updates),
                _TestState(fx.apply_updates(state.aggregate_grads, updates), torch.tensor(False)))

    return fx.GradientTransformation(init_fn, update_fn)


GRADS = {"x": torch.tensor(2.0), "y": torch.tensor(-2.0)}
INITIAL = {"x": torch.tensor(3.0), "y": torch.tensor(-3.0)}


def _loop(tx, steps, params, donate=False):
    state = tx.init(params)
    for _ in range(steps):
        u, state = fx.update_(tx, fx.tree.clone(GRADS), state, params) if donate else tx.update(GRADS, state, params)
        params = fx.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("donate", [False, True])
def test_optax_lookahead(donate):
    # x: 3 -> 2 -> 1 -> 2 (sync) -> 1 -> 0 -> 1 (sync); y the same, negated.
    tx = fx.lookahead(_test_optimizer(-0.5), sync_period=3, slow_step_size=1 / 3)
    final, _ = _loop(tx, 6, fx.LookaheadParams.init_synced(INITIAL), donate)
    assert_trees_close(final.slow, {"x": torch.tensor(1.0), "y": torch.tensor(-1.0)}, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reset_state", [False, True])
def test_optax_lookahead_state_reset(reset_state):
    fast = _test_optimizer(-0.5)
    tx = fx.lookahead(fast, sync_period=3, slow_step_size=0.5, reset_state=reset_state)
    _, state = _loop(tx, 3, fx.LookaheadParams.init_synced(INITIAL))
    expected = fast.init(INITIAL) if reset_state else _loop(fast, 3, INITIAL)[1]
    assert_trees_close(state.fast_state, expected, rtol=0, atol=0)


class _HostState(NamedTuple):
    aggregate_grads: Any
    is_reset: bool = True  # a Python bool, as in Optax's own test


def _host_test_optimizer(step_size, lib):
    """Optax's lookahead_test fast optimizer itself: its state keeps a Python bool, in fxtrain or in Optax."""
    tree_map = fx.tree.map if lib is fx else __import__("jax").tree.map
    zeros = torch.zeros_like if lib is fx else __import__("jax").numpy.zeros_like
    apply = fx.apply_updates if lib is fx else __import__("optax").apply_updates
    GT = fx.GradientTransformation if lib is fx else __import__("optax").GradientTransformation

    def init_fn(params):
        return _HostState(tree_map(zeros, params), is_reset=True)

    def update_fn(updates, state, params):
        return tree_map(lambda u: step_size * u, updates), _HostState(apply(state.aggregate_grads, updates), False)

    return GT(init_fn, update_fn)


@pytest.mark.optax
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("steps", [3, 4, 6])
def test_reset_state_resets_host_leaves_as_optax(steps, donate):
    """reset_state=True resets every leaf of the fast state, the Python bool too (it was kept from the updated
    state: is_reset stayed False after a synchronization); values against Optax's lookahead running the same
    fast optimizer (Optax's lookahead_test), over syncs (3, 6) and between them (4)."""
    optax = pytest.importorskip("optax")
    import jax

    tx = fx.lookahead(_host_test_optimizer(-0.5, fx), sync_period=3, slow_step_size=0.5, reset_state=True)
    otx = optax.lookahead(_host_test_optimizer(-0.5, optax), sync_period=3, slow_step_size=0.5, reset_state=True)
    _, state = _loop(tx, steps, fx.LookaheadParams.init_synced(INITIAL), donate)
    p = optax.LookaheadParams.init_synced(to_jnp(INITIAL))
    with jax.disable_jit():
        ostate = otx.init(p)
        for _ in range(steps):
            u, ostate = otx.update(to_jnp(GRADS), ostate, p)
            p = optax.apply_updates(p, u)
    assert bool(state.fast_state.is_reset) == bool(ostate.fast_state.is_reset) == (steps % 3 == 0)
    assert_trees_close(state.fast_state.aggregate_grads, from_jnp(ostate.fast_state.aggregate_grads), rtol=0, atol=0)


@pytest.mark.parametrize("sync_period, slow_step_size, x", [(1, 0.5, 1.0), (1, 0.0, 3.0), (1, 1.0, -1.0),
                                                            (2, 1.0, -1.0)])
def test_optax_lookahead_edge_cases(sync_period, slow_step_size, x):
    tx = fx.lookahead(_test_optimizer(-1.0), sync_period, slow_step_size)
    final, _ = _loop(tx, 2, fx.LookaheadParams.init_synced(INITIAL))
    assert_trees_close(final.slow, {"x": torch.tensor(x), "y": torch.tensor(-x)}, rtol=1e-6, atol=1e-6)


def _run_optax(otx, params, steps):
    import jax
    import optax

    p = optax.LookaheadParams.init_synced(to_jnp(params))
    state, history = otx.init(p), []

    @jax.jit
    def step(p, state, n):
        u, state = otx.update(jax.tree.map(lambda x, y: 0.5 * x + y, p.fast, n), state, p)
        return optax.apply_updates(p, u), state, u

    for k in range(steps):
        p, state, u = step(p, state, to_jnp(noise(k)))
        history.append(fx.LookaheadParams(*from_jnp(u)))  # Optax's class holds the same pair
    return history, fx.LookaheadParams(*from_jnp(p)), state


@pytest.mark.optax
@pytest.mark.parametrize("reset_state", [True])  # the reset selects on device; without it, Optax's cases above
def test_matches_optax_over_20_steps(reset_state):
    optax = pytest.importorskip("optax")
    tx = fx.lookahead(fx.adam(0.1), sync_period=3, slow_step_size=0.4, reset_state=reset_state)
    otx = optax.lookahead(optax.adam(0.1), sync_period=3, slow_step_size=0.4, reset_state=reset_state)
    theirs, p_theirs, ostate = _run_optax(otx, nested_params(), 20)
    for donate in (False, True):
        p = fx.LookaheadParams.init_synced(nested_params())
        state = tx.init(p)
        for k in range(20):
            g = fx.tree.map(lambda x, n: 0.5 * x + n, p.fast, noise(k))
            u, state = fx.update_(tx, g, state, p) if donate else tx.update(g, state, p)
            assert_trees_close(u, theirs[k], rtol=1e-5, atol=1e-6)
            p = fx.apply_updates(p, u)
        assert_trees_close(p, p_theirs, rtol=1e-5, atol=1e-6)
        assert_trees_close(state.fast_state[0].mu, from_jnp(ostate.fast_state[0].mu), rtol=1e-5, atol=1e-6)
        assert int(state.steps_since_sync) == int(ostate.steps_since_sync) == 20 % 3


@pytest.mark.optax
def test_under_vmap_and_grad_matches_optax():
    import jax
    import optax

    def run(p, lr, lib):
        tx = (fx if lib == "fx" else optax).lookahead((fx if lib == "fx" else optax).sgd(lr, momentum=0.5), 2, 0.5)
        P = fx.LookaheadParams if lib == "fx" else optax.LookaheadParams
        p, apply = P.init_synced(p), (fx.apply_updates if lib == "fx" else optax.apply_updates)
        state = tx.init(p)
        for _ in range(3):
            u, state = tx.update(fx.tree.map(lambda w: 2 * w, p.fast) if lib == "fx" else
                                 jax.tree.map(lambda w: 2 * w, p.fast), state, p)
            p = apply(p, u)
        return (p.slow["w"] ** 2).sum()

    w = {"w": torch.tensor([1.0, -2.0, 0.5])}
    lrs = torch.tensor([0.1, 0.2])
    ours = torch.func.vmap(lambda lr: run(w, lr, "fx"))(lrs)
    theirs = jax.jit(jax.vmap(lambda lr: run(to_jnp(w), lr, "optax")))(to_jnp(lrs))  # jitted: one compile
    assert_trees_close(ours, from_jnp(theirs), rtol=1e-5, atol=1e-6)
    g = torch.func.grad(lambda lr: run(w, lr, "fx"))(torch.tensor(0.1))
    og = jax.jit(jax.grad(lambda lr: run(to_jnp(w), lr, "optax")))(to_jnp(torch.tensor(0.1)))
    assert g.item() == pytest.approx(float(og), rel=1e-4)


def test_errors_traits_and_extra_args():
    with pytest.raises(ValueError, match="lookahead: sync_period=0 must be an int >= 1"):
        fx.lookahead(fx.sgd(0.1), sync_period=0, slow_step_size=0.5)
    with pytest.raises(ValueError, match="lookahead: slow_step_size=-0.5 must be >= 0"):
        fx.lookahead(fx.sgd(0.1), sync_period=1, slow_step_size=-0.5)
    tx = fx.lookahead(fx.sgd(0.1), sync_period=2, slow_step_size=0.5)
    with pytest.raises(ValueError, match="lookahead: update needs params=LookaheadParams"):
        tx.update(GRADS, tx.init(INITIAL), INITIAL)
    assert fx.is_elementwise(tx) and repr(tx) == "lookahead(sync_period=2, slow_step_size=0.5, sgd(0.1))"
    tx = fx.lookahead(fx.chain(fx.scale(-1.0), reads_value()), sync_period=2, slow_step_size=0.5)
    assert fx.traits(tx).extra_args
    p = fx.LookaheadParams.init_synced(INITIAL)
    u, _ = tx.update(GRADS, tx.init(p), p, value=torch.tensor(1.0))
    assert u.fast["x"].item() == -1.0 and u.slow["x"].item() == 0.0
