"""masked and partition (fxtrain/transforms/_masking.py): Optax semantics, states, errors."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import nested_params
from tests._parity import TREE_MASK, assert_none_passthrough, assert_parity, assert_pure, grads, ndim_mask

PREFIX_MASK = {"dense": True, "blocks": [False, True], "scalar": False}
MASKS = {"tree": TREE_MASK, "prefix": PREFIX_MASK, "callable": ndim_mask}


def _labels(params):
    return {"dense": {"w": "adam", "b": "sgd"}, "blocks": "adam", "scalar": "sgd"}


@pytest.mark.optax
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_masked_matches_optax(mask):
    optax = pytest.importorskip("optax")
    assert_parity(fx.masked(fx.adam(0.1), mask), optax.masked(optax.adam(0.1), mask))


@pytest.mark.optax
@pytest.mark.parametrize("labels", [_labels, _labels(None), {"dense": "adam", "blocks": "sgd", "scalar": "sgd"}],
                         ids=["callable", "tree", "prefix"])
def test_partition_matches_optax(labels):
    optax = pytest.importorskip("optax")
    assert_parity(fx.partition({"adam": fx.adamw(0.1, weight_decay=0.1), "sgd": fx.sgd(0.1, momentum=0.9)}, labels),
                  optax.partition({"adam": optax.adamw(0.1, weight_decay=0.1), "sgd": optax.sgd(0.1, momentum=0.9)},
                                  labels))


@pytest.mark.optax
def test_nested_masks_and_chains_match_optax():
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.masked(fx.chain(fx.trace(0.5), fx.masked(fx.scale(2.0), ndim_mask)), TREE_MASK),
                  fx.adamw(0.05, weight_decay=0.1, mask=PREFIX_MASK))
    otx = optax.chain(optax.masked(optax.chain(optax.trace(0.5), optax.masked(optax.scale(2.0), ndim_mask)), TREE_MASK),
                      optax.adamw(0.05, weight_decay=0.1, mask=PREFIX_MASK))
    assert_parity(tx, otx)


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
