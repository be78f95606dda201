"""add_noise, noisy_sgd (fxtrain/transforms/_noise.py): exact Optax parity without noise (eta=0), the noise's
variance schedule eta / t**gamma by statistics (against the formula and Optax's own draws), determinism,
resume, vmap."""

import math

import numpy as np
import pytest
import torch
from torch.func import vmap

import fxtrain as fx
from fxtrain.testing import nested_params
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, run_fx, run_optax
from tests.cases.scaling import trajectories

N = 20_000  # elements per draw: the sample std is within 0.5% of the true one (1 sigma)


def _sched(count):
    return 0.05 * 0.9 ** count


@pytest.mark.optax
def test_without_noise_matches_optax():
    optax = pytest.importorskip("optax")
    # Optax's state holds a JAX key: states are not compared (the counts are, below)
    assert_parity(fx.noisy_sgd(_sched, eta=0.0, gamma=0.3, key=5), optax.noisy_sgd(_sched, eta=0.0, gamma=0.3, key=5),
                  check_state=False)
    tx, otx = fx.add_noise(0.0, 0.55), optax.add_noise(0.0, 0.55, key=0)
    _, _, state = run_fx(tx, nested_params(), steps=3)
    _, _, ostate = run_optax(otx, nested_params(), steps=3)
    assert int(state.count) == int(ostate.count) == 3


@pytest.mark.optax
@pytest.mark.parametrize("target", ["parabola", "rosenbrock"])
def test_optimization_trajectory_matches_optax_without_noise(target):
    # Optax's alias_test.test_optimization entry (eta=1e-4 there; eta=0 here, the noise cannot match)
    pytest.importorskip("optax")
    ours, theirs = trajectories("noisy_sgd", {"learning_rate": 1e-3, "eta": 0.0, "key": 0}, target, complex_=False)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")


def _draws(tx, steps, n=N):
    g = {"w": torch.zeros(n)}
    state, out = tx.init(g), []
    for _ in range(steps):
        u, state = tx.update(g, state)
        out.append(u["w"])
    return out


@pytest.mark.parametrize("eta, gamma", [(0.3, 0.55), (0.01, 1.0)])
def test_noise_std_follows_the_schedule(eta, gamma):
    for t, x in enumerate(_draws(fx.add_noise(eta, gamma, key=1), steps=4), start=1):
        expected = math.sqrt(eta / t ** gamma)
        assert abs(x.std().item() / expected - 1) < 0.03, t
        assert abs(x.mean().item()) < 4 * expected / math.sqrt(N), t
        z = x / expected  # standard normal: its 4th moment is 3, and 95.4% lie within 2 sigma
        assert abs((z ** 4).mean().item() - 3) < 0.25, t
        assert abs((z.abs() < 2).float().mean().item() - 0.9545) < 0.01, t


@pytest.mark.optax
def test_noise_statistics_match_optax():
    import jax.numpy as jnp

    optax = pytest.importorskip("optax")
    otx = optax.add_noise(0.3, 0.55, key=314)
    state, zeros = otx.init(jnp.zeros(N)), jnp.zeros(N)
    for t, ours in enumerate(_draws(fx.add_noise(0.3, 0.55, key=314), steps=3), start=1):
        theirs, state = otx.update(zeros, state)
        # two independent samples of N draws: their stds agree to ~0.7%
        assert abs(ours.std().item() / float(jnp.std(theirs)) - 1) < 0.04, t


def test_variance_scaling_of_one_key():
    # Optax's _adding_test.test_add_noise_has_correct_variance_scaling: one key, the unit noise rescaled
    params = {"a": torch.zeros(3, 2), "b": [torch.zeros(4), torch.zeros(())]}
    noisy, unit = fx.add_noise(0.3, 0.55, key=314), fx.add_noise(1.0, 0.0, key=314)
    s, su = noisy.init(params), unit.init(params)
    for i in range(1, 11):
        u, s = noisy.update(params, s)
        uu, su = unit.update(params, su)
        scale = math.sqrt(0.3 / i ** 0.55)
        fx.testing.assert_trees_close(u, fx.tree.map(lambda x: x * scale, uu), rtol=1e-4, atol=1e-7)


def test_noise_is_a_function_of_key_count_and_position():
    a, b = _draws(fx.add_noise(1.0, 0.0, key=3), steps=2, n=1000), _draws(fx.add_noise(1.0, 0.0, key=3), 2, 1000)
    c = _draws(fx.add_noise(1.0, 0.0, key=torch.Generator().manual_seed(4)), steps=1, n=1000)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # same key: same noise
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], c[0])  # another step or key: other noise
    # a frozen leaf (None gradient) does not shift the noise of the others; leaves draw different noise
    tx = fx.add_noise(1.0, 0.0, key=3)
    g = {"a": torch.zeros(5), "b": torch.zeros(5), "c": torch.zeros(5)}
    full, _ = tx.update(g, tx.init(g))
    part, _ = tx.update({**g, "b": None}, tx.init(g))
    assert torch.equal(full["c"], part["c"]) and part["b"] is None
    assert not torch.equal(full["a"], full["b"])


def test_resume_continues_the_sequence():
    tx = fx.noisy_sgd(0.1, eta=0.5, key=7)
    params = {"w": torch.ones(6)}
    state = tx.init(params)
    straight = []
    for k in range(4):
        u, state = tx.update({"w": torch.full((6,), float(k))}, state, params)
        straight.append(u["w"])
        if k == 1:
            saved = fx.tree.clone(state)
    state = saved
    for k in (2, 3):
        u, state = fx.update_(tx, {"w": torch.full((6,), float(k))}, state, params)  # donated, same numbers
        assert torch.equal(u["w"], straight[k])


def test_under_vmap_members_draw_from_their_own_keys():
    tx = fx.add_noise(1.0, 0.0, key=0)
    g = {"w": torch.zeros(4, 8)}  # 4 members of 8 elements
    state = vmap(tx.init)(g)
    u, _ = vmap(tx.update)(g, state)
    assert all(torch.equal(u["w"][i], u["w"][0]) for i in range(4))  # one key: one noise, as with jax.vmap
    alone, _ = tx.update({"w": torch.zeros(8)}, tx.init({"w": torch.zeros(8)}))
    torch.testing.assert_close(u["w"][0], alone["w"])
    state = state._replace(rng_key=torch.arange(4))  # a key per member
    u, _ = vmap(tx.update)(g, state)
    assert len({tuple(x.tolist()) for x in u["w"]}) == 4


def test_pure_dtypes_and_none_leaves():
    tx = fx.add_noise(0.1, 0.55, key=0)
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)
    assert_dtypes(fx.noisy_sgd(0.1, key=0))


@pytest.mark.parametrize("build, error, message", [
    (lambda: fx.add_noise(-0.1, 0.55), ValueError, r"add_noise: eta=-0.1 must be >= 0"),
    (lambda: fx.noisy_sgd(0.1, gamma=-1.0), ValueError, r"noisy_sgd: gamma=-1.0 must be >= 0"),
    (lambda: fx.noisy_sgd(None), ValueError, "noisy_sgd: learning_rate=None"),
    (lambda: fx.add_noise(0.1, 0.55, key=1.5), TypeError, "add_noise: key must be an int"),
])
def test_errors_name_the_argument(build, error, message):
    with pytest.raises(error, match=message):
        build()
