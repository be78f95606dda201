"""Adam's relatives (fxtrain/transforms/_adaptive.py): Optax parity with default and other arguments,
Optax's own test cases (alias_test.py's test_optimization targets, transform_test.py's cases), errors."""

import warnings

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, nested_params
from tests._parity import assert_parity, ndim_mask, run_fx, run_optax
from tests.cases.adaptive import build


@pytest.mark.optax
@pytest.mark.parametrize("weight_decay", [0.1, "schedule"])
def test_adabelief_weight_decay_matches_optax(weight_decay):
    """adabelief(weight_decay=, weight_decay_mask=) as current Optax (issue 25: fxtrain lacked them):
    chain(scale_by_belief, add_decayed_weights(weight_decay, mask), scale_by_learning_rate); default None,
    no decay. The installed Optax may predate the argument: then its definition is built from its pieces."""
    import inspect

    optax = pytest.importorskip("optax")
    assert inspect.signature(fx.adabelief).parameters["weight_decay"].default is None
    wd = (lambda lib: lib.linear_schedule(0.2, 0.0, 10)) if weight_decay == "schedule" else (lambda lib: weight_decay)
    tx = fx.adabelief(1e-2, weight_decay=wd(fx), weight_decay_mask=ndim_mask)
    if "weight_decay" in inspect.signature(optax.adabelief).parameters:
        otx = optax.adabelief(1e-2, weight_decay=wd(optax), weight_decay_mask=ndim_mask)
    else:
        otx = optax.chain(optax.scale_by_belief(), optax.add_decayed_weights(wd(optax), ndim_mask),
                          optax.scale_by_learning_rate(1e-2))
    assert_parity(tx, otx, check_state=False)
    assert repr(fx.adabelief(1e-2)) == "adabelief(0.01)"  # None: the chain without decay, as before


@pytest.mark.optax
@pytest.mark.parametrize("name", ["yogi"])
def test_tensor_hyperparameters_match_optax_inject_hyperparams(name):
    optax = pytest.importorskip("optax")
    kwargs = {"learning_rate": 1e-2, "b1": 0.8, "b2": 0.9}
    tx = fx.inject_hyperparams(getattr(fx, name))(**kwargs)
    otx = optax.inject_hyperparams(getattr(optax, name))(**kwargs)
    assert_parity(tx, otx, check_state=False)


@pytest.mark.optax
def test_radam_default_b2_matches_optax_computed_in_float64():
    """fxtrain computes RAdam's rho_t in float64: it is 1999 - 2t b2^t / (1 - b2^t) with b2 = 0.999, which
    float32 (Optax's, in its default precision) gets wrong by 0.7% at t = 5 (4.9607 for 4.9960), the
    rectification r_5 by 2% (0.016961 for 0.017312). Against Optax under jax x64 the run agrees to 1e-10."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    params = fx.tree.map(lambda x: x.double(), nested_params())
    tx, otx = fx.radam(5e-3), optax.radam(5e-3)
    ours, p_ours, _ = run_fx(tx, params, steps=10)  # rectified from step 5
    with jax.enable_x64(True):
        theirs, p_theirs, _ = run_optax(optax.GradientTransformation(otx.init, jax.jit(otx.update)), params, steps=10)
    for k in range(len(ours)):
        assert_trees_close(ours[k], theirs[k], rtol=1e-10, atol=1e-13)
    assert_trees_close(p_ours, p_theirs, rtol=1e-12, atol=1e-13)
    # float32: the float64 numbers to float32 rounding, not Optax's float32 ones
    ours32, _, _ = run_fx(tx, nested_params(), steps=10)
    for k in range(len(ours)):
        assert_trees_close(ours32[k], fx.tree.map(lambda x: x.float(), theirs[k]), rtol=1e-4, atol=1e-7)


# --- Optax's alias_test.py: test_optimization, as trajectories ----------------------------------------
# Optax runs 10000 steps and checks the optimum within 3e-2; here fxtrain's params equal Optax's (jitted)
# after every one of 50 steps (parabola) or 30 (Rosenbrock, whose valley amplifies rounding), float32 and
# complex64 (Optax skips complex for optimistic_gradient_descent, optimistic_adam, adadelta and adan).
# Optax's optimizers and arguments, from its _OPTIMIZERS_UNDER_TEST:
OPTAX_UNDER_TEST = [
    ("adabelief", {"learning_rate": 1e-2}),
    ("adadelta", {"learning_rate": 0.1}),
    ("adamax", {"learning_rate": 1e-1}),
    ("adamaxw", {"learning_rate": 1e-1}),
    ("adan", {"learning_rate": 1e-1}),
    ("amsgrad", {"learning_rate": 1e-1}),
    ("nadam", {"learning_rate": 1e-2}),
    ("nadamw", {"learning_rate": 1e-2}),
    ("novograd", {"learning_rate": 1e-3}),
    ("optimistic_adam", {"learning_rate": 2e-3}),
    ("optimistic_adam_v2", {"learning_rate": 2e-3}),
    ("optimistic_gradient_descent", {"learning_rate": 2e-3, "alpha": 0.7, "beta": 0.1}),
    ("radam", {"learning_rate": 5e-3}),
    ("yogi", {"learning_rate": 1e-1}),
]
NO_COMPLEX = {"optimistic_gradient_descent", "optimistic_adam", "adadelta", "adan"}


def _target(kind, dtype):
    """(initial params, objective) of Optax's _setup_parabola / _setup_rosenbrock, in torch."""
    complex_ = dtype.is_complex
    if kind == "parabola":
        final = torch.tensor([1.0, -1.0, 1.0], dtype=dtype) * ((1 + 1j) if complex_ else 1)
        return torch.tensor([-1.0, 10.0, 1.0], dtype=dtype), lambda p: ((p - final).abs() ** 2).sum()
    a, b = (1 + 1j) if complex_ else 1.0, 100.0
    return torch.zeros(2, dtype=dtype), lambda p: (a - p[0]).abs() ** 2 + b * (p[1] - p[0] ** 2).abs() ** 2


def _target_jax(kind, dtype):
    import jax.numpy as jnp

    complex_ = dtype.is_complex
    if kind == "parabola":
        final = jnp.array([1.0, -1.0, 1.0]) * ((1 + 1j) if complex_ else 1)
        return lambda p: jnp.sum(jnp.abs(p - final) ** 2)
    a = (1 + 1j) if complex_ else 1.0
    return lambda p: jnp.abs(a - p[0]) ** 2 + 100.0 * jnp.abs(p[1] - p[0] ** 2) ** 2


@pytest.mark.optax
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=["f32", "c64"])
@pytest.mark.parametrize("target", ["parabola", "rosenbrock"])
@pytest.mark.parametrize("name,kwargs", OPTAX_UNDER_TEST, ids=[n for n, _ in OPTAX_UNDER_TEST])
def test_optimization_follows_optax(name, kwargs, target, dtype):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    if dtype.is_complex and name in NO_COMPLEX:
        pytest.skip(f"Optax: {name} does not support complex parameters")
    steps = 50 if target == "parabola" else 30
    init, objective = _target(target, dtype)
    tx, otx = build(fx, name, kwargs), build(optax, name, kwargs)
    ojective = _target_jax(target, dtype)

    def trajectory(p):  # Optax's test conjugates complex gradients
        def step(carry, _):
            p, s = carry
            u, s = otx.update(jax.grad(ojective)(p).conj(), s, p)
            p = optax.apply_updates(p, u)
            return (p, s), p
        return jax.lax.scan(step, (p, otx.init(p)), None, length=steps)[1]

    theirs = np.asarray(jax.jit(trajectory)(jax.numpy.asarray(init.numpy())))
    p, state = init, tx.init(init)
    for k in range(steps):
        w = p.clone().requires_grad_()
        (g,) = torch.autograd.grad(objective(w), w)  # for complex p: already the conjugate JAX's test takes
        u, state = fx.update_(tx, g, state, p)
        p = fx.apply_updates(p, u)
        np.testing.assert_allclose(p.numpy(), theirs[k], rtol=1e-4, atol=1e-5, err_msg=f"step {k}")


@pytest.mark.parametrize("name", ["yogi"])
def test_parabola_reaches_the_optimum(name):
    """Optax's own criterion (within 3e-2 of the optimum after 10000 steps) on the float32 parabola, for an
    optimizer that gets there in 1000 steps (the trajectories above equal Optax's)."""
    kwargs = dict(OPTAX_UNDER_TEST)[name]
    init, objective = _target("parabola", torch.float32)
    tx, p = getattr(fx, name)(**kwargs), init
    state = tx.init(p)
    for _ in range(1000):
        w = p.clone().requires_grad_()
        (g,) = torch.autograd.grad(objective(w), w)
        u, state = fx.update_(tx, g, state, p)
        p = fx.apply_updates_(p, u)
    torch.testing.assert_close(p, torch.tensor([1.0, -1.0, 1.0]), rtol=3e-2, atol=3e-2)


def test_optimistic_adam_warns_as_optax():
    with pytest.warns(DeprecationWarning, match="use `optimistic_adam_v2` instead"):
        fx.optimistic_adam(2e-3)


@pytest.mark.parametrize("name,kwargs", OPTAX_UNDER_TEST, ids=[n for n, _ in OPTAX_UNDER_TEST])
def test_optimizers_accept_extra_args_and_inject_hyperparams(name, kwargs):
    """Optax's test_optimizers_accept_extra_args and test_optimizers_can_be_wrapped_in_inject_hyperparams:
    an unexpected keyword argument is dropped; the injected optimizer gives the same update and state."""
    params = [-torch.ones(2, 3), torch.ones(2, 5, 2)]
    grads = [torch.ones(2, 3), -torch.ones(2, 5, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        tx = getattr(fx, name)(**kwargs)
        u, state = tx.update(grads, tx.init(params), params, unexpected_extra_args_your_optimizer_doesnt_expect=1)
        injected = fx.inject_hyperparams(getattr(fx, name))(**kwargs)
        u_inj, state_inj = injected.update(grads, injected.init(params), params)
    assert_trees_close(u_inj, u, rtol=1e-3)
    assert_trees_close(state_inj.inner_state, state, rtol=1e-4)


# --- Optax's transform_test.py ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["scale_by_adadelta", "scale_by_adamax", "scale_by_adan"])
def test_scalers(name):
    """Optax's test_scalers: one step from large updates leaves everything finite, shapes kept."""
    params = (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    per_step_updates = (torch.tensor([500.0, 5.0]), torch.tensor([300.0, 3.0]))
    tx = getattr(fx, name)()
    state = tx.init(params)
    assert all(x.isfinite().all() for x in fx.tree.leaves(state))
    updates, state = tx.update(per_step_updates, state, params)
    assert all(x.isfinite().all() for x in fx.tree.leaves((updates, state)))
    assert [u.shape for u in updates] == [p.shape for p in params]


def test_scale_by_optimistic_gradient():
    """Optax's test: the first update is the gradient (issue optax#1082), then 2 g_t - g_{t-1}."""
    tx = fx.scale_by_optimistic_gradient()
    state = tx.init(torch.tensor(10.0))
    outs = []
    for g in (2.0, 3.0, 4.0):
        u, state = tx.update(torch.tensor(g), state)
        outs.append(u.item())
    assert outs == [2.0, 2 * 3.0 - 2.0, 2 * 4.0 - 3.0]


# --- fxtrain's own checks -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,wrapped", [("nadam", "adam"), ("nadamw", "adamw")])
def test_nadam_is_adam_with_nesterov_under_its_own_name(name, wrapped):
    tx = getattr(fx, name)(1e-2)
    assert repr(tx) == f"{name}(0.01)"
    assert repr(getattr(fx, name)(1e-2, nesterov=False)) == f"{name}(0.01, nesterov=False)"
    ref = getattr(fx, wrapped)(1e-2, nesterov=True)
    ours, _, s_ours = run_fx(tx, nested_params(), steps=3)
    theirs, _, s_theirs = run_fx(ref, nested_params(), steps=3)
    assert_trees_close(ours, theirs, rtol=0, atol=0)
    assert fx.tree.structure(s_ours) == fx.tree.structure(s_theirs)


def test_novograd_first_step_and_traits():
    g = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 2.0])}
    tx = fx.scale_by_novograd(eps=0.0)
    u, state = tx.update(g, tx.init(g))
    assert state.nu["w"].item() == 25.0 and state.nu["b"].item() == 4.0  # the first norms, not (1 - b2) of them
    torch.testing.assert_close(u["w"], torch.tensor([0.6, 0.8]))
    assert not fx.is_elementwise(fx.novograd(1e-3))
    assert fx.is_elementwise(fx.adan(1e-3)) and fx.is_elementwise(fx.scale_by_optimistic_gradient())


def test_novograd_weight_decay_needs_params():
    tx = fx.scale_by_novograd(weight_decay=0.1)
    g = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"scale_by_novograd\(weight_decay=0.1\): weight_decay=0.1 needs the params"):
        tx.update(g, tx.init(g))


@pytest.mark.parametrize("name,arg", [("yogi", "b1"), ("scale_by_yogi", "b2"), ("adan", "b3"), ("radam", "threshold"),
                                      ("scale_by_adadelta", "rho"), ("optimistic_adam_v2", "beta")])
def test_negative_hyperparameter_names_it(name, arg):
    args = () if name.startswith("scale_by") else (0.1,)
    with pytest.raises(ValueError, match=rf"^{name}: {arg}=-0.5 must be >= 0"):
        getattr(fx, name)(*args, **{arg: -0.5})


def test_adadelta_refuses_learning_rate_none():
    """Optax's default (None) applies the unsigned direction, an ascent; the paper's method is 1.0."""
    with pytest.raises(ValueError, match="adadelta: learning_rate=None"):
        fx.adadelta()


def test_optimistic_adam_refuses_a_schedule():
    with pytest.raises(ValueError, match="optimistic_adam: learning_rate cannot be a schedule"), \
            pytest.warns(DeprecationWarning):
        fx.optimistic_adam(lambda count: 0.1)


def test_complex_maximum_and_sign_follow_optax():
    """Complex moments hold real values: AdaMax's maximum and Yogi's sign act on real parts (torch has
    neither for complex); one step against the formulas with |g| = 5."""
    g = {"w": torch.tensor([3 + 4j], dtype=torch.complex64)}
    u, state = fx.scale_by_adamax(eps=0.0).update(g, fx.scale_by_adamax(eps=0.0).init(g))
    assert state.nu["w"].tolist() == [5 + 0j]
    torch.testing.assert_close(u["w"], g["w"] / 5)
    tx = fx.scale_by_yogi(initial_accumulator_value=0.0)
    _, state = tx.update(g, tx.init(g))
    assert state.nu["w"].tolist() == [pytest.approx(0.001 * 25 + 0j)]
