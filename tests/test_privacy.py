"""dpsgd and differentially_private_aggregate (fxtrain/contrib/_privacy.py): Optax's privacy cases, exact
parity with noise_multiplier=0, noise statistics, reproducibility from the state."""

import warnings

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp

C = fx.contrib
BATCH = 8


def _params():
    return {"key_a": (torch.zeros(2, 3, 4), torch.zeros(())), "key_b": torch.zeros(6, 7)}


def _per_example():
    # Example i's gradients are full of i's (0 included: no division by a zero norm).
    a = torch.arange(BATCH, dtype=torch.float32)
    return fx.tree.map(lambda p: a.reshape(-1, *[1] * p.ndim) * torch.ones(BATCH, *p.shape), _params())


def test_no_privacy_is_the_mean():  # Optax's test_no_privacy
    tx = C.differentially_private_aggregate(l2_norm_clip=torch.finfo(torch.float32).max, noise_multiplier=0.0, key=0)
    grads = _per_example()
    state = tx.init(_params())
    for _ in range(3):
        u, state = tx.update(grads, state)
        assert_trees_close(u, fx.tree.map(lambda g: g.mean(0), grads))
    assert state.rng_key.tolist() == [0, 3]


@pytest.mark.parametrize("l2_norm_clip", [0.5, 10.0, 20.0, 40.0, 80.0])
def test_clipping_norm(l2_norm_clip):  # Optax's test_clipping_norm
    tx = C.differentially_private_aggregate(l2_norm_clip=l2_norm_clip, noise_multiplier=0.0, key=42)
    grads = _per_example()
    norms = torch.stack([g.reshape(BATCH, -1).norm(dim=1) for g in fx.tree.leaves(grads)]).norm(dim=0)
    expected = (torch.arange(BATCH) / torch.clamp(norms / l2_norm_clip, min=1.0)).mean()
    state = tx.init(_params())
    for _ in range(3):
        u, state = tx.update(grads, state, _params())
        assert_trees_close(u, fx.tree.map(lambda p: torch.full_like(p, float(expected)), _params()), rtol=2e-7)


@pytest.mark.parametrize("l2_norm_clip,noise_multiplier", [(3.0, 2.0), (1.0, 5.0), (100.0, 4.0), (1.0, 90.0)])
def test_noise_standard_deviation(l2_norm_clip, noise_multiplier):  # Optax's test_noise_multiplier
    tx = C.differentially_private_aggregate(l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier, key=1337)
    expected = l2_norm_clip * noise_multiplier
    grads, state = [torch.ones(1, 100, 100)], tx.init(None)  # a batch of 1
    for _ in range(3):
        (u,), state = tx.update(grads, state)
        assert abs(float(u.std()) - expected) < 0.1 * expected


def test_aggregated_updates_as_input_fails():  # Optax's test_aggregated_updates_as_input_fails
    tx = C.differentially_private_aggregate(l2_norm_clip=0.1, noise_multiplier=1.1, key=2021)
    mean = fx.tree.map(lambda g: g.mean(0), _per_example())
    with pytest.raises(ValueError, match=r"^differentially_private_aggregate\(0.1, 1.1, key=2021\): expects "
                                         "per-example gradients"):
        tx.update(mean, tx.init(_params()), _params())


@pytest.mark.optax
def test_noise_statistics_match_optax():
    """Not Optax's draws (JAX's PRNG), but the same distribution: mean 0, std l2_norm_clip * noise_multiplier / B,
    Gaussian tails, fresh noise every step."""
    optax = pytest.importorskip("optax")
    grads = [torch.zeros(4, 100, 250)]  # zero gradients: the updates are the noise / 4
    ours = C.differentially_private_aggregate(2.0, 1.5, key=7)
    theirs = optax.contrib.differentially_private_aggregate(2.0, 1.5, key=7)
    s, os_ = ours.init(None), theirs.init(None)
    draws, odraws = [], []
    for _ in range(2):
        (u,), s = ours.update(grads, s)
        (ou,), os_ = theirs.update(to_jnp(grads), os_)
        draws.append(u.flatten().numpy()), odraws.append(np.asarray(ou).ravel())
    assert np.abs(np.corrcoef(draws[0], draws[1])[0, 1]) < 0.01  # a new draw every step
    x, ox = np.concatenate(draws), np.concatenate(odraws)
    for stat in (lambda v: v.mean(), lambda v: v.std(), lambda v: np.mean(np.abs(v) > 2 * 0.75)):
        assert abs(stat(x) - stat(ox)) < 0.01, (stat(x), stat(ox))
    assert abs(x.std() - 2.0 * 1.5 / 4) < 0.005
    assert abs(np.mean((x / x.std()) ** 4) - 3.0) < 0.06  # Gaussian kurtosis (its standard error here: 0.012)


def _grads(params, step, jax_params=None):
    """Per-example gradients of batch 3 that depend on the params: ``(0.5 + i) * p + noise``."""
    noise = [nested_params(seed=100 * step + i) for i in range(3)]
    if jax_params is None:
        return fx.tree.map(lambda p, *n: torch.stack([(0.5 + i) * p + x for i, x in enumerate(n)]), params, *noise)
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda p, *n: jnp.stack([(0.5 + i) * p + x for i, x in enumerate(n)]), jax_params,
                        *[to_jnp(x) for x in noise])


DPSGD = {
    "plain": {"learning_rate": 0.1, "l2_norm_clip": 1.0},
    "momentum": {"learning_rate": 0.05, "l2_norm_clip": 3.0, "momentum": 0.9, "nesterov": True},
}


def _optax_dpsgd(**kwargs):
    """Optax's dpsgd with ``key=``; an Optax from before ``key`` (0.2.8: ``seed``) gets it as its ``seed``."""
    import inspect

    import optax

    dpsgd = optax.contrib.dpsgd
    if "key" in inspect.signature(dpsgd).parameters:
        return dpsgd(**kwargs)
    kwargs["seed"] = kwargs.pop("key")
    with pytest.warns(DeprecationWarning):  # that Optax's dpsgd passes its seed on as a deprecated seed=
        return dpsgd(**kwargs)


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", DPSGD.values(), ids=DPSGD.keys())
def test_dpsgd_without_noise_matches_optax(kwargs):
    optax = pytest.importorskip("optax")
    tx = C.dpsgd(noise_multiplier=0.0, key=3, **kwargs)
    otx = _optax_dpsgd(noise_multiplier=0.0, key=3, **kwargs)
    params = nested_params()
    jparams = to_jnp(params)
    state, ostate = tx.init(params), otx.init(jparams)
    for step in range(20):
        g = _grads(params, step)
        u, state = fx.update_(tx, g, state, params) if step % 2 else tx.update(g, state, params)
        ou, ostate = otx.update(_grads(None, step, jparams), ostate, jparams)
        assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
        params, jparams = fx.apply_updates(params, u), optax.apply_updates(jparams, ou)
    assert_trees_close(params, from_jnp(jparams), rtol=1e-5, atol=1e-6)


def _run(tx, steps, state=None, start=0):
    params = nested_params()
    state = tx.init(params) if state is None else state
    out = []
    for step in range(start, start + steps):
        u, state = tx.update(_grads(params, step), state, params)
        out.append(u)
    return out, state


def test_noise_is_a_function_of_the_state():
    tx = C.dpsgd(0.1, 1.0, 1.0, key=5, momentum=0.5)
    full, _ = _run(tx, 4)
    first, mid = _run(tx, 2)
    rest, _ = _run(tx, 2, state=fx.tree.clone(mid), start=2)  # resumed from a saved state
    assert_trees_close(first + rest, full, rtol=0, atol=0)
    other, _ = _run(C.dpsgd(0.1, 1.0, 1.0, key=6, momentum=0.5), 1)
    assert not torch.equal(other[0]["dense"]["w"], full[0]["dense"]["w"])
    assert not torch.equal(full[1]["dense"]["w"] - full[0]["dense"]["w"], torch.zeros(()))


def test_donated_equals_pure_and_none_leaves_pass():
    tx = C.differentially_private_aggregate(1.0, 2.0, key=torch.Generator().manual_seed(11))
    params = nested_params()
    g = _grads(params, 0)
    g["dense"]["b"] = None
    state = tx.init(params)
    u, s = tx.update(g, state, params)
    du, ds = fx.update_(tx, fx.tree.clone(g), fx.tree.clone(state), params)
    assert u["dense"]["b"] is None
    assert_trees_close(du, u, rtol=0, atol=0)
    assert torch.equal(ds.rng_key, s.rng_key) and s.rng_key.tolist() == [11, 1]


def test_bfloat16_gradients_give_bfloat16_updates():
    tx = C.dpsgd(0.1, 1.0, 1.0, key=0)
    g = fx.tree.map(lambda x: x.to(torch.bfloat16), _grads(nested_params(), 0))
    u, _ = tx.update(g, tx.init(g))
    assert all(x.dtype == torch.bfloat16 and torch.isfinite(x).all() for x in fx.tree.leaves(u))


def test_vmap_members_with_their_own_keys_draw_their_own_noise():
    tx = C.differentially_private_aggregate(1.0, 1.0, key=0)
    g = torch.ones(2, 3, 5)  # 2 members, 3 examples each
    keys = torch.tensor([[0, 0], [9, 0]])
    u, s = torch.func.vmap(lambda g, k: tx.update([g], C.DifferentiallyPrivateAggregateState(k)))(g, keys)
    assert_trees_close(u[0][0], tx.update([g[0]], tx.init(None))[0][0], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(u[0][0], u[0][1])
    assert s.rng_key[:, 1].tolist() == [1, 1]


def test_grad_flows_through_the_clipping():
    tx = C.dpsgd(0.1, 1.0, 0.5, key=0)
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (u,), _ = tx.update([g], tx.init([torch.zeros(3)]))
    (gg,) = torch.autograd.grad(u.sum(), [g])
    assert torch.isfinite(gg).all() and gg.abs().sum() > 0


def test_keys_and_errors():
    with pytest.warns(UserWarning, match="no key given, using key=0"):
        C.differentially_private_aggregate(1.0, 1.0)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pass one of key=1 or seed=2"):
        C.differentially_private_aggregate(1.0, 1.0, key=1, seed=2)
    with pytest.raises(ValueError, match=r"differentially_private_aggregate: noise_multiplier=-1.0 must be >= 0"):
        C.differentially_private_aggregate(1.0, -1.0, key=0)
    with pytest.raises(ValueError, match=r"dpsgd: learning_rate=-0.1 must be >= 0"):
        C.dpsgd(-0.1, 1.0, 1.0, key=0)
    assert repr(C.dpsgd(0.1, 1.0, 1.1, key=3, momentum=0.9)) == "dpsgd(0.1, 1.0, 1.1, key=3, momentum=0.9)"


def test_dpsgd_key_as_current_optax_and_seed_deprecated():
    """dpsgd(learning_rate, l2_norm_clip, noise_multiplier, key=None, momentum, nesterov, *, seed) as current
    Optax: key is the fourth argument (fxtrain's old seed position: positional calls are unchanged);
    seed= still works, deprecated (a DeprecationWarning, as Optax), and draws the same noise as key=."""
    import inspect

    assert list(inspect.signature(C.dpsgd).parameters)[3] == "key"
    by_key, _ = _run(C.dpsgd(0.1, 1.0, 1.0, key=5), 2)
    by_position, _ = _run(C.dpsgd(0.1, 1.0, 1.0, 5), 2)
    with pytest.warns(DeprecationWarning, match='dpsgd: "seed" is deprecated'):
        tx = C.dpsgd(0.1, 1.0, 1.0, seed=5)
    by_seed, _ = _run(tx, 2)
    assert_trees_close(by_position, by_key, rtol=0, atol=0)
    assert_trees_close(by_seed, by_key, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="dpsgd: pass one of key=1 or seed=2"):
        C.dpsgd(0.1, 1.0, 1.0, key=1, seed=2)
    with pytest.warns(UserWarning, match="dpsgd: no key given, using key=0"):
        C.dpsgd(0.1, 1.0, 1.0)


@pytest.mark.optax
def test_inject_hyperparams_dpsgd_matches_optax():
    """inject_hyperparams(dpsgd) with an int key (an int32 hyperparameter tensor there; it failed: the key had
    to be a Python int): the same noise as dpsgd(key=) itself, and without noise Optax's numbers under
    optax.inject_hyperparams(dpsgd)."""
    optax = pytest.importorskip("optax")
    import inspect

    tx = fx.inject_hyperparams(C.dpsgd)(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, key=5)
    ours, _ = _run(tx, 3)
    plain, _ = _run(C.dpsgd(0.1, 1.0, 1.0, key=5), 3)
    assert_trees_close(ours, plain, rtol=0, atol=0)
    name = "key" if "key" in inspect.signature(optax.contrib.dpsgd).parameters else "seed"
    tx = fx.inject_hyperparams(C.dpsgd)(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.0, key=5,
                                        momentum=0.5)
    otx = optax.inject_hyperparams(optax.contrib.dpsgd)(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.0,
                                                        momentum=0.5, **{name: 5})
    params = nested_params()
    jparams = to_jnp(params)
    with warnings.catch_warnings():  # an Optax from before key= warns about its own seed= at every update
        warnings.simplefilter("ignore", DeprecationWarning)
        state, ostate = tx.init(params), otx.init(jparams)
        for step in range(3):
            u, state = tx.update(_grads(params, step), state, params)
            ou, ostate = otx.update(_grads(None, step, jparams), ostate, jparams)
            assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
    assert int(state.hyperparams["key"]) == 5 and state.hyperparams["key"].dtype == torch.int32
