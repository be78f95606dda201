"""Tests for fxtrain.tree.get / set / get_all_with_path: values by name in optimizer states.

Optax's cases (optax/tree_utils/_state_utils_test.py) on fxtrain's states, and the stack that motivates
them: a learning rate set inside amp_cast(accumulate(chain(..., inject_hyperparams(adamw)))).
"""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from fxtrain.tree import NamedTupleKey

INJECT = "InjectHyperparamsState"


@pytest.fixture
def params():
    return torch.tensor([1.0, 2.0, 3.0])


def _only(tuple_name):
    """A filter keeping the fields of one kind of state."""
    return lambda path, value: isinstance(path[-1], NamedTupleKey) and path[-1].tuple_name == tuple_name


# --- get_all_with_path ----------------------------------------------------------------------------

def test_flat_trees_have_no_names(params):
    assert fx.tree.get_all_with_path((), "foo") == []
    assert fx.tree.get_all_with_path(params, "foo") == []


def test_single_value(params):
    [(path, value)] = fx.tree.get_all_with_path(fx.scale_by_adam().init(params), "count")
    assert path == (NamedTupleKey("ScaleByAdamState", "count"),)
    assert value.item() == 0


def test_absent_name(params):
    assert fx.tree.get_all_with_path(fx.adam(1.0).init(params), "apple") == []


def test_values_in_nested_chains(params):
    tx = fx.chain(fx.inject_hyperparams(fx.sgd)(learning_rate=1.0),
                  fx.chain(fx.adam(1.0), fx.inject_hyperparams(fx.adam)(learning_rate=1e-4)))
    found = fx.tree.get_all_with_path(tx.init(params), "learning_rate")
    assert [path for path, _ in found] == [
        (0, NamedTupleKey(INJECT, "hyperparams"), "learning_rate"),
        (1, 1, NamedTupleKey(INJECT, "hyperparams"), "learning_rate"),
    ]
    assert [v.item() for _, v in found] == pytest.approx([1.0, 1e-4])
    assert [fx.tree.keystr(p) for p, _ in found] == ["[0].hyperparams['learning_rate']",
                                                     "[1][1].hyperparams['learning_rate']"]


def test_filtering_and_dict_keys():
    state = {"hparams": {"learning_rate": 1.0}, "learning_rate": "foo"}
    assert len(fx.tree.get_all_with_path(state, "learning_rate")) == 2
    kept = fx.tree.get_all_with_path(state, "learning_rate", filtering=lambda _, v: isinstance(v, float))
    assert kept == [(("hparams", "learning_rate"), 1.0)]


def test_subtree_values(params):
    # a found value may be a container; filtering on its type picks it (Optax gets hyperparams_states so)
    state = fx.inject_hyperparams(fx.sgd)(learning_rate=0.1).init(params)
    [(path, value)] = fx.tree.get_all_with_path(state, "hyperparams", lambda _, v: isinstance(v, dict))
    assert path == (NamedTupleKey(INJECT, "hyperparams"),) and list(value) == ["learning_rate"]


def test_values_inside_found_values_are_found():
    assert fx.tree.get_all_with_path({"a": {"a": 1.0}}, "a") == [(("a",), {"a": 1.0}), (("a", "a"), 1.0)]


# --- get ------------------------------------------------------------------------------------------

def test_get_unique_absent_and_default(params):
    state = fx.inject_hyperparams(fx.sgd)(learning_rate=42.0).init(params)
    assert fx.tree.get(state, "learning_rate").item() == 42.0
    assert fx.tree.get(state, "ema") is None
    assert fx.tree.get(state, "ema", default=7.0) == 7.0


def test_get_several_values_names_their_paths(params):
    tx = fx.chain(fx.inject_hyperparams(fx.sgd)(learning_rate=42.0),
                  fx.inject_hyperparams(fx.sgd)(learning_rate=42.0))
    with pytest.raises(KeyError, match=r"2 values are named 'learning_rate', at \[0\]\.hyperparams\['learning_rate'\], "
                                       r"\[1\]\.hyperparams\['learning_rate'\]; pass filtering="):
        fx.tree.get(tx.init(params), "learning_rate")
    state = {"hparams": {"learning_rate": 1.0}, "learning_rate": "foo"}
    with pytest.raises(KeyError):
        fx.tree.get(state, "learning_rate")
    assert fx.tree.get(state, "learning_rate", filtering=lambda _, v: isinstance(v, float)) == 1.0


def test_get_follows_a_schedule(params):
    tx = fx.inject_hyperparams(fx.sgd)(learning_rate=lambda count: 1 / (count + 1))
    state = tx.init(params)
    for i in range(4):
        _, state = tx.update(params, state)
        assert fx.tree.get(state, "learning_rate").item() == pytest.approx(1 / (i + 1))


def test_get_filters_by_state_type_and_gets_whole_states(params):
    state = fx.chain(fx.scale_by_lion(), fx.scale_by_adam()).init(params)
    with pytest.raises(KeyError):
        fx.tree.get(state, "count")
    assert fx.tree.get(state, "count", filtering=_only("ScaleByAdamState")) is state[1].count
    assert fx.tree.get(state, "ScaleByLionState") is state[0]


# --- set ------------------------------------------------------------------------------------------

def test_set_on_flat_trees_raises():
    with pytest.raises(KeyError, match="no value is named 'foo'"):
        fx.tree.set((), foo=1.0)
    with pytest.raises(KeyError):
        fx.tree.set(torch.ones(3), foo=1.0)


def test_set_injected_hyperparameters(params):
    state = fx.inject_hyperparams(fx.adam)(learning_rate=1.0).init(params)
    new = fx.tree.set(state, learning_rate=2.0, b1=3.0)
    assert fx.tree.get(new, "learning_rate") == 2.0 and fx.tree.get(new, "b1") == 3.0
    assert fx.tree.get(state, "learning_rate").item() == 1.0  # a copy: the old state is untouched
    assert new.inner_state[0].mu is state.inner_state[0].mu  # leaves are shared, not copied


def test_set_absent_name_suggests_close_ones(params):
    state = fx.inject_hyperparams(fx.adam)(learning_rate=1.0).init(params)
    with pytest.raises(KeyError, match="no value is named 'ema'"):
        fx.tree.set(state, ema=2.0)
    with pytest.raises(KeyError, match=r"'learning_rat' in the tree \(did you mean learning_rate"):
        fx.tree.set(state, learning_rat=2.0)
    with pytest.raises(KeyError, match="no value named 'learning_rate' passes the filtering"):
        fx.tree.set(state, lambda p, v: False, learning_rate=2.0)


def test_set_between_updates(params):
    tx = fx.inject_hyperparams(fx.adam)(learning_rate=1.0)
    state = tx.init(params)
    for i in range(4):
        state = fx.tree.set(state, learning_rate=torch.tensor(1.0 / (i + 1)))
        _, state = tx.update(params, state)
        assert fx.tree.get(state, "learning_rate").item() == pytest.approx(1.0 / (i + 1))


def test_set_every_match(params):
    new = fx.tree.set(fx.chain(fx.adam(1.0), fx.adam(1.0)).init(params), count=2.0)
    found = fx.tree.get_all_with_path(new, "count")
    assert len(found) == 2 and all(v == 2.0 for _, v in found)


def test_set_with_filtering():
    state = {"hparams": {"learning_rate": 1.0}, "learning_rate": "foo"}
    new = fx.tree.set(state, lambda _, v: isinstance(v, float), learning_rate=0.5)
    assert fx.tree.get_all_with_path(new, "learning_rate") == [(("learning_rate",), "foo"),
                                                                (("hparams", "learning_rate"), 0.5)]
    tree = {"a": {"a": 1.0}, "b": {"a": 1}}
    assert fx.tree.set(tree, lambda _, v: isinstance(v, float), a=2.0) == {"a": {"a": 2.0}, "b": {"a": 1}}
    assert fx.tree.set(tree, lambda _, v: isinstance(v, dict), a={"c": 0.0}) == {"a": {"c": 0.0}, "b": {"a": 1}}


def test_set_one_state_by_filter_or_by_name(params):
    state = fx.chain(fx.scale_by_lion(), fx.scale_by_adam()).init(params)
    new = fx.tree.set(state, _only("ScaleByAdamState"), count=torch.tensor(42))
    assert new[1].count.item() == 42 and new[0].count.item() == 0
    lion = state[0]._replace(count=torch.tensor(42, dtype=torch.int32))
    new = fx.tree.set(state, ScaleByLionState=lion)
    assert new[0] is lion and new[1].mu is state[1].mu


# --- the stack it is for -----------------------------------------------------------------------

def test_learning_rate_set_deep_in_a_real_stack():
    # amp_cast(accumulate(chain(clip, inject_hyperparams(adamw)))), without state.inner_state.inner_state[1]...
    tx = fx.amp_cast(fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0),
                                            fx.inject_hyperparams(fx.adamw)(learning_rate=1e-3, weight_decay=0.1)),
                                   every=2))
    p = {"w": torch.linspace(-1, 1, 6).reshape(2, 3), "b": torch.ones(3)}
    g = fx.tree.map(lambda x: 0.3 * x + 0.1, p)
    state = tx.init(p)
    for _ in range(3):
        _, state = tx.update(g, state, p)
    assert fx.tree.get(state, "learning_rate").item() == pytest.approx(1e-3)

    def emitted(state):  # the second call of a window emits
        _, state = tx.update(g, state, p)
        return tx.update(g, state, p)

    slow_state = fx.tree.set(state, learning_rate=torch.tensor(1e-4))
    assert slow_state.inner_state.inner_state[1].hyperparams["learning_rate"].item() == pytest.approx(1e-4)
    u, _ = emitted(state)
    u_slow, after = emitted(slow_state)
    # adamw's update is -lr * (direction + wd * p): a tenth of the learning rate, a tenth of the update
    assert_trees_close(u_slow, fx.tree.map(lambda x: 0.1 * x, u), rtol=1e-5, atol=1e-9)
    assert fx.tree.get(after, "learning_rate").item() == pytest.approx(1e-4)  # kept by later updates
    assert fx.tree.structure(slow_state) == fx.tree.structure(state)
