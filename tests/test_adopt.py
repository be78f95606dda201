"""scale_by_adopt and adopt (fxtrain/contrib/_adopt.py): Optax parity, first-step semantics, dtypes."""

import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure


@pytest.mark.optax
def test_bfloat16_momentum_matches_optax():
    optax = pytest.importorskip("optax")
    # Optax's state holds bfloat16: tests/_parity.py runs its update op by op (jitted, XLA would skip a
    # bfloat16 rounding of beta * mu that Optax's ops and fxtrain make).
    assert_parity(fx.chain(fx.contrib.scale_by_adopt(mu_dtype=torch.bfloat16, nesterov=True), fx.scale(-0.01)),
                  optax.chain(optax.contrib.scale_by_adopt(mu_dtype="bfloat16", nesterov=True), optax.scale(-0.01)),
                  steps=20, check_state=False)


@pytest.mark.optax
def test_adopt_with_schedule_matches_optax():
    optax = pytest.importorskip("optax")
    assert_parity(fx.contrib.adopt(fx.linear_schedule(0.1, 0.01, 10), nesterov=True),
                  optax.contrib.adopt(optax.linear_schedule(0.1, 0.01, 10), nesterov=True))


@pytest.mark.optax
def test_tensor_hyperparameters_match_optax_inject_hyperparams():
    optax = pytest.importorskip("optax")
    tx = fx.contrib.adopt(torch.tensor(0.01), b1=torch.tensor(0.8), b2=torch.tensor(0.95), eps=torch.tensor(1e-4))
    otx = optax.inject_hyperparams(optax.contrib.adopt, static_args=("clip_value_fn",))(
        0.01, b1=0.8, b2=0.95, eps=1e-4)
    assert_parity(tx, otx, check_state=False)


def test_first_step_only_fills_the_second_moment():
    """Optax's semantics: v_0 = g_0^2 and a zero first update (the clipping bound 0 ** 0.25 is 0)."""
    g = {"w": torch.tensor([3.0, -0.5])}
    tx = fx.contrib.scale_by_adopt()
    u, state = tx.update(g, tx.init(g))
    assert u["w"].tolist() == [0.0, 0.0]
    assert state.nu["w"].tolist() == [9.0, 0.25] and state.mu["w"].tolist() == [0.0, 0.0]
    u, state = tx.update(g, state)  # n = clip(g / |g|, -1, 1) = sign(g); m = 0.1 * n
    torch.testing.assert_close(u["w"], torch.tensor([0.1, -0.1]))


@pytest.mark.optax
def test_parabola_trajectory_matches_optax():
    """Optax's contrib test target (a parabola, learning rate 1e-2), 200 steps of the full optimizer."""
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp
    import numpy as np

    tx, otx = fx.contrib.adopt(1e-2), optax.contrib.adopt(1e-2)
    oupdate = jax.jit(otx.update)
    params = {"x": torch.tensor([-1.0, 10.0, 1.0])}
    oparams = {"x": jnp.asarray(params["x"].numpy())}
    target = torch.tensor([1.0, -1.0, 1.0])
    state, ostate = tx.init(params), otx.init(oparams)
    for _ in range(200):
        u, state = fx.update_(tx, {"x": 2 * (params["x"] - target)}, state, params)
        params = fx.apply_updates(params, u)
        ou, ostate = oupdate({"x": 2 * (oparams["x"] - jnp.asarray(target.numpy()))}, ostate, oparams)
        oparams = optax.apply_updates(oparams, ou)
    np.testing.assert_allclose(params["x"].numpy(), np.asarray(oparams["x"]), rtol=1e-5, atol=1e-5)
    assert (params["x"] - target).norm() < 10.0


@pytest.mark.parametrize("kwargs", [{}, {"nesterov": True, "use_clipping": False}], ids=["default", "nesterov"])
def test_pure_dtypes_and_none_leaves(kwargs):
    tx = fx.contrib.scale_by_adopt(**kwargs)
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)
    assert_dtypes(fx.contrib.scale_by_adopt(mu_dtype=torch.float32, **kwargs), state_dtypes={"mu": torch.float32})


@pytest.mark.parametrize("arg", ["b1", "b2", "eps"])
def test_negative_hyperparameter_names_it(arg):
    with pytest.raises(ValueError, match=rf"scale_by_adopt: {arg}=-0.5 must be >= 0"):
        fx.contrib.scale_by_adopt(**{arg: -0.5})


def test_adopt_names_itself():
    with pytest.raises(ValueError, match=r"^adopt: b2=-0.5 must be >= 0"):
        fx.contrib.adopt(0.1, b2=-0.5)


def test_adopt_refuses_no_learning_rate():
    with pytest.raises(ValueError, match="adopt: learning_rate=None"):
        fx.contrib.adopt(None)
