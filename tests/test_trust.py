"""scale_by_trust_ratio, fromage, lamb, lars (fxtrain/transforms/_trust.py): Optax parity, Optax's
test_optimization trajectories (complex64 too), per-leaf norms, dtypes, errors."""

import numpy as np
import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_pure
from tests.cases.scaling import trajectories


@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, target, complex_", [
    ("fromage", {"learning_rate": 5e-3}, "parabola", False),
    ("lamb", {"learning_rate": 1e-3}, "rosenbrock", False),
    ("lamb", {"learning_rate": 1e-3}, "parabola", True),
    ("lars", {"learning_rate": 1.0}, "rosenbrock", False),
    ("lars", {"learning_rate": 1.0}, "parabola", True),
])
def test_optimization_trajectory_matches_optax(name, kwargs, target, complex_):
    # Optax's alias_test.test_optimization (float32 and complex64), 50 steps against Optax's trajectory
    pytest.importorskip("optax")
    ours, theirs = trajectories(name, kwargs, target, complex_)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")


def test_scalers_case_finite_and_shaped():
    # Optax's transform_test.test_scalers for scale_by_trust_ratio
    params = (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    updates = (torch.tensor([500.0, 5.0]), torch.tensor([300.0, 3.0]))
    tx = fx.scale_by_trust_ratio()
    u, _ = tx.update(updates, tx.init(params), params)
    for a, p, g in zip(u, params, updates):
        assert a.shape == p.shape and torch.isfinite(a).all()
        torch.testing.assert_close(a.norm(), p.norm())  # the ratio sets the update's norm to the param's


def test_ratio_is_one_where_a_norm_is_zero():
    params = {"zero_param": torch.zeros(3), "zero_update": torch.ones(2)}
    updates = {"zero_param": torch.tensor([1.0, 2.0, 3.0]), "zero_update": torch.zeros(2)}
    tx = fx.scale_by_trust_ratio()
    for donate in (False, True):
        g = fx.tree.clone(updates)
        u, _ = fx.update_(tx, g, tx.init(params), params) if donate else tx.update(g, tx.init(params), params)
        assert u["zero_param"].tolist() == [1.0, 2.0, 3.0] and u["zero_update"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("build", [fx.scale_by_trust_ratio, lambda: fx.fromage(0.1), lambda: fx.lamb(0.1),
                                   lambda: fx.lars(0.1, weight_decay=0.1)],
                         ids=["scale_by_trust_ratio", "fromage", "lamb", "lars"])
def test_pure_dtypes_and_none_leaves(build):
    tx = build()
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


def test_trust_ratio_needs_params():
    tx = fx.scale_by_trust_ratio()
    with pytest.raises(ValueError, match="scale_by_trust_ratio needs the params"):
        tx.update({"w": torch.ones(1)}, tx.init(None))


@pytest.mark.parametrize("build, message", [
    (lambda: fx.scale_by_trust_ratio(min_norm=-1.0), r"scale_by_trust_ratio: min_norm=-1.0 must be >= 0"),
    (lambda: fx.fromage(None), "fromage: learning_rate=None"),
    (lambda: fx.lamb(0.1, b1=-0.5), r"lamb: b1=-0.5 must be >= 0"),
    (lambda: fx.lars(0.1, momentum=-0.5), r"lars: momentum=-0.5 must be >= 0"),
])
def test_errors_name_the_argument(build, message):
    with pytest.raises(ValueError, match=message):
        build()
