"""AdEMAMix and Simplified AdEMAMix (fxtrain/contrib/_ademamix.py): Optax parity, dtypes, errors."""

import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure

ADEMAMIX = {
    "default": {},
    "betas": {"b1": 0.5, "b2": 0.9, "b3": 0.99, "alpha": 2.0, "eps": 1e-3, "eps_root": 1e-6},
}
SIMPLIFIED = {
    "default": {},
    "alpha": {"b1": 0.9, "b2": 0.99, "alpha": 3.0, "eps": 1e-3, "eps_root": 1e-6},
}


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", ADEMAMIX.values(), ids=ADEMAMIX.keys())
def test_scale_by_ademamix_matches_optax(kwargs):
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.contrib.scale_by_ademamix(**kwargs), fx.scale(-0.01)),
                  optax.chain(optax.contrib.scale_by_ademamix(**kwargs), optax.scale(-0.01)))


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", SIMPLIFIED.values(), ids=SIMPLIFIED.keys())
def test_scale_by_simplified_ademamix_matches_optax(kwargs):
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.contrib.scale_by_simplified_ademamix(**kwargs), fx.scale(-0.01)),
                  optax.chain(optax.contrib.scale_by_simplified_ademamix(**kwargs), optax.scale(-0.01)))


@pytest.mark.optax
def test_ademamix_with_schedules_and_weight_decay_matches_optax():
    """b3 and alpha warm up along schedules of count_m2 (the paper's recipe); masked weight decay."""
    optax = pytest.importorskip("optax")
    mask = {"dense": {"w": True, "b": False}, "blocks": [True, (False, True)], "scalar": False}
    tx = fx.contrib.ademamix(fx.cosine_decay_schedule(1e-2, 20), b3=fx.linear_schedule(0.9, 0.999, 10),
                             alpha=fx.linear_schedule(0.0, 5.0, 10), weight_decay=0.1, mask=mask)
    otx = optax.contrib.ademamix(optax.cosine_decay_schedule(1e-2, 20), b3=optax.linear_schedule(0.9, 0.999, 10),
                                 alpha=optax.linear_schedule(0.0, 5.0, 10), weight_decay=0.1, mask=mask)
    assert_parity(tx, otx)


@pytest.mark.optax
def test_simplified_ademamix_with_schedule_and_weight_decay_matches_optax():
    optax = pytest.importorskip("optax")
    assert_parity(fx.contrib.simplified_ademamix(1e-2, alpha=fx.linear_schedule(0.0, 2.0, 10), weight_decay=0.1),
                  optax.contrib.simplified_ademamix(1e-2, alpha=optax.linear_schedule(0.0, 2.0, 10), weight_decay=0.1))


@pytest.mark.optax
def test_tensor_hyperparameters_match_optax_inject_hyperparams():
    optax = pytest.importorskip("optax")
    tx = fx.contrib.ademamix(torch.tensor(1e-2), b1=torch.tensor(0.8), b3=torch.tensor(0.99),
                             alpha=torch.tensor(3.0), weight_decay=torch.tensor(0.1))
    otx = optax.inject_hyperparams(optax.contrib.ademamix)(1e-2, b1=0.8, b3=0.99, alpha=3.0, weight_decay=0.1)
    assert_parity(tx, otx, check_state=False)
    tx = fx.contrib.simplified_ademamix(torch.tensor(1e-2), b1=torch.tensor(0.9), alpha=torch.tensor(2.0))
    otx = optax.inject_hyperparams(optax.contrib.simplified_ademamix)(1e-2, b1=0.9, alpha=2.0)
    assert_parity(tx, otx, check_state=False)


def test_mu_dtype_keeps_the_state_in_it():
    """Optax's moments take the gradients' dtype after one update; fxtrain keeps them in mu_dtype."""
    tx = fx.contrib.scale_by_ademamix(mu_dtype=torch.bfloat16)
    assert_dtypes(tx, torch.float32, state_dtypes={"m1": torch.bfloat16, "m2": torch.bfloat16,
                                                   "nu": torch.bfloat16})


def test_first_update_of_ademamix():
    """Step 1: the fast EMA debiased is g, the slow one (1 - b3) g, the denominator |g|."""
    g = {"w": torch.tensor([4.0, -0.5])}
    u, state = fx.contrib.scale_by_ademamix(b3=0.9, alpha=2.0, eps=0.0).update(
        g, fx.contrib.scale_by_ademamix(b3=0.9).init(g))
    torch.testing.assert_close(u["w"], torch.tensor([1.0 + 2.0 * 0.1, -(1.0 + 2.0 * 0.1)]))
    assert int(state.count) == int(state.count_m2) == 1


@pytest.mark.parametrize("make", [fx.contrib.scale_by_ademamix, fx.contrib.scale_by_simplified_ademamix],
                         ids=["ademamix", "simplified"])
def test_pure_dtypes_and_none_leaves(make):
    tx = make(alpha=2.0)
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


@pytest.mark.parametrize("make,arg", [(fx.contrib.scale_by_ademamix, "b3"), (fx.contrib.scale_by_ademamix, "alpha"),
                                      (fx.contrib.scale_by_simplified_ademamix, "b1")])
def test_negative_hyperparameter_names_it(make, arg):
    with pytest.raises(ValueError, match=rf"^{make.__name__}: {arg}=-0.5 must be >= 0"):
        make(**{arg: -0.5})


@pytest.mark.parametrize("make", [fx.contrib.ademamix, fx.contrib.simplified_ademamix])
def test_optimizers_name_themselves(make):
    with pytest.raises(ValueError, match=rf"^{make.__name__}: eps=-0.5 must be >= 0"):
        make(0.1, eps=-0.5)
    with pytest.raises(ValueError, match=rf"^{make.__name__}: learning_rate=None"):
        make(None)
