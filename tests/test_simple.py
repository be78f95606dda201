"""fxtrain/transforms/_simple.py: ema, zero_nans, set_to_zero, stateless_with_tree_map.

Optax's cases ported here (inputs and expected numbers): transforms/_accumulation_test.py (``test_ema``,
``test_ema_debias``), transforms/_constraining_test.py (``test_zero_nans``), _src/base_test.py
(``test_set_to_zero_*``, ``test_stateless_with_tree_map*``, ``test_init_returns_emptystate``).
"""

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, nested_params
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure


def _decayed(g, p):
    return g + 0.1 * p  # torch and jax arrays alike


def _doubled(g, p):
    del p
    return g * 2.0


@pytest.mark.optax
def test_ema_tensor_decay_matches_optax_inject_hyperparams():
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.ema(torch.tensor(0.8)), fx.scale(-0.1)),
                  optax.chain(optax.inject_hyperparams(optax.ema)(decay=0.8), optax.scale(-0.1)), check_state=False)


# --- Optax's own cases ----------------------------------------------------------------------------

def test_ema_optax_case():
    values, d = torch.tensor([5.0, 7.0]), 0.9
    tx = fx.ema(decay=d, debias=False)
    state = tx.init(values[0])
    mean, state = tx.update(values[0], state)
    np.testing.assert_allclose(mean.item(), (1 - d) * 5.0, atol=1e-4)
    mean, _ = tx.update(values[1], state)
    np.testing.assert_allclose(mean.item(), (1 - d) * (7.0 + d * 5.0), atol=1e-2)


def test_ema_debias_optax_case():
    values, d = torch.tensor([5.0, 7.0]), 0.9
    tx = fx.ema(decay=d)
    state = tx.init(values[0])
    mean, state = tx.update(values[0], state)
    np.testing.assert_allclose(mean.item(), 5.0, atol=1e-4)
    mean, state = tx.update(values[1], state)
    np.testing.assert_allclose(mean.item(), ((1 - d) * 7.0 + d * (1 - d) * 5.0) / (1 - d ** 2), atol=1e-2)
    np.testing.assert_allclose(state.ema.item(), (1 - d) * 7.0 + d * (1 - d) * 5.0, atol=1e-2)  # not debiased


def test_zero_nans_optax_case():
    nan, inf = float("nan"), float("inf")
    params = (torch.zeros(3), torch.zeros(3), torch.zeros(3))
    tx = fx.zero_nans()
    state = tx.init(params)
    assert [bool(x) for x in state.found_nan] == [False] * 3
    steps = [  # (grads, expected updates, expected found_nan)
        ((torch.ones(3), torch.tensor([1.0, nan, nan]), torch.tensor([nan, 1.0, 1.0])),
         ([1.0] * 3, [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]), [False, True, True]),
        ((torch.ones(3), torch.tensor([1.0, nan, nan]), torch.tensor([inf, 1.0, 1.0])),
         ([1.0] * 3, [1.0, 0.0, 0.0], [inf, 1.0, 1.0]), [False, True, False]),
        ((torch.ones(3), torch.ones(3), torch.ones(3)), ([1.0] * 3,) * 3, [False] * 3),
    ]
    donated_state = tx.init(params)
    for grads, expected, found in steps:
        updates, state = tx.update(grads, state)
        assert [u.tolist() for u in updates] == list(expected)
        assert [bool(x) for x in state.found_nan] == found
        updates, donated_state = fx.update_(tx, fx.tree.clone(grads), donated_state)
        assert [u.tolist() for u in updates] == list(expected)
        assert [bool(x) for x in donated_state.found_nan] == found


def test_set_to_zero_optax_case():
    grads = ({"a": torch.ones(3, 4), "b": torch.tensor(1.0)}, torch.ones(1, 2, 3))
    tx = fx.set_to_zero()
    assert tx.init(None) == fx.EmptyState()
    updates, state = tx.update(grads, fx.EmptyState())
    assert_trees_close(updates, ({"a": torch.zeros(3, 4), "b": torch.tensor(0.0)}, torch.zeros(1, 2, 3)), rtol=0, atol=0)
    assert state == fx.EmptyState()
    nan = torch.tensor([float("nan"), float("inf")])
    assert fx.update_(tx, nan, fx.EmptyState())[0].tolist() == [0.0, 0.0]  # 0 * nan would not be


def test_stateless_with_tree_map_optax_cases():
    params = {"a": torch.zeros(1, 2), "b": torch.ones(1)}
    updates = {"a": torch.ones(1, 2), "b": torch.full((1,), 2.0)}
    tx = fx.stateless_with_tree_map(_decayed)
    assert isinstance(tx.init(None), fx.EmptyState)
    new, _ = tx.update(updates, tx.init(params), params)
    assert_trees_close(new, {"a": torch.ones(1, 2), "b": torch.tensor([2.1])})
    tx = fx.stateless_with_tree_map(_doubled)
    new, _ = tx.update({"linear": torch.full((5, 3), 3.0)}, tx.init(None))
    assert_trees_close(new, {"linear": torch.full((5, 3), 6.0)}, rtol=0, atol=0)
    assert repr(tx) == "stateless_with_tree_map(_doubled)"


# --- purity, dtypes, None leaves ------------------------------------------------------------------

@pytest.mark.parametrize("build", [lambda: fx.ema(0.9), lambda: fx.ema(0.9, debias=False), fx.zero_nans,
                                   fx.set_to_zero, lambda: fx.stateless_with_tree_map(_decayed)],
                         ids=["ema", "ema_biased", "zero_nans", "set_to_zero", "stateless_with_tree_map"])
def test_pure_dtypes_and_none_leaves(build):
    assert_pure(build())
    assert_none_passthrough(build())
    assert_dtypes(build())


def test_ema_accumulator_dtype_keeps_the_state_dtype_and_the_updates_dtype():
    assert_dtypes(fx.ema(0.9, accumulator_dtype=torch.float32), state_dtypes={"ema": torch.float32})
    tx = fx.ema(0.9, accumulator_dtype=torch.bfloat16)
    params = nested_params()
    u, state = tx.update(params, tx.init(params))
    assert all(x.dtype == torch.bfloat16 for x in fx.tree.leaves(state.ema))
    assert all(x.dtype == torch.float32 for x in fx.tree.leaves(u))
    # debiased first update: the float32 average over (1 - 0.9), i.e. the gradient itself to float32 rounding
    assert_trees_close(u, params, rtol=1e-6, atol=1e-6)


def test_zero_nans_is_not_elementwise_and_ema_is():
    assert not fx.traits(fx.zero_nans()).elementwise  # found_nan reduces each leaf
    assert fx.traits(fx.ema(0.9)).elementwise and fx.traits(fx.set_to_zero()).elementwise
    assert not fx.traits(fx.stateless_with_tree_map(_decayed)).elementwise


def test_ema_negative_decay_is_named():
    with pytest.raises(ValueError, match="ema: decay=-0.5 must be >= 0"):
        fx.ema(-0.5)
