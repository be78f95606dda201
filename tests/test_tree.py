"""Tests for fxtrain/tree.py: paths, alignment with None leaves, batched math; and ``get`` / ``set`` /
``get_all_with_path``, values by name in optimizer states: Optax's cases
(optax/tree_utils/_state_utils_test.py) on fxtrain's states, and the stack that motivates them: a learning
rate set inside amp_cast(accumulate(chain(..., inject_hyperparams(adamw)))).
"""

import math

import pytest
import torch

import fxtrain as fx
from fxtrain import tree
from fxtrain.testing import assert_trees_close
from fxtrain.tree import NamedTupleKey


def test_paths_and_flatten_keep_none():
    t = {"b": None, "a": [torch.ones(1), (torch.zeros(2),)]}
    leaves, spec = tree.flatten(t)
    assert tree.paths(t) == ["a.0", "a.1.0", "b"]
    assert leaves[2] is None
    assert tree.unflatten(spec, leaves)["b"] is None
    assert len(tree.leaves(t)) == 2


def test_map_passes_none_through_and_checks_structure():
    out = tree.map(lambda x, y: x + y, {"a": torch.ones(1), "b": None}, {"a": torch.ones(1), "b": torch.ones(3)})
    assert out["b"] is None and out["a"].item() == 2.0
    with pytest.raises(ValueError, match="differ at 'a.1'"):
        tree.map(lambda x, y: x, {"a": [torch.ones(1)]}, {"a": [torch.ones(1), torch.ones(1)]})


def test_align_drops_none_positions_and_names_mismatch():
    g = {"w": torch.ones(2), "frozen": None, "b": torch.ones(1)}
    mu = {"w": torch.zeros(2), "frozen": torch.zeros(5), "b": torch.zeros(1)}
    gs, mus = tree.align(g, mu)
    assert [x.numel() for x in gs] == [1, 2] and [x.numel() for x in mus] == [1, 2]
    with pytest.raises(ValueError, match="differ at 'extra'"):
        tree.align(g, {**mu, "extra": torch.zeros(1)})


def test_first_mismatch():
    assert tree.first_mismatch({"a": 1}, {"a": 2}) is None
    assert tree.first_mismatch({"x": {"y": 1}}, {"x": {"z": 1}}) == "x.y"
    assert tree.first_mismatch([1, [2, 3]], [1, [2]]) == "1.1"
    assert tree.first_mismatch({"x": [1]}, {"x": (1,)}) == "x"


def test_sum_sq_norm_accumulate_bf16_in_float32():
    xs = [torch.full((1000,), 0.1, dtype=torch.bfloat16), torch.ones(3)]
    expected = 1000 * float(torch.tensor(0.1, dtype=torch.bfloat16)) ** 2 + 3
    assert tree.sum_sq(xs).dtype == torch.float32
    assert math.isclose(float(tree.sum_sq(xs)), expected, rel_tol=1e-6)
    assert float(tree.norm({"a": None, "b": torch.tensor([3.0, 4.0])})) == 5.0
    assert float(tree.sum_sq([])) == 0.0


def test_all_finite_does_not_overflow_and_sees_nan():
    assert bool(tree.all_finite([torch.tensor([3e38, 3e38])]))
    assert not bool(tree.all_finite([torch.ones(2), torch.tensor([float("nan")])]))
    assert not bool(tree.all_finite([torch.tensor([float("-inf")])]))


def test_where_cast_zeros_clone():
    a, b = {"x": torch.ones(2), "n": None}, {"x": torch.zeros(2), "n": None}
    assert tree.where(torch.tensor(False), a, b)["x"].sum() == 0
    c = tree.cast({"f": torch.ones(1), "i": torch.ones(1, dtype=torch.int64)}, torch.bfloat16)
    assert c["f"].dtype == torch.bfloat16 and c["i"].dtype == torch.int64
    z = tree.zeros_like(a, dtype=torch.float64)
    assert z["x"].dtype == torch.float64 and z["n"] is None
    k = tree.clone(a)
    assert k["x"] is not a["x"] and torch.equal(k["x"], a["x"])


def test_add_and_scale_in_place():
    xs, ys = [torch.ones(2)], [torch.ones(2)]
    tree.add_(xs, ys, alpha=2.0)
    tree.scale_(xs, torch.tensor(0.5))
    assert xs[0].tolist() == [1.5, 1.5]


def test_where_and_zero_where_in_place_keep_inf_out_of_nan():
    new, out = [torch.tensor([1.0, float("inf")])], [torch.tensor([5.0, 6.0])]
    tree.where_(torch.tensor(False), new, out)
    assert out[0].tolist() == [5.0, 6.0]
    tree.where_(torch.tensor(True), new, out)
    assert out[0].tolist() == [1.0, float("inf")]
    xs = [torch.tensor([float("nan"), 2.0])]
    tree.zero_where_(torch.tensor(True), xs)
    assert xs[0].tolist() == [0.0, 0.0]


# --- the op layer: one definition, in place when donated, out of place when composable ---------------

import pytest  # noqa: E402
from torch.func import grad, vmap  # noqa: E402

_S = torch.tensor(0.3)
# name -> (op, extra args builder); every op of the layer that takes lists
OPS = {
    "scale_": lambda xs, ys, zs: tree.scale_(xs, 0.7),
    "scale_tensor": lambda xs, ys, zs: tree.scale_(xs, _S),
    "div_": lambda xs, ys, zs: tree.div_(xs, zs),
    "div_tensor": lambda xs, ys, zs: tree.div_(xs, _S),
    "add_": lambda xs, ys, zs: tree.add_(xs, ys, 0.5),
    "add_tensor_alpha": lambda xs, ys, zs: tree.add_(xs, ys, _S),
    "add_scalar": lambda xs, ys, zs: tree.add_(xs, 0.25),
    "lerp_": lambda xs, ys, zs: tree.lerp_(xs, ys, 0.1),
    "lerp_tensor": lambda xs, ys, zs: tree.lerp_(xs, ys, _S),
    "addcmul_": lambda xs, ys, zs: tree.addcmul_(xs, ys, zs, 0.5),
    "addcmul_tensor": lambda xs, ys, zs: tree.addcmul_(xs, ys, zs, _S),
    "addcdiv_": lambda xs, ys, zs: tree.addcdiv_(xs, ys, zs, 0.5),
    "sqrt_": lambda xs, ys, zs: tree.sqrt_(tree.abs_(xs)),
    "reciprocal_": lambda xs, ys, zs: tree.reciprocal_(zs),
    "sign_tanh_neg": lambda xs, ys, zs: tree.neg_(tree.tanh_(tree.sign_(xs))),
    "clamp_": lambda xs, ys, zs: tree.clamp_(xs, -0.5, _S),
    "maximum_": lambda xs, ys, zs: tree.maximum_(xs, ys),
    "copy_": lambda xs, ys, zs: tree.copy_(xs, ys),
}


def _lists():
    g = torch.Generator().manual_seed(3)
    shapes = [(3, 2), (4,), ()]
    xs, ys = [torch.randn(s, generator=g) for s in shapes], [torch.randn(s, generator=g) for s in shapes]
    zs = [torch.rand(s, generator=g) + 0.5 for s in shapes]
    return xs, ys, zs


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_in_place_and_out_of_place_agree(name):
    xs, ys, zs = _lists()
    before = [x.clone() for x in xs]
    with tree.functional():
        out = OPS[name](xs, ys, zs)
    assert all(torch.equal(x, b) for x, b in zip(xs, before)), "out of place must not write its inputs"
    inplace = OPS[name]([x.clone() for x in xs], ys, [z.clone() for z in zs])
    for a, b in zip(out, inplace):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # foreach vs per-tensor kernels


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_batches_under_vmap_like_a_loop(name):
    xs, ys, zs = _lists()
    stack = lambda ls: [torch.stack([x, 2 * x, -x]) for x in ls]  # noqa: E731

    def f(xs, ys, zs):
        with tree.functional():
            return OPS[name](xs, ys, zs)

    batched = vmap(f)(stack(xs), stack(ys), [z.expand(3, *z.shape) for z in zs])
    for k, scale in enumerate((1, 2, -1)):
        one = f([x * scale for x in xs], [y * scale for y in ys], zs)
        for b, o in zip(batched, one):
            torch.testing.assert_close(b[k], o, rtol=1e-6, atol=1e-7)


def test_tensor_scalars_are_differentiated_not_read():
    xs, ys, zs = _lists()

    def loss(s):
        with tree.functional():
            out = tree.addcmul_(tree.lerp_(tree.scale_(xs, s), ys, s), ys, zs, s)
        return sum(o.sum() for o in out)

    s = torch.tensor(0.3)
    eps = 1e-3
    fd = (loss(s + eps) - loss(s - eps)) / (2 * eps)
    torch.testing.assert_close(grad(loss)(s), fd, rtol=1e-3, atol=1e-3)
    assert grad(loss)(s).abs() > 0


def test_put_rebuilds_trees_only_out_of_place():
    t = {"a": torch.zeros(2), "b": None, "c": torch.zeros(1)}
    mask = {"a": None, "b": None, "c": 1.0}
    assert tree.put(t, mask, [torch.ones(1)]) is t  # in place: the leaves were written already
    with tree.functional():
        out = tree.put(t, mask, [torch.ones(1)])
    assert out["a"] is t["a"] and out["b"] is None and out["c"].tolist() == [1.0]


def test_functional_mode_is_scoped():
    assert not tree.is_functional()
    with tree.functional():
        assert tree.is_functional()
        with tree.functional(False):
            assert not tree.is_functional()
        assert tree.is_functional()
    assert not tree.is_functional()


def test_sum_sq_of_complex_leaves_is_the_squared_magnitude_on_both_paths():
    xs = [torch.tensor([3 + 4j]), torch.tensor([12.0])]
    assert float(tree.sum_sq(xs)) == 169.0
    with tree.functional():
        assert float(tree.sum_sq(xs)) == 169.0


# --- values by name in optimizer states ---------------------------------------------------------------------

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
