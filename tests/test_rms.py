"""scale_by_rms, scale_by_stddev, scale_by_rss (fxtrain/transforms/_rms.py): Optax parity, dtypes, errors."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import nested_params
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, grads
from tests.cases.core import RMS_VARIANTS

TRANSFORMS = RMS_VARIANTS
CASES = [(name, kw) for name, variants in TRANSFORMS.items() for kw in variants.values()]
IDS = [f"{name}-{key}" for name, variants in TRANSFORMS.items() for key in variants]


@pytest.mark.optax
@pytest.mark.parametrize("name", TRANSFORMS)
def test_tensor_hyperparameters_match_optax_inject_hyperparams(name):
    optax = pytest.importorskip("optax")
    hp = {"eps": 1e-6, "initial_accumulator_value": 0.2} if name == "scale_by_rss" else \
        {"decay": 0.8, "eps": 1e-6, "initial_scale": 0.3}
    tx = fx.chain(getattr(fx, name)(**{k: torch.tensor(v) for k, v in hp.items()}), fx.scale(-0.01))
    otx = optax.chain(optax.inject_hyperparams(getattr(optax, name))(**hp), optax.scale(-0.01))
    assert_parity(tx, otx, check_state=False)


def test_rss_is_zero_where_nothing_accumulated():
    """Optax's where(s > 0, rsqrt(s + eps), 0): no 0/0 with eps=0 and a zero accumulator."""
    tx = fx.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
    g = {"w": torch.tensor([0.0, 2.0])}
    u, state = tx.update(g, tx.init(g))
    assert u["w"].tolist() == [0.0, 1.0]
    tx = fx.scale_by_rss(initial_accumulator_value=0.0, eps=torch.tensor(0.0))
    assert tx.update(g, tx.init(g))[0]["w"].tolist() == [0.0, 1.0]


def test_states_follow_optax_layout():
    p = {"w": torch.ones(2)}
    assert type(fx.scale_by_rms().init(p)) is fx.ScaleByRmsState
    assert fx.scale_by_rms(bias_correction=True).init(p)._fields == ("count", "nu")
    assert type(fx.scale_by_stddev().init(p)) is fx.ScaleByRStdDevState
    assert fx.scale_by_stddev(bias_correction=True).init(p)._fields == ("count", "mu", "nu")
    assert fx.scale_by_rss(initial_accumulator_value=0.5).init(p).sum_of_squares["w"].tolist() == [0.5, 0.5]
    assert fx.scale_by_rms(initial_scale=torch.tensor(2.0)).init(p).nu["w"].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_pure_dtypes_and_none_leaves(name, kwargs):
    tx = getattr(fx, name)(**kwargs)
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


@pytest.mark.parametrize("name,arg", [(n, a) for n in ("scale_by_rms", "scale_by_stddev")
                                      for a in ("decay", "eps", "initial_scale")]
                         + [("scale_by_rss", "initial_accumulator_value"), ("scale_by_rss", "eps")])
def test_negative_hyperparameter_names_it(name, arg):
    with pytest.raises(ValueError, match=rf"{name}: {arg}=-1.0 must be >= 0"):
        getattr(fx, name)(**{arg: -1.0})


@pytest.mark.parametrize("name", TRANSFORMS)
def test_updates_not_matching_state_names_the_path(name):
    tx = getattr(fx, name)()
    state = tx.init(nested_params())
    g = grads(nested_params(), 0)
    del g["dense"]["w"]
    with pytest.raises(ValueError, match=rf"{name}\(\): updates do not match the state: .* at 'dense"):
        tx.update(g, state)
