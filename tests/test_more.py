"""The smaller contrib optimizers (fxtrain/contrib/_more.py): Optax parity with default and other arguments,
Optax's examples, dtypes, errors."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests._parity import (assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, grads, noise,
                           state_leaves_close)
from tests.cases.contrib_b import with_schedules

C = fx.contrib


def _quadratic(tx, steps):
    params = torch.tensor([1.0, 2.0, 3.0])
    state, values = tx.init(params), []
    for _ in range(steps):
        u, state = tx.update(2 * params, state, params, value=(params ** 2).sum())  # extra args are ignored
        params = fx.apply_updates(params, u)
        values.append(float((params ** 2).sum()))
    return values


def test_optax_examples():  # the examples of Optax's dog and dowg docstrings
    assert _quadratic(C.dowg(), 5) == pytest.approx([13.925367, 13.872763, 13.775433, 13.596172, 13.268837],
                                                    rel=1e-6)
    assert all(13.99 < v < 14.0 for v in _quadratic(C.dog(), 5))


@pytest.mark.parametrize("build", [lambda: C.dog(init_step=("learning_rate", 0.1)), lambda: C.dowg(),
                                   lambda: C.cocob(), lambda: C.cocob(weight_decay=1e-2), lambda: C.madgrad(0.1),
                                   lambda: C.dadapt_adamw()],
                         ids=["dog", "dowg", "cocob", "cocob_decay", "madgrad", "dadapt_adamw"])
def test_reaches_the_minimum(build):  # Optax's common test, on the parabola, with fewer steps
    target = torch.tensor([1.0, -1.0, 1.0])
    params, tx = torch.tensor([-1.0, 10.0, 1.0]), build()
    state = tx.init(params)
    for _ in range(500):
        u, state = tx.update(2 * (params - target), state, params)
        params = fx.apply_updates(params, u)
    torch.testing.assert_close(params, target, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("build", [lambda: C.dog(weight_decay=1e-2), lambda: C.dowg(weight_decay=1e-2),
                                   lambda: C.cocob(weight_decay=1e-2), lambda: C.madgrad(1e-2, weight_decay=1e-2),
                                   lambda: C.mechanize(fx.adam(1.0)), lambda: C.dadapt_adamw(weight_decay=1e-2)],
                         ids=["dog", "dowg", "cocob", "madgrad", "mechanize", "dadapt_adamw"])
def test_pure_dtypes_and_none_leaves(build):
    tx = build()
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"scale_by_dog: init_step=\('lr', \.\.\.\) must start with one of"):
        C.dog(init_step=("lr", 0.1))
    with pytest.raises(ValueError, match=r"scale_by_dowg: eps=-1.0 must be >= 0"):
        C.dowg(eps=-1.0)
    with pytest.raises(ValueError, match=r"dog: learning_rate=-1.0 must be >= 0"):
        C.dog(-1.0)
    for tx, name in [(C.scale_by_dog(("distance", 1.0)), "scale_by_dog"), (C.scale_by_cocob(), "scale_by_cocob"),
                     (C.scale_by_madgrad(0.1), "scale_by_madgrad")]:
        with pytest.raises(ValueError, match=rf"{name} needs the params: call update\(updates, state, params\)"):
            tx.update(torch.ones(2), tx.init(torch.ones(2)))
    with pytest.raises(ValueError, match=r"scale_by_cocob: alpha=-1.0 must be >= 0"):
        C.cocob(alpha=-1.0)


@pytest.mark.parametrize("build", [lambda: C.dog(init_step=("distance", 0.1)), lambda: C.mechanize(fx.adam(1.0))],
                         ids=["dog", "mechanize"])
def test_gradient_through_updates_is_finite(build):
    # Optax's is NaN: a sqrt at 0 on the first update (dog: the distance |x_0 - x_0|; mechanize: sqrt(v)).
    tx = build()

    def loss(p):
        state = tx.init(p)
        for _ in range(2):
            u, state = tx.update(2 * p, state, p)
            p = fx.apply_updates(p, u)
        return (p ** 2).sum()

    assert torch.isfinite(torch.func.grad(loss)(torch.tensor([1.0, 2.0]))).all()


def test_dog_default_init_under_vmap_and_grad():
    """Issue 25: dog's default init (the heuristic r_eps = a (1 + |x_0|)) took the norm through the packed
    kernel, which vmap cannot batch and which under grad raised an error about DTensor leaves."""
    tx = C.dog()
    members = [{"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(i), dtype=torch.float64),
                "b": torch.full((2,), 0.1 * i, dtype=torch.float64)} for i in range(3)]
    batched = torch.func.vmap(tx.init)(fx.tree.map(lambda *xs: torch.stack(xs), *members))
    for i, p in enumerate(members):
        assert_trees_close(fx.tree.map(lambda x: x[i], batched), tx.init(p), rtol=1e-15, atol=0)

    def loss(w):
        p = {"w": w, "b": torch.ones(2, dtype=torch.float64)}
        state = tx.init(p)
        for _ in range(3):
            u, state = tx.update(fx.tree.map(lambda x: x ** 3 + x, p), state, p)
            p = fx.apply_updates(p, u)
        return sum((x ** 2).sum() for x in fx.tree.leaves(p))

    w0 = members[1]["w"]
    by_grad = torch.func.grad(loss)(w0)
    h, fd = 1e-6, torch.zeros_like(w0)
    for i in range(w0.numel()):
        e = torch.zeros(w0.numel(), dtype=torch.float64)
        e[i] = h
        fd.view(-1)[i] = (loss(w0 + e.view_as(w0)) - loss(w0 - e.view_as(w0))) / (2 * h)
    torch.testing.assert_close(by_grad, fd, rtol=1e-6, atol=1e-9)


# Transforms that read the loss (value=): their own 20-step parity loop.
WITH_VALUE = {
    "momo-default": ("momo", {}),
    "momo-all": ("momo", {"learning_rate": "sched", "beta": 0.5, "lower_bound": 0.2, "weight_decay": 0.1}),
    "momo-adapt": ("momo", {"learning_rate": 0.5, "lower_bound": 0.1, "weight_decay": 0.01, "adapt_lower_bound": True}),
    "momo_adam-default": ("momo_adam", {}),
    "momo_adam-all": ("momo_adam", {"learning_rate": "sched", "b1": 0.8, "b2": 0.99, "eps": 1e-6,
                                    "lower_bound": 0.1, "weight_decay": 0.1}),
    "momo_adam-adapt": ("momo_adam", {"learning_rate": 0.1, "lower_bound": 0.5, "adapt_lower_bound": True}),
}


def _loss(params):
    return 0.25 * sum((p * p).sum() for p in fx.tree.leaves(params)) + 1.0


@pytest.mark.optax
@pytest.mark.parametrize("case", WITH_VALUE.values(), ids=WITH_VALUE.keys())
def test_value_reading_transforms_match_optax(case):
    import jax
    optax = pytest.importorskip("optax")
    name, kwargs = case
    tx = getattr(C, name)(**with_schedules(fx, kwargs))
    otx = getattr(optax.contrib, name)(**with_schedules(optax, kwargs))
    params = nested_params()
    jparams = to_jnp(params)
    state, ostate = tx.init(params), otx.init(jparams)
    for k in range(20):
        g, value = grads(params, k), _loss(params)
        u, state = (fx.update_(tx, g, state, params, value=value) if k % 2
                    else tx.update(g, state, params, value=value))
        og = jax.tree.map(lambda x, n: 0.5 * x + n, jparams, to_jnp(noise(k)))
        ou, ostate = otx.update(og, ostate, jparams, value=_loss(from_jnp(jparams)).numpy())
        assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
        params, jparams = fx.apply_updates(params, u), optax.apply_updates(jparams, ou)
    state_leaves_close(state, ostate)


@pytest.mark.parametrize("name", ["momo", "momo_adam"])
def test_momo_reaches_the_minimum_and_needs_the_value(name):
    target = torch.tensor([1.0, -1.0, 1.0])
    params, tx = torch.tensor([-1.0, 10.0, 1.0]), getattr(C, name)(0.1)  # Optax's common test's rate
    state = tx.init(params)
    for _ in range(300):
        u, state = tx.update(2 * (params - target), state, params, value=((params - target) ** 2).sum())
        params = fx.apply_updates(params, u)
    torch.testing.assert_close(params, target, rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match=rf"{name} needs the loss value at update"):
        tx.update(params, state, params)
    assert fx.traits(tx).extra_args and not fx.traits(tx).elementwise


MECHANIZE = {
    "sgd": (lambda lib: lib.sgd(1.0, momentum=0.9), {}),
    "adam_all": (lambda lib: lib.adam(lib.linear_schedule(1.0, 0.5, 10)),
                 {"weight_decay": 0.1, "eps": 1e-6, "s_init": 1e-4, "num_betas": 3}),
}


@pytest.mark.optax
@pytest.mark.parametrize("case", MECHANIZE.values(), ids=MECHANIZE.keys())
def test_mechanize_matches_optax(case):
    optax = pytest.importorskip("optax")
    base, kwargs = case
    assert_parity(C.mechanize(base(fx), **kwargs), optax.contrib.mechanize(base(optax), **kwargs))


def test_mechanized_first_step():  # Optax's test_mechanized
    @fx.transform
    def inner(step_size):  # SGD with a state, checking that it gets the params
        def init_fn(params):
            return (fx.tree.zeros_like(params),)

        def update_fn(updates, state, params=None):
            assert fx.tree.structure(params) == fx.tree.structure(updates)
            return fx.tree.map(lambda u: step_size * u, updates), (fx.apply_updates(state[0], updates),)
        return fx.GradientTransformation(init_fn, update_fn)

    params = {"x": torch.tensor(3.0), "y": torch.tensor(-3.0)}
    tx = C.mechanize(inner(-0.1), weight_decay=1e-2, eps=1e-10, s_init=1e-8, num_betas=6)
    u, state = tx.update({"x": torch.tensor(2.0), "y": torch.tensor(-2.0)}, tx.init(params), params)
    torch.testing.assert_close(state.m, torch.full((6,), 1e-10))
    torch.testing.assert_close(state.v, torch.zeros(6))
    torch.testing.assert_close(state.s, torch.full((6,), 1.6666667e-09))
    assert_trees_close(fx.apply_updates(params, u), params)
    assert all(torch.isfinite(x).all() for x in fx.tree.leaves((u, state)))


def test_mechanize_passes_extra_args_and_needs_params():
    tx = C.mechanize(C.momo(0.1))
    p = torch.tensor([1.0, 2.0])
    u, _ = tx.update(2 * p, tx.init(p), p, value=(p ** 2).sum())  # reaches momo
    assert torch.isfinite(u).all()
    with pytest.raises(ValueError, match=r"mechanize needs the params: call update"):
        tx.update(2 * p, tx.init(p))
    with pytest.raises(ValueError, match=r"mechanize: num_betas=0 must be an int >= 1"):
        C.mechanize(fx.sgd(1.0), num_betas=0)


def _complex_params(seed):
    g = torch.Generator().manual_seed(seed)
    return {"z": torch.complex(torch.randn(3, 2, generator=g), torch.randn(3, 2, generator=g)),
            "w": torch.randn(4, generator=g)}


@pytest.mark.optax
@pytest.mark.parametrize("inner", ["adam", "param_block_norm"])
def test_split_real_and_imaginary_matches_optax_on_complex64(inner):
    optax = pytest.importorskip("optax")
    build = {"adam": lambda lib: lib.chain(lib.scale_by_adam(b1=0.8), lib.scale(-0.05)),
             "param_block_norm": lambda lib: lib.chain(lib.scale_by_param_block_norm(), lib.scale(-0.05))}[inner]
    tx, otx = C.split_real_and_imaginary(build(fx)), optax.contrib.split_real_and_imaginary(build(optax))
    params = _complex_params(0)
    jparams = to_jnp(params)
    state, ostate = tx.init(params), otx.init(jparams)
    for k in range(20):
        g = fx.tree.map(lambda p, n: 0.5 * p + n, params, _complex_params(100 + k))
        u, state = fx.update_(tx, fx.tree.clone(g), state, params) if k % 2 else tx.update(g, state, params)
        ou, ostate = otx.update(to_jnp(g), ostate, jparams)
        assert u["z"].dtype == torch.complex64 and u["w"].dtype == torch.float32
        assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
        params, jparams = fx.apply_updates(params, u), optax.apply_updates(jparams, ou)
    state_leaves_close(state, ostate)


@pytest.mark.parametrize("inner", ["scale_by_adam", "scale_by_param_block_norm"])
def test_split_complex_equals_the_real_pair(inner):  # Optax's test_split_real_and_imaginary
    x = torch.tensor([[0.1, 0.2, 0.3], [-0.1, -0.2, -0.3]])
    y = torch.tensor([[0.5, -0.5, 0.0], [0.1, 0.3, -0.2]])
    z = torch.complex(x, y)
    real_tx, complex_tx = getattr(fx, inner)(), C.split_real_and_imaginary(getattr(fx, inner)())
    real_state, complex_state = real_tx.init((x, y)), complex_tx.init(z)

    def step(loss_fn, tx, params, state):
        grads, loss = torch.func.grad_and_value(loss_fn)(params)  # torch's complex gradient needs no conjugation
        updates, state = tx.update(grads, state, params)
        return loss, grads, fx.apply_updates(params, updates), state

    complex_loss = lambda z: (z.conj() * z).real.sum()  # noqa: E731
    for _ in range(3):
        loss, (gx, gy), (x, y), real_state = step(lambda p: complex_loss(torch.complex(*p)), real_tx, (x, y),
                                                  real_state)
        loss_c, gz, z, complex_state = step(complex_loss, complex_tx, z, complex_state)
        torch.testing.assert_close(loss, loss_c, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.complex(gx, gy), gz, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.complex(x, y), z, rtol=1e-6, atol=0)
