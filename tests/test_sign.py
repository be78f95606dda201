"""scale_by_sign, sign_sgd, signum, scale_by_rprop, rprop (fxtrain/transforms/_sign.py): Optax parity, Optax's
test_optimization trajectories, dtypes, errors."""

import numpy as np
import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_pure
from tests.cases.scaling import trajectories


@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, target", [
    ("rprop", {"learning_rate": 1e-1}, "parabola"), ("rprop", {"learning_rate": 1e-1}, "rosenbrock"),
    ("sign_sgd", {"learning_rate": 1e-1}, "parabola"), ("signum", {"learning_rate": 1e-2}, "parabola"),
])
def test_optimization_trajectory_matches_optax(name, kwargs, target):
    # Optax's alias_test.test_optimization (sign_sgd and signum skip Rosenbrock there too), 50 steps
    pytest.importorskip("optax")
    ours, theirs = trajectories(name, kwargs, target, complex_=False)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")


def test_sign_values():
    tx = fx.scale_by_sign()
    u, _ = tx.update({"w": torch.tensor([0.3, -2.0, 0.0, -0.0])}, tx.init(None))
    assert u["w"].tolist() == [1.0, -1.0, 0.0, 0.0]


def test_rprop_step_sizes_follow_sign_changes():
    # the update applied at step t is the step stored at t - 1 (Optax's order); 0 where the sign flipped
    tx = fx.scale_by_rprop(1.0, eta_minus=0.5, eta_plus=2.0, min_step_size=0.1, max_step_size=3.0)
    state = tx.init(torch.zeros(2))
    seen = []
    for g in ([1.0, 1.0], [1.0, -1.0], [1.0, -1.0], [1.0, 1.0]):
        u, state = tx.update(torch.tensor(g), state)
        seen.append((u.tolist(), state.step_sizes.tolist(), state.prev_updates.tolist()))
    assert seen == [
        ([0.0, 0.0], [1.0, 1.0], [1.0, 1.0]),
        ([1.0, 0.0], [2.0, 0.5], [2.0, 0.0]),    # kept sign: x2; flipped: x0.5, no step
        ([2.0, 0.0], [3.0, 0.5], [3.0, -0.5]),   # clipped at 3; after a zero step: size kept
        ([3.0, 0.0], [3.0, 0.25], [3.0, 0.0]),    # flipped again: the stored -0.5 is dropped
    ]


@pytest.mark.parametrize("build", [fx.scale_by_sign, lambda: fx.signum(0.1), lambda: fx.scale_by_rprop(0.1)],
                         ids=["scale_by_sign", "signum", "scale_by_rprop"])
def test_pure_dtypes_and_none_leaves(build):
    tx = build()
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


def test_signum_float32_accumulator_with_bfloat16_params():
    assert_dtypes(fx.signum(0.1, accumulator_dtype="float32"), state_dtypes={"ema": torch.float32})


@pytest.mark.parametrize("build, message", [
    (lambda: fx.sign_sgd(None), "sign_sgd: learning_rate=None"),
    (lambda: fx.signum(0.1, beta=-0.5), r"signum: beta=-0.5 must be >= 0"),
    (lambda: fx.scale_by_rprop(0.1, eta_plus=-1.0), r"scale_by_rprop: eta_plus=-1.0 must be >= 0"),
    (lambda: fx.rprop(-0.1), r"rprop: learning_rate=-0.1 must be >= 0"),
])
def test_errors_name_the_argument(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("factory", [fx.rprop, fx.scale_by_rprop])
def test_rprop_refuses_a_schedule_at_construction(factory):
    """Optax's rprop takes a float (the initial step sizes): a schedule was accepted and failed at the first
    update; it is refused when built, naming the argument. inject_hyperparams still schedules it (its
    value at each step is a tensor), as in Optax."""
    with pytest.raises(ValueError, match=r"^(scale_by_)?rprop: learning_rate must be a number or a 0-dim tensor"):
        factory(learning_rate=fx.linear_schedule(0.1, 0.01, 10))
    tx = fx.inject_hyperparams(factory)(learning_rate=fx.linear_schedule(0.1, 0.01, 10))
    params = {"w": torch.tensor([1.0, -2.0])}
    u, _ = tx.update({"w": torch.tensor([1.0, 1.0])}, tx.init(params), params)
    assert bool(torch.isfinite(u["w"]).all())
