"""fxtrain/transforms/_normalizing.py: Optax parity over 20 steps, Optax's own test cases, errors.

Optax's cases ported here (inputs and expected numbers): transforms/_clipping_test.py
(``test_clip_by_block_rms``, ``test_adaptive_grad_clip*``, ``test_unitwise_norm_with_axis``'s shape error,
``test_per_example_layer_norm_clip``), _src/transform_test.py (``test_scalers`` for the four scalers here,
``test_centralize``) and ``normalize_by_update_norm``'s docstring example.
"""

import math

import numpy as np
import pytest
import torch
from torch.func import grad

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from fxtrain.transforms._normalizing import block_norms, layer_clip_sum
from tests._parity import assert_dtypes, assert_parity

STEPS = 50  # Optax's clipping tests
INIT_PARAMS = (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))  # Optax's test inputs
PER_STEP_UPDATES = (torch.tensor([500.0, 5.0]), torch.tensor([300.0, 3.0]))


@pytest.mark.optax
def test_tensor_hyperparameters_match_optax():
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.clip_by_block_rms(torch.tensor(0.3)), fx.adaptive_grad_clip(torch.tensor(0.2)),
                  fx.scale_by_param_block_rms(torch.tensor(0.8)), fx.normalize_by_update_norm(torch.tensor(-0.5)))
    otx = optax.chain(optax.clip_by_block_rms(0.3), optax.adaptive_grad_clip(0.2),
                      optax.scale_by_param_block_rms(0.8), optax.normalize_by_update_norm(-0.5))
    assert_parity(tx, otx, steps=5)


@pytest.mark.optax
def test_complex_block_rms_and_normalize_match_optax():
    optax = pytest.importorskip("optax")
    jnp = pytest.importorskip("jax.numpy")
    g = torch.Generator().manual_seed(3)
    u = {"w": torch.randn(3, 4, dtype=torch.complex64, generator=g), "b": torch.randn(2, dtype=torch.complex64,
                                                                                     generator=g)}
    ju = {k: jnp.asarray(v.numpy()) for k, v in u.items()}
    for ours, theirs in [(fx.clip_by_block_rms(0.5), optax.clip_by_block_rms(0.5)),
                         (fx.normalize_by_update_norm(), optax.normalize_by_update_norm())]:
        for donate in (False, True):
            got = (fx.update_(ours, fx.tree.clone(u), ours.init(None)) if donate else ours.update(u, ours.init(None)))[0]
            want = theirs.update(ju, theirs.init(ju))[0]
            assert_trees_close(got, {k: np.asarray(v) for k, v in want.items()}, rtol=1e-5, atol=1e-6)


# --- Optax's own cases ----------------------------------------------------------------------------

def _rms(t):
    return t.square().mean().sqrt().item()


def test_clip_by_block_rms_optax_case():
    updates = PER_STEP_UPDATES
    for i in range(1, STEPS + 1):
        clipper = fx.clip_by_block_rms(1.0 / i)
        updates, _ = clipper.update(updates, fx.EmptyState())
        # float32 rounding of the rms (its sum depends on the kernel's reduction order): 1e-6 relative
        assert _rms(updates[0]) == pytest.approx(1.0 / i, rel=1e-6)
        assert _rms(updates[1]) == pytest.approx(1.0 / i, rel=1e-6)
        # clipping again, or the original updates, gives the same: no drift
        assert_trees_close(updates, clipper.update(PER_STEP_UPDATES, fx.EmptyState())[0])


def _unit_norm(x, axis=None):
    """Optax's unitwise_norm, broadcast back to x's shape (a reference for the tests)."""
    x = torch.as_tensor(x)
    if axis is None:
        axis = tuple(range(x.ndim)) if x.squeeze().ndim <= 1 else (0,) if x.ndim in (2, 3) else \
            tuple(range(x.ndim - 1))
    return torch.linalg.vector_norm(x, dim=axis, keepdim=True).expand(x.shape)


def test_adaptive_grad_clip_optax_case():
    updates, params = PER_STEP_UPDATES, INIT_PARAMS
    for i in range(1, STEPS + 1):
        clip_r = 1.0 / i
        clipper = fx.adaptive_grad_clip(clipping=clip_r)
        updates, _ = clipper.update(updates, fx.EmptyState(), params)
        for u, p in zip(updates, params):
            assert (_unit_norm(u) - clip_r * _unit_norm(p) < 1e-6).all()
        assert_trees_close(updates, clipper.update(PER_STEP_UPDATES, fx.EmptyState(), params)[0])
    grads, params = [torch.tensor([[1.0, 2.0], [3.0, 4.0]])], [torch.ones(2, 2)]
    clipped, _ = fx.adaptive_grad_clip(1.0).update(grads, fx.EmptyState(), params)
    assert (_unit_norm(clipped[0]) <= _unit_norm(params[0]) + 1e-6).all()


def test_adaptive_grad_clip_with_axis_optax_case():
    conv3d_grad, conv3d_param = torch.full((2, 2, 2, 3, 4), 2.0), torch.ones(2, 2, 2, 3, 4)
    linear_grad, linear_param = torch.full((5, 6), 3.0), torch.ones(5, 6)
    (conv3d,), _ = fx.adaptive_grad_clip(0.5, axis=(0, 1, 2)).update([conv3d_grad], fx.EmptyState(), [conv3d_param])
    (linear,), _ = fx.adaptive_grad_clip(0.5).update([linear_grad], fx.EmptyState(), [linear_param])
    assert conv3d.shape == conv3d_grad.shape and linear.shape == linear_grad.shape
    assert (_unit_norm(conv3d, (0, 1, 2)) <= 0.5 * _unit_norm(conv3d_param, (0, 1, 2)) + 1e-6).all()
    assert (_unit_norm(linear) <= 0.5 * _unit_norm(linear_param) + 1e-6).all()
    small = torch.full((2, 2, 2, 3, 4), 0.1)
    (unclipped,), _ = fx.adaptive_grad_clip(2.0, axis=(0, 1, 2)).update([small], fx.EmptyState(), [conv3d_param])
    assert_trees_close(unclipped, small, rtol=1e-6)


def test_adaptive_grad_clip_default_axis_conv3d_optax_case():
    grad_, param = torch.full((2, 2, 2, 3, 4), 2.0), torch.ones(2, 2, 2, 3, 4)
    (default,), _ = fx.adaptive_grad_clip(0.5).update([grad_], fx.EmptyState(), [param])
    (explicit,), _ = fx.adaptive_grad_clip(0.5, axis=(0, 1, 2, 3)).update([grad_], fx.EmptyState(), [param])
    assert_trees_close(default, explicit, rtol=0, atol=0)
    assert (_unit_norm(default) <= 0.5 * _unit_norm(param) + 1e-6).all()


def test_adaptive_grad_clip_more_than_5_dims_needs_axis_and_names_the_leaf():
    g = {"conv": {"w": torch.ones(2, 2, 2, 2, 2, 2)}}
    with pytest.raises(ValueError, match=r"adaptive_grad_clip: the param at 'conv.w' has shape \(2, 2, 2, 2, 2, 2\); "
                                         r"with more than 5 dims pass axis="):
        fx.adaptive_grad_clip(1.0).update(g, fx.EmptyState(), g)
    u, _ = fx.adaptive_grad_clip(1.0, axis=(0, 1, 2)).update(g, fx.EmptyState(), g)
    assert u["conv"]["w"].shape == (2,) * 6


@pytest.mark.parametrize("inputs, outputs", [
    ([1.0, 2.0], [1.0, 2.0]),
    ([[1.0, 2.0], [3.0, 4.0]], [[-0.5, 0.5], [-0.5, 0.5]]),
    ([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]], [[[-1.5, -0.5], [0.5, 1.5]], [[-1.5, -0.5], [0.5, 1.5]]]),
], ids=["1d", "2d", "3d"])
def test_centralize_optax_case(inputs, outputs):
    g = torch.tensor(inputs)
    for donate in (False, True):
        tx = fx.centralize()
        u, _ = fx.update_(tx, g.clone(), tx.init(g)) if donate else tx.update(g, tx.init(g))
        assert u.tolist() == outputs


@pytest.mark.parametrize("make", [fx.scale_by_param_block_norm, fx.scale_by_param_block_rms,
                                  fx.scale_by_distance_over_gradients, fx.normalize_by_update_norm],
                         ids=lambda f: f.__name__)
def test_scalers_optax_case(make):
    tx = make()
    state = tx.init(INIT_PARAMS)
    assert all(torch.isfinite(x).all() for x in fx.tree.leaves(state) if x.is_floating_point())
    updates, state = tx.update(PER_STEP_UPDATES, state, INIT_PARAMS)
    assert all(torch.isfinite(x).all() for x in fx.tree.leaves((updates, state)) if x.is_floating_point())
    assert [u.shape for u in updates] == [p.shape for p in INIT_PARAMS]


def test_normalize_by_update_norm_optax_docstring_case():
    solver = fx.normalize_by_update_norm(scale_factor=-1.0)
    params = torch.tensor([1.0, 2.0, 3.0])
    state, seen = solver.init(params), []
    for _ in range(5):
        updates, state = solver.update(2 * params, state, params)  # the gradient of sum(x ** 2)
        params = fx.apply_updates(params, updates)
        seen.append(f"{(params ** 2).sum().item():.2E}")
    assert seen == ["7.52E+00", "3.03E+00", "5.50E-01", "6.67E-02", "5.50E-01"]


def test_per_example_layer_norm_clip_optax_case():
    grads = [torch.tensor([[0.5], [1.5], [-2.0], [3.0]]), torch.ones(4, 3, 3, 2)]
    # uniform: each of the 2 layers is clipped to norm sqrt(2) / sqrt(2) = 1
    sums, n = layer_clip_sum(grads, math.sqrt(2), uniform=True)
    assert sums[0].item() == pytest.approx(1.5)
    np.testing.assert_allclose(sums[1].numpy(), 4 / math.sqrt(18), rtol=1e-6)
    assert [int(c) for c in n] == [3, 4]
    # by size: layer 0 gets sqrt(19) sqrt(1 / 19) = 1, layer 1 sqrt(18): nothing of layer 1 is clipped
    sums, n = layer_clip_sum(grads, math.sqrt(19), uniform=False)
    assert sums[0].item() == pytest.approx(1.5)
    np.testing.assert_allclose(sums[1].numpy(), 4.0, rtol=1e-6)
    assert [int(c) for c in n] == [3, 0]
    # the transform: the same sums, in the tree
    u, state = fx.per_example_layer_norm_clip(math.sqrt(19), uniform=False).update({"a": grads[0], "b": grads[1]},
                                                                                  fx.EmptyState())
    assert_trees_close(u, {"a": sums[0], "b": sums[1]}, rtol=0, atol=0)
    assert state == fx.EmptyState()


# --- per_example_layer_norm_clip against Optax's function -----------------------------------------

def _per_example_tree(seed=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = {"a": torch.randn(4, 3, 2, generator=g), "b": [torch.randn(4, generator=g), torch.randn(4, 5, generator=g)]}
    t["a"][1] = 0.0  # a zero gradient for example 1 in one layer
    return fx.tree.map(lambda x: (2 * x).to(dtype), t)


@pytest.mark.optax
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("clip", [0.0, 0.7, 3.0, float("inf")])
def test_per_example_layer_norm_clip_matches_optax(clip, uniform):
    optax = pytest.importorskip("optax")
    jnp = pytest.importorskip("jax.numpy")
    grads = _per_example_tree()
    leaves = fx.tree.leaves(grads)
    expected, expected_n = optax.per_example_layer_norm_clip([jnp.asarray(x.numpy()) for x in leaves], clip, uniform)
    tx = fx.per_example_layer_norm_clip(clip, uniform=uniform)
    u, _ = tx.update(grads, tx.init(None))
    assert_trees_close(fx.tree.leaves(u), [np.asarray(e) for e in expected], rtol=1e-5, atol=1e-6)
    sums, n = layer_clip_sum(leaves, clip, uniform)
    assert [int(c) for c in n] == [int(c) for c in expected_n]
    with torch.no_grad():
        donated, _ = fx.update_(tx, fx.tree.clone(grads), tx.init(None))
    assert_trees_close(donated, u, rtol=0, atol=0)


def test_per_example_layer_norm_clip_dtype_none_repr_and_errors():
    grads = {**_per_example_tree(dtype=torch.bfloat16), "frozen": None}
    tx = fx.per_example_layer_norm_clip(1.0)
    u, _ = tx.update(grads, tx.init(None))
    assert u["frozen"] is None and u["a"].shape == (3, 2) and u["a"].dtype == torch.bfloat16
    assert repr(tx) == "per_example_layer_norm_clip(1.0)"
    assert repr(fx.per_example_layer_norm_clip(2.0, uniform=False)) == "per_example_layer_norm_clip(2.0, uniform=False)"
    assert not fx.traits(tx).elementwise
    with pytest.raises(ValueError, match=r"per_example_layer_norm_clip expects per-example gradients.*'b' has 4 "
                                         r"examples on axis 0, 'a' has 3"):
        tx.update({"a": torch.ones(3, 2), "b": torch.ones(4)}, fx.EmptyState())
    with pytest.raises(ValueError, match="per_example_layer_norm_clip: global_l2_norm_clip=-1.0 must be >= 0"):
        fx.per_example_layer_norm_clip(-1.0)


def test_per_example_layer_norm_clip_is_differentiable_and_batchable():
    grads = _per_example_tree()

    def total(clip, g):
        u, _ = fx.per_example_layer_norm_clip(clip, uniform=False).update(g, fx.EmptyState())
        return sum(x.sum() for x in fx.tree.leaves(u))

    clip = torch.tensor(0.7)
    d_clip, d_grads = grad(total, argnums=(0, 1))(clip, grads)
    fd = (total(clip + 1e-3, grads) - total(clip - 1e-3, grads)) / 2e-3
    assert d_clip.item() == pytest.approx(fd.item(), rel=1e-3)
    assert all(torch.isfinite(x).all() for x in fx.tree.leaves(d_grads))  # the zero example included
    clips = torch.tensor([0.1, 0.7, 3.0])
    batched = torch.func.vmap(total, in_dims=(0, None))(clips, grads)
    assert_trees_close(batched, torch.stack([total(c, grads) for c in clips]), rtol=1e-6)


# --- invariants, dtypes, gradients ------------------------------------------------------------------

def test_block_norms_pure_and_in_place_agree():
    xs = [torch.randn(4, 3), torch.randn(5).bfloat16(), torch.randn(2, dtype=torch.complex64), torch.tensor(-2.0)]
    with fx.tree.functional():
        pure = block_norms(xs, rms=True)
    in_place = block_norms(xs, rms=True)
    expected = torch.stack([x.abs().float().square().mean().sqrt() for x in xs])
    assert_trees_close(pure, expected, rtol=1e-6)
    assert_trees_close(in_place, expected, rtol=1e-6)
    assert pure.dtype == torch.float32


def test_distance_over_gradients_state_dtypes_follow_optax():
    # max_dist in the param dtype, grad_sum_of_squares float32 (Optax: jnp.zeros(1)), init_params in param_dtype
    assert_dtypes(fx.scale_by_distance_over_gradients(), state_dtypes={"grad_sum_of_squares": torch.float32,
                                                                       "init_params": torch.float32})
    assert_dtypes(fx.scale_by_distance_over_gradients(param_dtype=None),
                  state_dtypes={"grad_sum_of_squares": torch.float32})
    state = fx.scale_by_distance_over_gradients().init({"s": torch.tensor(2.0)})
    assert state.grad_sum_of_squares["s"].shape == (1,) and state.max_dist["s"].shape == ()


def test_distance_over_gradients_grad_is_finite_where_optaxs_is_nan():
    # At the first step p = p0, and Optax's sqrt(sum((p - p0)^2)) has a NaN gradient (jax.grad of its
    # update gives NaN); the norm here has gradient 0 there, and torch.func and autograd agree.
    def loss(w0):
        tx, w = fx.scale_by_distance_over_gradients(reps_rel=0.1), w0
        state = tx.init(w)
        for _ in range(3):
            u, state = tx.update(2 * w, state, w)
            w = fx.apply_updates(w, fx.tree.map(torch.neg, u))
        return (w ** 2).sum()

    w0 = torch.tensor([0.3, -1.2, 2.0])
    by_func = grad(loss)(w0)
    w = w0.clone().requires_grad_()
    (by_autograd,) = torch.autograd.grad(loss(w), w)
    assert torch.isfinite(by_func).all()
    assert_trees_close(by_autograd, by_func, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["scale_by_param_block_norm", "scale_by_param_block_rms", "adaptive_grad_clip",
                                  "scale_by_distance_over_gradients"])
def test_missing_params_are_named(name):
    tx = getattr(fx, name)(0.1) if name == "adaptive_grad_clip" else getattr(fx, name)()
    g = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=rf"{name}.*needs the params: call update\(updates, state, params\)"):
        tx.update(g, tx.init(g))


@pytest.mark.parametrize("build, match", [
    (lambda: fx.clip_by_block_rms(-1.0), "clip_by_block_rms: threshold=-1.0 must be >= 0"),
    (lambda: fx.adaptive_grad_clip(0.1, eps=-1.0), "adaptive_grad_clip: eps=-1.0 must be >= 0"),
    (lambda: fx.scale_by_param_block_norm(-1.0), "scale_by_param_block_norm: min_scale=-1.0 must be >= 0"),
    (lambda: fx.scale_by_param_block_rms(-1.0), "scale_by_param_block_rms: min_scale=-1.0 must be >= 0"),
    (lambda: fx.normalize_by_update_norm(eps=-1.0), "normalize_by_update_norm: eps=-1.0 must be >= 0"),
    (lambda: fx.normalize_by_update_norm(torch.ones(2)), "normalize_by_update_norm: scale_factor must be a number"),
    (lambda: fx.scale_by_distance_over_gradients(reps_rel=-1.0),
     "scale_by_distance_over_gradients: reps_rel=-1.0 must be >= 0"),
], ids=["block_rms", "agc", "param_norm", "param_rms", "normalize", "normalize_tensor", "dog"])
def test_bad_hyperparameters_are_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# --- hypergradients against jax.grad --------------------------------------------------------------

# id -> (h -> fxtrain transform, (optax, h) -> Optax's, value of h); each followed by a step of -0.1
HYPER = {
    "clip_by_block_rms.threshold": (lambda h: fx.clip_by_block_rms(h), lambda o, h: o.clip_by_block_rms(h), 0.3),
    "adaptive_grad_clip.clipping": (lambda h: fx.adaptive_grad_clip(h), lambda o, h: o.adaptive_grad_clip(h), 0.2),
    "normalize_by_update_norm.scale_factor": (lambda h: fx.normalize_by_update_norm(h),
                                              lambda o, h: o.normalize_by_update_norm(h), 2.0),
    "scale_by_distance_over_gradients.reps_rel": (lambda h: fx.scale_by_distance_over_gradients(h),
                                                  lambda o, h: o.scale_by_distance_over_gradients(h), 0.1),
}


def _meta_loss(tx, params, tree_map, apply):
    """``sum(w^2)`` after 3 steps of ``-0.1 * tx(2 w)`` (the gradients of that same loss)."""
    state = tx.init(params)
    for _ in range(3):
        u, state = tx.update(tree_map(lambda w: 2 * w, params), state, params)
        params = apply(params, tree_map(lambda x: -0.1 * x, u))
    return sum((w * w).sum() for w in (params["w"], params["b"]))


@pytest.mark.optax
@pytest.mark.parametrize("case", list(HYPER))
def test_hypergradient_matches_optax(case):
    import jax
    import jax.numpy as jnp

    optax = pytest.importorskip("optax")
    ours, theirs, value = HYPER[case]
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=g), "b": torch.randn(3, generator=g)}
    jparams = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    expected = jax.grad(lambda h: _meta_loss(theirs(optax, h), jparams, jax.tree.map, optax.apply_updates))(
        jnp.float32(value))
    actual = grad(lambda h: _meta_loss(ours(h), params, fx.tree.map, fx.apply_updates))(torch.tensor(value))
    assert float(expected) != 0.0
    np.testing.assert_allclose(actual.item(), float(expected), rtol=1e-4, atol=1e-5)
