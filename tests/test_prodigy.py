"""prodigy (fxtrain/contrib/_prodigy.py): Optax parity, the distance estimate, dtypes, errors."""

import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure

@pytest.mark.optax
def test_schedule_matches_optax():
    optax = pytest.importorskip("optax")
    assert_parity(fx.contrib.prodigy(fx.linear_schedule(1.0, 0.0, 30), estim_lr0=1e-2),
                  optax.contrib.prodigy(optax.linear_schedule(1.0, 0.0, 30), estim_lr0=1e-2))


@pytest.mark.optax
def test_tensor_hyperparameters_match_optax_inject_hyperparams():
    optax = pytest.importorskip("optax")
    tx = fx.contrib.prodigy(torch.tensor(0.5), estim_lr0=1e-2, weight_decay=torch.tensor(0.1))
    otx = optax.inject_hyperparams(optax.contrib.prodigy)(0.5, estim_lr0=1e-2, weight_decay=0.1)
    assert_parity(tx, otx, check_state=False)


@pytest.mark.optax
def test_parabola_trajectory_matches_optax():
    """Optax's contrib test target (a parabola, learning rate 0.1): 100 steps, and the estimate grows."""
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp
    import numpy as np

    tx, otx = fx.contrib.prodigy(0.1), optax.contrib.prodigy(0.1)
    oupdate = jax.jit(otx.update)
    target = torch.tensor([1.0, -1.0, 1.0])
    params = {"x": torch.tensor([-1.0, 10.0, 1.0])}
    oparams = {"x": jnp.asarray(params["x"].numpy())}
    state, ostate = tx.init(params), otx.init(oparams)
    for _ in range(100):
        u, state = fx.update_(tx, {"x": 2 * (params["x"] - target)}, state, params)
        params = fx.apply_updates(params, u)
        ou, ostate = oupdate({"x": 2 * (oparams["x"] - jnp.asarray(target.numpy()))}, ostate, oparams)
        oparams = optax.apply_updates(oparams, ou)
    np.testing.assert_allclose(params["x"].numpy(), np.asarray(oparams["x"]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(state.estim_lr), float(ostate.estim_lr), rtol=1e-4)
    assert float(state.estim_lr) > 1e-6  # grew from estim_lr0


def test_params0_is_a_copy():
    params = {"w": torch.ones(3)}
    tx = fx.contrib.prodigy()
    state = tx.init(params)
    params["w"].add_(1.0)  # an in-place step on the params must not move x0
    assert state.params0["w"].tolist() == [1.0, 1.0, 1.0]


def test_estimate_never_decreases():
    tx = fx.contrib.prodigy(estim_lr0=1e-3)
    params = {"w": torch.tensor([3.0, -2.0])}
    state, last = tx.init(params), 1e-3
    for k in range(30):
        g = {"w": 2 * params["w"] + (-1) ** k}
        u, state = tx.update(g, state, params)
        params = fx.apply_updates(params, u)
        assert float(state.estim_lr) >= last
        last = float(state.estim_lr)


def test_pure_dtypes_and_none_leaves():
    tx = fx.contrib.prodigy(weight_decay=0.1)
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


def test_needs_params():
    tx = fx.contrib.prodigy()
    g = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"^prodigy\(\): prodigy needs the params: call update\(updates, state, params\)$"):
        tx.update(g, tx.init(g))


def test_refused_by_sharded_apply():
    with pytest.raises(ValueError, match="prodigy"):
        fx.sharded_apply(fx.contrib.prodigy())


@pytest.mark.parametrize("kwargs,msg", [({"weight_decay": -0.5}, "weight_decay=-0.5 must be >= 0"),
                                        ({"betas": (0.9,)}, r"betas=\(0.9,\) must be a pair")])
def test_bad_arguments_name_them(kwargs, msg):
    with pytest.raises(ValueError, match=f"prodigy: {msg}"):
        fx.contrib.prodigy(**kwargs)
