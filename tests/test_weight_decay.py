"""add_decayed_weights (fxtrain/transforms/_weight_decay.py): Optax parity incl. masks and schedules."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import nested_params
from tests._parity import TREE_MASK, assert_dtypes, assert_none_passthrough, assert_pure, grads
from tests.cases.core import WEIGHT_DECAY_VARIANTS as VARIANTS

def _sched(count):
    return 0.1 * 0.9 ** count


def test_tensor_weight_decay():
    params = {"w": torch.full((2,), 2.0)}
    tx = fx.add_decayed_weights(torch.tensor(0.25))
    assert tx.update({"w": torch.ones(2)}, tx.init(params), params)[0]["w"].tolist() == [1.5, 1.5]


def test_masked_state_layout():
    tx = fx.add_decayed_weights(_sched, mask=TREE_MASK)
    state = tx.init(nested_params())
    assert isinstance(state, fx.MaskedState) and isinstance(state.inner_state, fx.WeightDecaySchedule)


@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_pure_dtypes_and_none_leaves(kwargs):
    tx = fx.add_decayed_weights(**kwargs)
    assert_pure(tx)
    assert_dtypes(tx)
    if "mask" not in kwargs or callable(kwargs["mask"]):
        assert_none_passthrough(tx)


def test_needs_params():
    tx = fx.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match=r"add_decayed_weights\(weight_decay=0\.1\): .* needs the params"):
        tx.update({"w": torch.ones(1)}, tx.init(None))


def test_negative_weight_decay_names_it():
    with pytest.raises(ValueError, match=r"add_decayed_weights: weight_decay=-0.1 must be >= 0"):
        fx.add_decayed_weights(-0.1)


def test_mask_not_matching_params_names_the_path():
    params = nested_params()
    bad = {"dense": {"w": True, "bias": False}, "blocks": True, "scalar": True}
    tx = fx.add_decayed_weights(0.1, mask=bad)
    with pytest.raises(ValueError, match=r"the mask does not match the params: the trees differ at 'dense\.b"):
        tx.init(params)
    tx = fx.add_decayed_weights(0.1, mask=lambda p: {"dense": True, "blocks": [True], "scalar": True})
    with pytest.raises(ValueError, match=r"add_decayed_weights\(weight_decay=0\.1, mask=<lambda>\): the mask does "
                                         r"not match the params: the trees differ at 'blocks\.1'"):
        tx.update(grads(params, 0), fx.EmptyState(), params)


def test_params_not_matching_updates_names_the_path():
    tx = fx.add_decayed_weights(0.1)
    params = nested_params()
    g = grads(params, 0)
    del params["scalar"]
    with pytest.raises(ValueError, match=r"updates do not match the params: .* at '"):
        tx.update(g, tx.init(params), params)


def test_update_of_no_updates_keeps_the_state():
    """Optax's _adding_test: ``add_decayed_weights(0.1, mask=None).update(None, 0, weights)`` is ``(None, 0)``."""
    weights = {"w": torch.ones(3)}
    assert fx.add_decayed_weights(0.1, mask=None).update(None, 0, weights) == (None, 0)


def test_mismatched_updates_name_the_leaf_without_the_state_hint():
    with pytest.raises(ValueError, match=r"updates do not match the params: the trees differ at 'b'$"):
        fx.add_decayed_weights(0.1).update({"b": torch.ones(2)}, fx.EmptyState(), {"w": torch.ones(2)})
