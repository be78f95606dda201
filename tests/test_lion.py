"""scale_by_lion (fxtrain/transforms/_lion.py): Optax parity, dtypes, errors."""

import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure
from tests.cases.core import LION_VARIANTS as VARIANTS
from tests.cases.core import lion_kwargs


@pytest.mark.optax
def test_tensor_hyperparameters_match_optax_inject_hyperparams():
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.scale_by_lion(b1=torch.tensor(0.8), b2=torch.tensor(0.95)), fx.scale(-0.01))
    otx = optax.chain(optax.inject_hyperparams(optax.scale_by_lion)(b1=0.8, b2=0.95), optax.scale(-0.01))
    assert_parity(tx, otx, check_state=False)


def test_update_is_a_sign():
    g = {"w": torch.tensor([0.2, -7.0, 0.0])}
    tx = fx.scale_by_lion()
    u, state = tx.update(g, tx.init(g))
    assert u["w"].tolist() == [1.0, -1.0, 0.0]
    assert int(state.count) == 1


@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_pure_dtypes_and_none_leaves(kwargs):
    tx = fx.scale_by_lion(**lion_kwargs(kwargs))
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(fx.scale_by_lion(**{**lion_kwargs(kwargs), "mu_dtype": None}))
    assert_dtypes(fx.scale_by_lion(**{**lion_kwargs(kwargs), "mu_dtype": torch.float32}), state_dtypes={"mu": torch.float32})


@pytest.mark.parametrize("arg", ["b1", "b2"])
def test_negative_hyperparameter_names_it(arg):
    with pytest.raises(ValueError, match=rf"scale_by_lion: {arg}=-0.5 must be >= 0"):
        fx.scale_by_lion(**{arg: -0.5})


def test_unknown_mode():
    with pytest.raises(ValueError, match="scale_by_lion: mode='soft' must be one of"):
        fx.scale_by_lion(mode="soft")
