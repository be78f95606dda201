"""masked and partition (fxtrain/transforms/_masking.py): Optax semantics, states, errors."""

from typing import Any, NamedTuple

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, nested_params
from fxtrain.transforms._masking import freeze, is_mask_fn, multi_transform, selective_transform
from tests.cases.wrappers import reads_value
from tests._parity import TREE_MASK, assert_none_passthrough, assert_parity, assert_pure, grads, ndim_mask

PREFIX_MASK = {"dense": True, "blocks": [False, True], "scalar": False}
MASKS = {"tree": TREE_MASK, "prefix": PREFIX_MASK, "callable": ndim_mask}


def _labels(params):
    return {"dense": {"w": "adam", "b": "sgd"}, "blocks": "adam", "scalar": "sgd"}


@pytest.mark.optax
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_masked_matches_optax(mask):
    optax = pytest.importorskip("optax")
    assert_parity(fx.masked(fx.adam(0.1), mask), optax.masked(optax.adam(0.1), mask), jit=False)


@pytest.mark.optax
@pytest.mark.parametrize("labels", [_labels, _labels(None), {"dense": "adam", "blocks": "sgd", "scalar": "sgd"}],
                         ids=["callable", "tree", "prefix"])
def test_partition_matches_optax(labels):
    optax = pytest.importorskip("optax")
    assert_parity(fx.partition({"adam": fx.adamw(0.1, weight_decay=0.1), "sgd": fx.sgd(0.1, momentum=0.9)}, labels),
                  optax.partition({"adam": optax.adamw(0.1, weight_decay=0.1), "sgd": optax.sgd(0.1, momentum=0.9)},
                                  labels), jit=False)


@pytest.mark.optax
def test_nested_masks_and_chains_match_optax():
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.masked(fx.chain(fx.trace(0.5), fx.masked(fx.scale(2.0), ndim_mask)), TREE_MASK),
                  fx.adamw(0.05, weight_decay=0.1, mask=PREFIX_MASK))
    otx = optax.chain(optax.masked(optax.chain(optax.trace(0.5), optax.masked(optax.scale(2.0), ndim_mask)), TREE_MASK),
                      optax.adamw(0.05, weight_decay=0.1, mask=PREFIX_MASK))
    assert_parity(tx, otx, jit=False)


def test_inner_state_covers_only_masked_in_params():
    state = fx.masked(fx.trace(0.9), PREFIX_MASK).init(nested_params())
    assert isinstance(state, fx.MaskedState)
    trace = state.inner_state.trace
    assert isinstance(trace["dense"]["w"], torch.Tensor)
    assert trace["blocks"][0] == fx.MaskedNode() and trace["scalar"] == fx.MaskedNode()
    assert len(fx.tree.leaves(trace)) == 4


def test_masked_out_updates_pass_through_untouched():
    params = nested_params()
    g = grads(params, 0)
    tx = fx.masked(fx.scale(0.0), TREE_MASK)
    u, _ = fx.update_(tx, fx.tree.clone(g), tx.init(params), params)
    assert torch.equal(u["dense"]["b"], g["dense"]["b"]) and u["dense"]["w"].abs().sum() == 0


def test_partition_state():
    tx = fx.partition({"adam": fx.adam(0.1), "sgd": fx.sgd(0.1)}, _labels)
    state = tx.init(nested_params())
    assert isinstance(state, fx.PartitionState) and set(state.inner_states) == {"adam", "sgd"}
    assert all(isinstance(s, fx.MaskedState) for s in state.inner_states.values())


@pytest.mark.parametrize("tx", [
    fx.masked(fx.adam(0.1), ndim_mask),
    fx.partition({"a": fx.adam(0.1), "b": fx.sgd(0.1, momentum=0.9)},
                 lambda p: fx.tree.map(lambda x: "a" if x.ndim > 1 else "b", p)),
], ids=["masked", "partition"])
def test_pure_and_none_leaves(tx):
    assert_pure(tx)
    assert_none_passthrough(tx)


def test_flags_and_repr():
    assert fx.is_elementwise(fx.masked(fx.adam(0.1), TREE_MASK))
    assert fx.is_elementwise(fx.partition({"a": fx.sgd(0.1)}, "a"))
    assert repr(fx.masked(fx.scale(2.0), ndim_mask)) == "masked(mask=ndim_mask, scale(2.0))"


def test_mask_not_matching_params_names_the_path():
    params = nested_params()
    with pytest.raises(ValueError, match=r"the mask does not match the params: the trees differ at 'blocks\.1'"):
        fx.masked(fx.sgd(0.1), {"dense": True, "blocks": [True, [True, True]], "scalar": True}).init(params)
    with pytest.raises(ValueError, match=r"the trees differ at 'scalar'"):
        fx.masked(fx.sgd(0.1), {"dense": True, "blocks": True}).init(params)
    with pytest.raises(ValueError, match=r"the trees differ at 'dense\.w'"):
        fx.masked(fx.sgd(0.1), {"dense": {"w": [True], "b": True}, "blocks": True, "scalar": True}).init(params)


def test_partition_errors():
    params = nested_params()
    with pytest.raises(ValueError, match=r"labels \['rmsprop'\] have no transform"):
        fx.partition({"adam": fx.adam(0.1)}, {"dense": "adam", "blocks": "rmsprop", "scalar": "adam"}).init(params)
    with pytest.raises(ValueError, match=r"partition: param_labels does not match the params: .* at 'blocks\.1'"):
        fx.partition({"adam": fx.adam(0.1)}, {"dense": "adam", "blocks": ["adam"], "scalar": "adam"}).init(params)


def test_update_not_matching_inner_state_names_the_path():
    params = nested_params()
    tx = fx.masked(fx.adam(0.1), ndim_mask)
    state = tx.init(params)
    g = grads(params, 0)
    g["dense"]["w"] = g["dense"]["w"][0]  # now 1-d: masked out, so the inner state no longer lines up
    with pytest.raises(ValueError, match=r"updates do not match the state: the trees differ at 'dense"):
        tx.update(g, state)  # without params the mask is computed from the updates, as in Optax


def test_transforms_acting_on_the_forward_pass_cannot_be_masked():
    tx = fx.with_traits(fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (u, s)), wrap_loss=lambda f, s: f)
    with pytest.raises(ValueError, match="acts on the forward pass"):
        fx.masked(tx, TREE_MASK)
    with pytest.raises(ValueError, match="acts on the forward pass"):
        fx.partition({"a": tx}, "a")


# --- composing with torch.func: vmap (an ensemble of models) and grad through updates, against Optax ----

ENSEMBLE, STEPS, META_STEPS = 4, 20, 3


def _composable_cases():
    """name -> (fxtrain transform, optax-module -> the same Optax transform)."""
    def partition(labels):
        return (fx.partition({"adam": fx.adamw(0.1, weight_decay=0.1), "sgd": fx.sgd(0.1, momentum=0.9)}, labels),
                lambda o: o.partition({"adam": o.adamw(0.1, weight_decay=0.1), "sgd": o.sgd(0.1, momentum=0.9)},
                                      labels))

    return {
        "masked_tree": (fx.masked(fx.adam(0.1), TREE_MASK), lambda o: o.masked(o.adam(0.1), TREE_MASK)),
        "masked_callable": (fx.masked(fx.adam(0.1), ndim_mask), lambda o: o.masked(o.adam(0.1), ndim_mask)),
        "masked_nested": (fx.masked(fx.chain(fx.trace(0.5), fx.masked(fx.scale(2.0), ndim_mask)), PREFIX_MASK),
                          lambda o: o.masked(o.chain(o.trace(0.5), o.masked(o.scale(2.0), ndim_mask)), PREFIX_MASK)),
        "partition_callable": partition(_labels),
        "partition_prefix": partition({"dense": "adam", "blocks": "sgd", "scalar": "sgd"}),
    }


COMPOSABLE = _composable_cases()


def _stacked(n):
    """``n`` different models: leaf-wise stacks of nested_params(seed=i)."""
    return fx.tree.map(lambda *xs: torch.stack(xs), *[nested_params(seed=i) for i in range(n)])


@pytest.mark.optax
@pytest.mark.parametrize("name", sorted(COMPOSABLE))
def test_under_vmap_matches_optax_under_jax_vmap(name):
    optax = pytest.importorskip("optax")
    import jax

    from fxtrain.testing import assert_trees_close, from_jnp, to_jnp
    from tests._parity import noise

    tx, make = COMPOSABLE[name]
    otx = make(optax)
    params = _stacked(ENSEMBLE)
    state = torch.func.vmap(tx.init)(params)
    op = to_jnp(params)
    ostate = jax.vmap(otx.init)(op)
    update, oupdate = torch.func.vmap(tx.update), jax.vmap(otx.update)
    for k in range(STEPS):
        g = fx.tree.map(lambda p, n: 0.5 * p + n, params, noise(k))  # per-model gradients
        u, state = update(g, state, params)
        ou, ostate = oupdate(jax.tree.map(lambda p, n: 0.5 * p + n, op, to_jnp(noise(k))), ostate, op)
        params, op = fx.apply_updates(params, u), optax.apply_updates(op, ou)
        assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
    assert_trees_close(params, from_jnp(op), rtol=1e-5, atol=1e-6)
    ours, theirs = fx.tree.leaves(state), jax.tree.leaves(ostate)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert_trees_close(a, from_jnp(b), rtol=1e-5, atol=1e-6)


@pytest.mark.optax
@pytest.mark.parametrize("name", sorted(COMPOSABLE))
def test_grad_through_updates_matches_optax_under_jax_grad(name):
    """d/d(initial params) of |params|^2 after 3 updates with gradients 0.5 * params + noise_k."""
    optax = pytest.importorskip("optax")
    import jax

    from fxtrain.testing import assert_trees_close, from_jnp, to_jnp
    from tests._parity import noise

    tx, make = COMPOSABLE[name]
    otx = make(optax)

    def loss(p):
        state = tx.init(p)
        for k in range(META_STEPS):
            u, state = tx.update(fx.tree.map(lambda x, n: 0.5 * x + n, p, noise(k)), state, p)
            p = fx.apply_updates(p, u)
        return sum((x ** 2).sum() for x in fx.tree.leaves(p))

    def oloss(p):
        state = otx.init(p)
        for k in range(META_STEPS):
            u, state = otx.update(jax.tree.map(lambda x, n: 0.5 * x + n, p, to_jnp(noise(k))), state, p)
            p = optax.apply_updates(p, u)
        return sum((x ** 2).sum() for x in jax.tree.leaves(p))

    params = nested_params()
    got = torch.func.grad(loss)(params)
    expected = from_jnp(jax.grad(oloss)(to_jnp(params)))
    assert_trees_close(got, expected, rtol=1e-4, atol=1e-5)
    # Plain autograd gives the same gradient.
    leaves = fx.tree.map(lambda x: x.clone().requires_grad_(), params)
    loss(leaves).backward()
    assert_trees_close(fx.tree.map(lambda x: x.grad, leaves), got, rtol=1e-5, atol=1e-6)


# --- Optax's masked cases (optax/transforms/_masking_test.py), inputs and expected numbers ------------------

def _sgd():
    return fx.sgd(1.0)


def _stateful_sgd():
    return fx.sgd(1.0, momentum=0.0)


def _t(tree):
    return fx.tree.map(lambda x: torch.tensor(x), tree)


OPTAX_MASK = {"a": True, "b": [False, True], "c": {"d": True, "e": (False, True)}}
OPTAX_PARAMS = {"a": 1.0, "b": [2.0, 3.0], "c": {"d": 4.0, "e": (5.0, 6.0)}}


@pytest.mark.parametrize("use_fn", [False, True], ids=["tree", "fn"])
@pytest.mark.parametrize("build", [_sgd, _stateful_sgd], ids=["sgd", "stateful_sgd"])
def test_optax_masked(build, use_fn):
    params = _t(OPTAX_PARAMS)
    updates = fx.tree.map(lambda x: x / 10.0, params)

    def negate(u):
        return fx.tree.map(lambda x, m: -x if m else x, u, OPTAX_MASK)

    tx = fx.masked(build(), (lambda _: OPTAX_MASK) if use_fn else OPTAX_MASK)
    state = tx.init(params)
    u, state = tx.update(updates, state, params)
    assert_trees_close(u, negate(updates))
    u2, _ = tx.update(u, state)  # again, without params
    assert_trees_close(u2, negate(negate(updates)))


@pytest.mark.parametrize("build", [_sgd, _stateful_sgd], ids=["sgd", "stateful_sgd"])
def test_optax_prefix_mask(build):
    mask = {"a": True, "b": False, "c": {"d": False, "e": True}}
    params = _t({"a": 1.0, "b": {"f": 2.0}, "c": {"d": 3.0, "e": ([4.0, 5.0], 6.0)}})
    updates = fx.tree.map(lambda x: x / 10.0, params)
    expected = {"a": -updates["a"], "b": updates["b"],
                "c": {"d": updates["c"]["d"], "e": fx.tree.map(torch.neg, updates["c"]["e"])}}
    tx = fx.masked(build(), mask)
    u, _ = tx.update(updates, tx.init(params), params)
    assert_trees_close(u, expected)


def test_optax_update_requires_params():
    params = _t(OPTAX_PARAMS)
    updates = fx.tree.map(lambda x: x / 10.0, params)
    tx = fx.masked(fx.add_decayed_weights(0.1), OPTAX_MASK)
    state = tx.init(params)
    u, state = tx.update(updates, state, params)
    expected = fx.tree.map(lambda g, p, m: g + 0.1 * p if m else g, updates, params, OPTAX_MASK)
    assert_trees_close(u, expected)
    params = fx.apply_updates(params, u)
    u2, _ = tx.update(u, state, params)
    assert_trees_close(u2, fx.tree.map(lambda g, p, m: g + 0.1 * p if m else g, u, params, OPTAX_MASK))


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_optax_empty(container):
    tx = fx.masked(_sgd(), container())
    tx.update(container(), tx.init(container()))


@pytest.mark.parametrize("use_fn", [False, True])
@pytest.mark.parametrize("extra_key_in_mask", [False, True])
def test_optax_tree_mismatch_fails(extra_key_in_mask, use_fn):
    mask = {"a": True, "b": [False, True], "c": {"d": True, "e": (False, True)}}
    params = _t(OPTAX_PARAMS)
    if extra_key_in_mask:
        mask["c"]["extra"] = True
    else:
        params["c"]["extra"] = torch.tensor(7.0)
    with pytest.raises(ValueError, match="the mask does not match the params"):
        fx.masked(_sgd(), (lambda _: mask) if use_fn else mask).init(params)


def test_optax_mask_fn():
    params = {"a": torch.ones(1, 2), "b": (torch.ones(1), torch.ones(1, 2, 3))}
    tx = fx.masked(fx.add_decayed_weights(0.1), lambda p: fx.tree.map(lambda x: x.ndim > 1, p))
    grads = fx.tree.map(lambda x: 2 * x, params)
    u, _ = tx.update(grads, tx.init(params), params)
    assert_trees_close(u, {"a": grads["a"] + 0.1 * params["a"],
                           "b": (grads["b"][0], grads["b"][1] + 0.1 * params["b"][1])})


@pytest.mark.parametrize("build", [_sgd, _stateful_sgd], ids=["sgd", "stateful_sgd"])
def test_optax_nested_mask(build):
    # Optax's issue #271
    params = {"linear_1": {"w": torch.zeros(1, 1), "b": torch.zeros(1)},
              "linear_2": {"w": torch.zeros(1, 2), "b": torch.zeros(2)},
              "linear_3": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}
    inner_mask = fx.tree.map(lambda _: True, params)
    inner_mask["linear_2"] = False
    tx = fx.masked(fx.masked(build(), inner_mask), lambda p: fx.tree.map(lambda x: x.ndim > 1, p))
    u, _ = tx.update(fx.tree.map(torch.ones_like, params), tx.init(params), params)
    expected = fx.tree.map(torch.ones_like, params)
    expected["linear_1"]["w"] = -expected["linear_1"]["w"]
    expected["linear_3"]["w"] = -expected["linear_3"]["w"]
    assert_trees_close(u, expected)


def test_optax_masked_state_structure():
    params = {"a": [torch.ones(1), (torch.ones(2), torch.ones(3))], "b": {"c": torch.ones(4), "d": torch.ones(5)}}
    trace = fx.masked(_stateful_sgd(), {"a": [True, (True, False)], "b": False}).init(params).inner_state[0].trace
    assert fx.tree.structure(trace) == fx.tree.structure(
        {"a": [torch.zeros(1), (torch.zeros(2), fx.MaskedNode())], "b": fx.MaskedNode()})


class CallableModule(NamedTuple):
    """A pytree node that is callable, as an Equinox module."""

    w: Any

    def __call__(self, x):
        return self.w @ x


def test_optax_mask_compatible_callable_pytree():
    # Optax's issue #913 (parity bug 4): a mask that is a callable pytree is a tree, not a function.
    module = CallableModule(torch.tensor([1.0, 2.0, 3.0]))
    assert callable(module) and not is_mask_fn(module)
    tx = fx.masked(_sgd(), CallableModule(False))
    u, _ = tx.update(module, tx.init(module))
    assert_trees_close(u, module, rtol=0, atol=0)
    tx = fx.masked(_sgd(), CallableModule(True))
    u, _ = tx.update(module, tx.init(module))
    assert_trees_close(u, CallableModule(-module.w))
    labels = multi_transform({"a": _sgd(), "b": fx.identity()}, CallableModule("b"))
    u, _ = labels.update(module, labels.init(module))
    assert_trees_close(u, module, rtol=0, atol=0)


@fx.transform(elementwise=False, extra_args=True)
def _adds_tree_value():
    """Adds ``value``, a tree shaped like the updates, to them."""
    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        return fx.tree.map(lambda u, v: u + v, updates, value), state

    return fx.GradientTransformation(lambda params: fx.EmptyState(), update_fn)


def test_extra_args_reach_masked_and_partitioned_transforms():
    inner = reads_value()
    params = {"w": torch.ones(2), "b": torch.ones(1)}
    mask = {"w": True, "b": False}
    for tx in (fx.masked(inner, mask), fx.partition({"x": inner, "y": fx.identity()}, {"w": "x", "b": "y"}),
               multi_transform({"x": inner, "y": fx.identity()}, {"w": "x", "b": "y"})):
        assert fx.traits(tx).extra_args
        u, _ = tx.update(params, tx.init(params), params, value=torch.tensor(2.0))
        assert u["w"].tolist() == [3.0, 3.0] and u["b"].tolist() == [1.0]
        u, _ = fx.update_(tx, fx.tree.clone(params), tx.init(params), params, value=torch.tensor(2.0))
        assert u["w"].tolist() == [3.0, 3.0]
    assert not fx.traits(fx.masked(fx.sgd(0.1), mask)).extra_args
    # mask_compatible_extra_args: an argument shaped like the updates is masked as they are
    tx = fx.masked(_adds_tree_value(), mask, mask_compatible_extra_args=True)
    u, _ = tx.update(params, tx.init(params), params, value={"w": torch.tensor(5.0), "b": torch.tensor(7.0)})
    assert u["w"].tolist() == [6.0, 6.0] and u["b"].tolist() == [1.0]


# --- freeze, selective_transform, multi_transform: Optax's numbers over 20 steps --------------------------

@pytest.mark.optax
def test_freeze_matches_optax():
    optax = pytest.importorskip("optax")
    mask = {"dense": {"w": False, "b": True}, "blocks": True, "scalar": False}
    assert_parity(fx.chain(freeze(mask), fx.adam(0.1)), optax.chain(optax.freeze(mask), optax.adam(0.1)), jit=False)


@pytest.mark.optax
@pytest.mark.parametrize("freeze_mask", [PREFIX_MASK, False], ids=["tree", "bool"])
def test_selective_transform_matches_optax(freeze_mask):
    optax = pytest.importorskip("optax")
    assert_parity(selective_transform(fx.adamw(0.1, weight_decay=0.1), freeze_mask=freeze_mask),
                  optax.selective_transform(optax.adamw(0.1, weight_decay=0.1), freeze_mask=freeze_mask), jit=False)


@pytest.mark.optax
def test_multi_transform_matches_optax():
    optax = pytest.importorskip("optax")
    assert_parity(multi_transform({"adam": fx.adam(0.1), "sgd": fx.sgd(0.1, momentum=0.9)}, _labels),
                  optax.multi_transform({"adam": optax.adam(0.1), "sgd": optax.sgd(0.1, momentum=0.9)}, _labels),
                  jit=False)


def test_freeze_examples_and_states():
    params = {"a": torch.zeros(1), "b": torch.zeros(2)}
    state = freeze({"a": True, "b": False}).init(params)
    assert isinstance(state, fx.MaskedState) and state.inner_state == fx.EmptyState()
    u, _ = freeze(True).update(params, freeze(True).init(params))
    assert all(not x.any() for x in fx.tree.leaves(u))
    tx = selective_transform(fx.adam(1e-3), freeze_mask={"a": True, "b": False})
    state = tx.init(params)
    assert sorted(state.inner_states) == ["freeze", "train"]
    assert fx.tree.leaves(state.inner_states["train"].inner_state[0].mu) != []
    assert repr(freeze(True)) == "freeze(True)"


# --- Optax's freezing and partition cases (optax/transforms/_freezing_test.py, _combining_test.py) ----------

def _nested():
    t = {"layer1": [torch.zeros(2, 3), {"bias": torch.ones(3)}],
         "layer2": {"w": torch.full((4, 2), 2.0), "b": torch.full((4,), -1.0)}, "misc": (torch.tensor(5.0),)}
    g = {"layer1": [torch.full((2, 3), 1.0), {"bias": torch.full((3,), 2.0)}],
         "layer2": {"w": torch.full((4, 2), 3.0), "b": torch.full((4,), 4.0)}, "misc": (torch.tensor(1.0),)}
    return t, g


FLAT_PARAMS = {"a": torch.zeros(1), "b": torch.ones(2)}
FLAT_GRADS = {"a": torch.tensor([1.0]), "b": torch.tensor([2.0, 3.0])}


@pytest.mark.parametrize("mask", [{"a": True, "b": False}, {"a": False, "b": True}, True, False,
                                  torch.tensor(False)], ids=["a", "b", "all", "none", "tensor_bool"])
def test_optax_freeze_flat(mask):
    tx = freeze(mask)
    u, _ = tx.update(FLAT_GRADS, tx.init(FLAT_PARAMS), FLAT_PARAMS)
    frozen = mask if isinstance(mask, dict) else {"a": bool(mask), "b": bool(mask)}
    assert_trees_close(u, {k: torch.zeros_like(g) if frozen[k] else g for k, g in FLAT_GRADS.items()}, rtol=0, atol=0)


def test_optax_freeze_and_selective_transform_nested():
    params, g = _nested()
    mask = {"layer1": [False, {"bias": False}], "layer2": {"w": True, "b": False}, "misc": (False,)}
    u, _ = freeze(mask).update(g, freeze(mask).init(params), params)
    assert not u["layer2"]["w"].any() and torch.equal(u["layer2"]["b"], g["layer2"]["b"])
    tx = selective_transform(fx.sgd(1.0), freeze_mask=mask)
    new = fx.apply_updates(params, tx.update(g, tx.init(params), params)[0])
    expected = fx.tree.map(lambda p, d: p - d, params, g)
    expected["layer2"]["w"] = params["layer2"]["w"]
    assert_trees_close(new, expected, rtol=0, atol=1e-6)
    # prefix masks: True for "b" freezes its whole subtree
    p, d = {"a": torch.tensor(1.0), "b": {"c": torch.tensor(2.0), "d": torch.tensor(3.0)}}, \
        {"a": torch.tensor(10.0), "b": {"c": torch.tensor(20.0), "d": torch.tensor(30.0)}}
    tx = selective_transform(fx.sgd(1.0), freeze_mask={"a": False, "b": True})
    new = fx.apply_updates(p, tx.update(d, tx.init(p), p)[0])
    assert new["a"].item() == -9.0 and new["b"]["c"].item() == 2.0 and new["b"]["d"].item() == 3.0
    with pytest.raises(ValueError, match="does not match the params"):
        freeze({"layer1": [True]}).init(params)
    with pytest.raises(ValueError, match="does not match the params"):
        selective_transform(fx.sgd(1.0), freeze_mask={"a": True}).init(FLAT_PARAMS)


@pytest.mark.parametrize("use_fn", [True, False])
def test_optax_partition(use_fn):
    params = {"a1": torch.tensor(1.0), "b1": torch.tensor(2.0),
              "z1": {"a2": torch.tensor(3.0), "z2": {"c1": torch.tensor(4.0)}}}
    labels = {"a1": "a", "b1": "b", "z1": {"a2": "a", "z2": {"c1": "c"}}}
    tx = multi_transform({"a": fx.scale(-1.0), "b": fx.ema(0.0), "c": fx.scale(2.0)},
                         (lambda _: labels) if use_fn else labels)
    factor = {"a1": -1.0, "b1": 1.0, "z1": {"a2": -1.0, "z2": {"c1": 2.0}}}
    u0 = fx.tree.map(lambda x: x / 10.0, params)
    state = tx.init(params)
    u, state = tx.update(u0, state, params)
    assert_trees_close(u, fx.tree.map(lambda x, f: f * x, u0, factor))
    u2, _ = tx.update(u, state)  # again, without params
    assert_trees_close(u2, fx.tree.map(lambda x, f: f * f * x, u0, factor))


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_optax_partition_empty(container):
    tx = multi_transform({0: fx.sgd(1.0)}, lambda _: 0)
    u, _ = tx.update(container(), tx.init(container()))
    assert u == container()


@pytest.mark.parametrize("use_fn", [False, True])
@pytest.mark.parametrize("extra_label", [False, True])
def test_optax_partition_labels_mismatch(extra_label, use_fn):
    params = _t(OPTAX_PARAMS)
    labels = {"a": 3 if extra_label else 0, "b": [1, 0], "c": 1}
    tx = multi_transform({0: fx.sgd(1.0), 1: fx.adam(1.0, b1=0.0, b2=0.0), 2: fx.trace(1.0)},
                         (lambda _: labels) if use_fn else labels)
    if extra_label:
        with pytest.raises(ValueError, match=r"partition: labels \['3'\] have no transform"):
            tx.init(params)
    else:
        tx.update(fx.tree.map(lambda x: x / 10.0, params), tx.init(params))
