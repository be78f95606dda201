"""scale_by_adam (fxtrain/transforms/_adam.py): Optax parity, in-place kernel, dtypes, errors."""

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.testing import nested_params
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, grads
from tests.cases.core import ADAM_VARIANTS as VARIANTS


@pytest.mark.optax
@pytest.mark.parametrize("nesterov", [False, True])
def test_mu_dtype_matches_optax(nesterov):
    """The update uses the new first moment at full precision; the state keeps it in bfloat16 (Optax)."""
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.scale_by_adam(mu_dtype=torch.bfloat16, nesterov=nesterov), fx.scale(-0.05)),
                  optax.chain(optax.scale_by_adam(mu_dtype="bfloat16", nesterov=nesterov), optax.scale(-0.05)))


@pytest.mark.optax
@pytest.mark.parametrize("nesterov", [False, True])
def test_tensor_hyperparameters_match_optax_inject_hyperparams(nesterov):
    """0-dim tensors (what inject_hyperparams passes) give Optax's results with float32 array
    hyperparameters; no host sync is needed."""
    optax = pytest.importorskip("optax")
    hp = {"b1": 0.8, "b2": 0.99, "eps": 1e-6, "eps_root": 1e-8}
    tx = fx.chain(fx.scale_by_adam(**{k: torch.tensor(v) for k, v in hp.items()}, nesterov=nesterov),
                  fx.scale(-0.05))
    otx = optax.chain(optax.inject_hyperparams(optax.scale_by_adam, static_args="nesterov")(**hp, nesterov=nesterov),
                      optax.scale(-0.05))
    assert_parity(tx, otx, check_state=False)


def test_first_step_is_the_sign():
    # Up to 1 - 0.999 ** 1 rounded in float32, as in Optax (torch.optim uses float64 on the host).
    g = {"w": torch.tensor([3.0, -0.5, 0.0])}
    u, state = fx.scale_by_adam(eps=0.0).update(g, fx.scale_by_adam().init(g))
    torch.testing.assert_close(u["w"][:2], torch.tensor([1.0, -1.0]), rtol=1e-5, atol=0)
    assert u["w"][2].isnan()  # 0 / 0, as Optax with eps=0
    assert int(state.count) == 1 and state.count.dtype == torch.int32


def test_donated_kernel_writes_into_the_gradient_buffers():
    """The donated (in-place) kernel returns the gradient tensors themselves: nothing parameter-sized
    is allocated for the output."""
    tx = fx.adamw(1e-3, weight_decay=0.1)
    params = nested_params()
    g = grads(params, 0)
    u, _ = fx.update_(tx, g, tx.init(params), params)
    assert all(a is b for a, b in zip(fx.tree.leaves(u), fx.tree.leaves(g)))


def test_pure_and_none_leaves():
    for kwargs in VARIANTS.values():
        assert_pure(fx.scale_by_adam(**kwargs))
        assert_none_passthrough(fx.scale_by_adam(**kwargs))


@pytest.mark.parametrize("nesterov", [False, True])
def test_bfloat16_keeps_dtypes(nesterov):
    assert_dtypes(fx.scale_by_adam(nesterov=nesterov))
    assert_dtypes(fx.scale_by_adam(mu_dtype=torch.float32, nesterov=nesterov), state_dtypes={"mu": torch.float32})
    assert_dtypes(fx.scale_by_adam(mu_dtype="float32"), state_dtypes={"mu": torch.float32})


@pytest.mark.parametrize("arg", ["b1", "b2", "eps", "eps_root"])
def test_negative_hyperparameter_names_it(arg):
    with pytest.raises(ValueError, match=rf"scale_by_adam: {arg}=-0.1 must be >= 0"):
        fx.scale_by_adam(**{arg: -0.1})


def test_bad_mu_dtype():
    with pytest.raises(TypeError, match="mu_dtype"):
        fx.scale_by_adam(mu_dtype="float33")


def test_updates_not_matching_state_names_the_path():
    tx = fx.scale_by_adam()
    params = nested_params()
    state = tx.init(params)
    g = grads(params, 0)
    g["blocks"][1] = (g["blocks"][1][0],)
    with pytest.raises(ValueError, match=r"scale_by_adam\(\): updates do not match the state: .* at 'blocks\.1"):
        tx.update(g, state)


def test_repr():
    assert repr(fx.scale_by_adam(b2=0.95, nesterov=True)) == "scale_by_adam(b2=0.95, nesterov=True)"


# --- gradients through updates where a gradient coordinate is exactly 0 (issue 25) ----------------
# A dead unit: its gradient is exactly 0 whatever the params (its input column is 0), and the chain rule
# reaches it through a product (not through relu's mask). eps_root > 0 is Optax's remedy for exactly this
# meta-learning case: jax.grad through Optax's Adam is finite there. fxtrain's pure path divided
# 1 / (d / m), whose derivative at m = 0 is 0 * inf = NaN.
DEAD_INPUTS = torch.tensor([[1.0, 0.0], [0.5, 0.0], [-1.5, 0.7]], dtype=torch.float64)
EPS_ROOT_CASES = {
    "adam": (lambda: fx.adam(0.1, eps_root=1e-8), lambda o: o.adam(0.1, eps_root=1e-8)),
    "adamw": (lambda: fx.adamw(0.1, eps_root=1e-8, weight_decay=0.1),
              lambda o: o.adamw(0.1, eps_root=1e-8, weight_decay=0.1)),
    "lamb": (lambda: fx.lamb(0.1, eps_root=1e-8), lambda o: o.lamb(0.1, eps_root=1e-8)),
    "adam_nesterov": (lambda: fx.adam(0.1, eps_root=1e-8, nesterov=True),
                      lambda o: o.adam(0.1, eps_root=1e-8, nesterov=True)),
    "nadamw": (lambda: fx.nadamw(0.1, eps_root=1e-8), lambda o: o.nadamw(0.1, eps_root=1e-8)),
}


def _dead_inner(w, c=DEAD_INPUTS):
    return ((c * w) ** 2).sum() + ((c * w) ** 3).sum()  # gradient 0 wherever c is 0


def _maml_loss(tx, w, inner_grad, apply, steps=3):
    state = tx.init(w)
    for _ in range(steps):
        u, state = tx.update(inner_grad(w), state, w)
        w = apply(w, u)
    return (w ** 2).sum() + w.sum()


def _fx_maml(tx, w):
    return _maml_loss(tx, w, torch.func.grad(_dead_inner), fx.apply_updates)


@pytest.mark.parametrize("case", EPS_ROOT_CASES)
def test_grad_through_updates_with_eps_root_is_finite_at_zero_gradients(case):
    w0 = torch.tensor([[0.3, -0.4], [0.8, 0.2], [-0.5, 0.6]], dtype=torch.float64)
    by_func = torch.func.grad(lambda w: _fx_maml(EPS_ROOT_CASES[case][0](), w))(w0)
    assert by_func.isfinite().all(), by_func
    w = w0.clone().requires_grad_()
    (by_autograd,) = torch.autograd.grad(_fx_maml(EPS_ROOT_CASES[case][0](), w), w)
    torch.testing.assert_close(by_autograd, by_func, rtol=1e-12, atol=1e-12)
    # central differences in float64: the dead coordinates never move, their derivative is that of the loss
    fd, h = torch.zeros_like(w0), 1e-6
    with torch.no_grad():
        for i in range(w0.numel()):
            e = torch.zeros_like(w0).view(-1)
            e[i] = h
            e = e.view_as(w0)
            fd.view(-1)[i] = (_fx_maml(EPS_ROOT_CASES[case][0](), w0 + e)
                              - _fx_maml(EPS_ROOT_CASES[case][0](), w0 - e)) / (2 * h)
    torch.testing.assert_close(by_func, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.optax
@pytest.mark.parametrize("case", [k for k, v in EPS_ROOT_CASES.items() if v[1] is not None])
def test_grad_through_updates_with_eps_root_matches_optax(case):
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp

    w0 = torch.tensor([[0.3, -0.4], [0.8, 0.2], [-0.5, 0.6]], dtype=torch.float64)
    with jax.enable_x64(True):
        c = jnp.asarray(DEAD_INPUTS.numpy())
        expected = jax.grad(lambda w: _maml_loss(EPS_ROOT_CASES[case][1](optax), w,
                                                 jax.grad(lambda v: _dead_inner(v, c)), optax.apply_updates))(
            jnp.asarray(w0.numpy()))
        expected = torch.from_numpy(np.asarray(expected).copy())
    assert expected.isfinite().all()
    actual = torch.func.grad(lambda w: _fx_maml(EPS_ROOT_CASES[case][0](), w))(w0)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_eps_root_donated_updates_unchanged(nesterov):
    """The donated kernel keeps its 1 / (d / m) form (no temporary); the pure path under autograd divides
    m / d: equal to rounding, and 0 where the gradient is 0."""
    tx = fx.scale_by_adam(eps_root=1e-8, nesterov=nesterov)
    params = nested_params(dtype=torch.float64)
    state = tx.init(params)
    for k in range(3):
        g = grads(params, k)
        g["dense"]["w"][0] = 0.0
        with torch.enable_grad():
            pure, new_state = tx.update(g, state, params)
        donated, _ = fx.update_(tx, fx.tree.clone(g), fx.tree.clone(state), params)
        fx.testing.assert_trees_close(pure, donated, rtol=1e-14, atol=0)
        assert (pure["dense"]["w"][0] == 0).all()
        state = new_state
