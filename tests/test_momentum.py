"""trace (fxtrain/transforms/_momentum.py): Optax parity, dtypes, errors."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import nested_params
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, grads
from tests.cases.core import TRACE_VARIANTS as VARIANTS


@pytest.mark.optax
@pytest.mark.parametrize("nesterov", [False, True])
def test_tensor_decay_matches_optax_inject_hyperparams(nesterov):
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.trace(torch.tensor(0.7), nesterov), fx.scale(-0.01))
    otx = optax.chain(optax.inject_hyperparams(optax.trace, static_args="nesterov")(0.7, nesterov), optax.scale(-0.01))
    assert_parity(tx, otx, check_state=False)


def test_donated_kernel_writes_into_the_gradient_buffers():
    params = nested_params()
    g = grads(params, 0)
    tx = fx.trace(0.9)
    u, state = fx.update_(tx, g, tx.init(params))
    assert all(a is b for a, b in zip(fx.tree.leaves(u), fx.tree.leaves(g)))
    assert not any(a is b for a, b in zip(fx.tree.leaves(u), fx.tree.leaves(state)))  # no aliasing


@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_pure_dtypes_and_none_leaves(kwargs):
    tx = fx.trace(**kwargs)
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(fx.trace(**{**kwargs, "accumulator_dtype": None}))
    assert_dtypes(fx.trace(**{**kwargs, "accumulator_dtype": torch.float32}), state_dtypes={"trace": torch.float32})


def test_negative_decay_names_it():
    with pytest.raises(ValueError, match=r"trace: decay=-0.9 must be >= 0"):
        fx.trace(-0.9)


def test_updates_not_matching_state_names_the_path():
    tx = fx.trace(0.9)
    state = tx.init({"a": torch.ones(1), "b": [torch.ones(2)]})
    with pytest.raises(ValueError, match=r"trace\(0\.9\): updates do not match the state: .* at 'b'"):
        tx.update({"a": torch.ones(1), "b": torch.ones(2)}, state)
