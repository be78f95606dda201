"""Line searches (fxtrain/transforms/_linesearch.py): Optax parity on Optax's test problems, Optax's own test
cases (linesearch_test.py), value_and_grad_from_state, vmap (no host sync), errors."""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, to_jnp
from fxtrain.transforms import _linesearch


# Optax's test objectives (linesearch_test.get_problem), written once for torch and jax.numpy (``xnp``).
def _rosenbrock(x, xnp):
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def _himmelblau(x, xnp):
    return (x[0] ** 2 + x[1] - 11.0) ** 2 + (x[0] + x[1] ** 2 - 7.0) ** 2


def _matyas(x, xnp):
    return 0.26 * (x[0] ** 2 + x[1] ** 2) - 0.48 * x[0] * x[1]


def _eggholder(x, xnp):
    return (-(x[1] + 47) * xnp.sin(xnp.sqrt(xnp.abs(x[0] / 2.0 + x[1] + 47.0)))
            - x[0] * xnp.sin(xnp.sqrt(xnp.abs(x[0] - (x[1] + 47.0)))))


def _zakharov(x, xnp):
    ii = xnp.arange(1, x.shape[0] + 1, dtype=x.dtype)
    s2 = (0.5 * ii * x).sum()
    return (x ** 2).sum() + s2 ** 2 + s2 ** 4


def _polynomial(x, xnp):
    return -x - x ** 3 + x ** 4


def _exponential(x, xnp):
    return xnp.exp(-4 * x) + x ** 2


PROBLEMS = {"rosenbrock": (_rosenbrock, (16,)), "himmelblau": (_himmelblau, (2,)), "matyas": (_matyas, (2,)),
            "eggholder": (_eggholder, (2,)), "zakharov": (_zakharov, (6,)), "polynomial": (_polynomial, ()),
            "exponential": (_exponential, ())}


def _problem(name, seed=0):
    fn, shape = PROBLEMS[name]
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    precond = torch.rand(shape, generator=torch.Generator().manual_seed(seed + 100))
    return (lambda x: fn(x, torch)), (lambda x: fn(x, _jnp())), x0, precond


def _jnp():
    import jax.numpy as jnp

    return jnp


def run_fx(tx, fn, params, direction=None, guess=None, **fn_kwargs):
    """One update of the line search ``tx`` from ``params`` along ``direction`` (default: -gradient)."""
    grad, value = torch.func.grad_and_value(lambda p: fn(p, **fn_kwargs))(params)
    state = tx.init(params)
    if guess is not None:
        state = state._replace(learning_rate=torch.tensor(guess))
    u, state = tx.update(-grad if direction is None else direction, state, params, value=value, grad=grad,
                         value_fn=fn, **fn_kwargs)
    return fx.apply_updates(params, u), state


def run_optax(otx, fn, params, direction=None, guess=None):
    import jax
    import optax

    p = to_jnp(params)
    with jax.disable_jit():  # op by op: compiling Optax's loop costs ~1 s of CPU per objective
        value, grad = jax.value_and_grad(fn)(p)
        state = otx.init(p)
        if guess is not None:
            state = state._replace(learning_rate=jax.numpy.asarray(guess))
        u, state = otx.update(-grad if direction is None else to_jnp(direction), state, p, value=value,
                              grad=grad, value_fn=fn)
        return from_jnp(optax.apply_updates(p, u)), state


def assert_same_search(ours, theirs, rtol=1e-5, atol=1e-6):
    """Same new params and the same state (step size, value, gradient, number of trials, errors)."""
    (p, s), (op, os) = ours, theirs
    assert_trees_close(p, op, rtol=rtol, atol=atol)
    assert int(s.info.num_linesearch_steps) == int(os.info.num_linesearch_steps)
    for name in ("learning_rate", "value"):
        np.testing.assert_allclose(float(getattr(s, name)), float(getattr(os, name)), rtol=rtol, atol=atol,
                                   err_msg=name)
    for name, x in s.info._asdict().items():
        np.testing.assert_allclose(float(x), float(getattr(os.info, name)), rtol=1e-4, atol=1e-5, err_msg=name)
    if os.grad is None:  # backtracking without store_grad: Optax's None, fxtrain's EmptyState (no leaf)
        assert s.grad == fx.EmptyState()
    else:
        assert_trees_close(s.grad, from_jnp(os.grad), rtol=1e-4, atol=1e-5)


# --- backtracking ------------------------------------------------------------------------------------

BACKTRACKING = {
    "default": {},
    "increase_1": {"increase_factor": 1.0, "slope_rtol": 0.0},
    "increase_inf": {"increase_factor": math.inf, "atol": 1e-4, "rtol": 1e-4},
    "store_grad": {"store_grad": True, "decrease_factor": 0.5, "max_learning_rate": 2.0},
}


# Each setting on two of Optax's problems (all four on every setting cost more than they add).
BACKTRACKING_CASES = [(v, p) for i, v in enumerate(BACKTRACKING)
                      for p in (["rosenbrock", "himmelblau", "matyas", "eggholder"] * 2)[i: i + 2]]


@pytest.mark.optax
@pytest.mark.parametrize("variant,problem", BACKTRACKING_CASES)
def test_backtracking_matches_optax(variant, problem):
    optax = pytest.importorskip("optax")
    kwargs = BACKTRACKING[variant]
    fn, jfn, x0, _ = _problem(problem)
    ours = run_fx(fx.scale_by_backtracking_linesearch(max_backtracking_steps=50, **kwargs), fn, x0)
    theirs = run_optax(optax.scale_by_backtracking_linesearch(max_backtracking_steps=50, **kwargs), jfn, x0)
    assert_same_search(ours, theirs)
    # Optax's test: the step size ensures sufficient decrease
    (p, s), args = ours, {"slope_rtol": 1e-4, "atol": 0.0, "rtol": 0.0, **kwargs}
    grad, value = torch.func.grad_and_value(fn)(x0)
    slope = -(grad * grad).sum()
    assert fn(p) <= (1 + args["rtol"]) * value + args["slope_rtol"] * s.learning_rate * slope + args["atol"]


@pytest.mark.optax
def test_backtracking_gradient_descent_matches_optax():
    """Optax's test_gradient_descent_with_linesearch (sgd(10) + backtracking, 40 iterations), step by step."""
    optax = pytest.importorskip("optax")
    import jax

    target = torch.tensor([1.0, -1.0, 1.0])
    fn = lambda x: ((x - target) ** 2).sum()  # noqa: E731
    jfn = lambda x: ((x - to_jnp(target)) ** 2).sum()  # noqa: E731
    tx = fx.chain(fx.sgd(10.0), fx.scale_by_backtracking_linesearch(max_backtracking_steps=15))
    otx = optax.chain(optax.sgd(10.0), optax.scale_by_backtracking_linesearch(max_backtracking_steps=15))
    x, ox = torch.tensor([-1.0, 10.0, 1.0]), to_jnp(torch.tensor([-1.0, 10.0, 1.0]))
    state, ostate = tx.init(x), otx.init(ox)

    @jax.jit  # one compile for the 40 iterations: 0.5 s of CPU, op by op under jax.disable_jit 0.9 to 2.6 s
    def ostep(ox, ostate):
        ovalue, ograd = jax.value_and_grad(jfn)(ox)
        ou, ostate = otx.update(ograd, ostate, ox, value=ovalue, grad=ograd, value_fn=jfn)
        return optax.apply_updates(ox, ou), ostate

    for _ in range(40):
        grad, value = torch.func.grad_and_value(fn)(x)
        u, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=fn)
        x = fx.apply_updates(x, u)
        ox, ostate = ostep(ox, ostate)
        assert_trees_close(x, from_jnp(ox), rtol=1e-5, atol=1e-6)
    assert_trees_close(x, target, rtol=1e-2, atol=1e-2)


def test_backtracking_state_before_and_after_one_update():
    """Optax's test_linesearch_update: the value is inf at init and finite after an update."""
    fn = lambda x: (x ** 2).sum()  # noqa: E731
    tx = fx.scale_by_backtracking_linesearch(max_backtracking_steps=5)
    params = torch.zeros(2)
    assert torch.isinf(tx.init(params).value)
    _, state = run_fx(tx, fn, params)
    assert torch.isfinite(state.value)


def test_backtracking_recycles_value_and_grad():
    """Optax's test_recycling_value_and_grad: with store_grad, the value and gradient come from the state after
    the first update (a function returning 1.0 is never called)."""
    target = torch.tensor([1.0, -1.0, 1.0])
    fn = lambda x: ((x - target) ** 2).sum()  # noqa: E731
    value_and_grad = fx.value_and_grad_from_state(fn)
    fake_value_and_grad = fx.value_and_grad_from_state(lambda x: torch.tensor(1.0))
    tx = fx.chain(fx.sgd(0.1), fx.scale_by_backtracking_linesearch(max_backtracking_steps=15, increase_factor=1.0,
                                                                   slope_rtol=0.5, store_grad=True))
    x, state = torch.tensor([1.0, 10.0, 1.0]), None
    state = tx.init(x)
    for k in range(40):
        value, grad = (fake_value_and_grad if k else value_and_grad)(x, state=state)
        u, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=fn)
        x = fx.apply_updates(x, u)
    assert_trees_close(x, target, rtol=1e-2, atol=1e-2)


def test_backtracking_passes_value_fn_arguments():
    """Optax's test_armijo_sgd: value_fn(params, x, y) with x= and y= passed to update; least squares."""
    g = torch.Generator().manual_seed(0)
    xs, target = torch.randn(2, 16, 2, generator=g), torch.randn(2, generator=g)
    ys = xs @ target + 1e-3 * torch.randn(2, 16, generator=g)
    fn = lambda params, x, y: ((x @ params - y) ** 2).sum()  # noqa: E731
    tx = fx.chain(fx.sgd(1.0), fx.scale_by_backtracking_linesearch(max_backtracking_steps=15))
    params = torch.zeros(2)
    state = tx.init(params)
    for k in range(10):
        x, y = xs[k % 2], ys[k % 2]
        grad, value = torch.func.grad_and_value(fn)(params, x, y)
        u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn, x=x, y=y)
        params = fx.apply_updates(params, u)
    assert_trees_close(params, target, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["scale_by_backtracking_linesearch", "scale_by_zoom_linesearch"])
def test_unused_extra_arguments_raise(name):
    """Optax's test_*_raises_on_unused_extra_args."""
    fn = lambda params, batch: (params * batch).sum()  # noqa: E731
    params = torch.tensor([1.0, 2.0])
    tx = getattr(fx, name)(5)
    with pytest.raises(TypeError, match=r"\['unused_arg'\] that value_fn does not take"):
        tx.update(torch.tensor([-0.1, -0.1]), tx.init(params), params, value=fn(params, torch.ones(2)),
                  grad=torch.ones(2), value_fn=fn, batch=torch.ones(2), unused_arg=42)


@pytest.mark.parametrize("name", ["scale_by_backtracking_linesearch", "scale_by_zoom_linesearch"])
def test_missing_extra_arguments_name_them(name):
    tx = getattr(fx, name)(5)
    params = torch.ones(2)
    with pytest.raises(TypeError, match=rf"{name}.update needs grad, value_fn"):
        tx.update(params, tx.init(params), params, value=1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("confuse", [torch.float16, torch.float64])
@pytest.mark.parametrize("name", ["scale_by_backtracking_linesearch", "scale_by_zoom_linesearch"])
def test_dtype_stability(name, dtype, confuse):
    """Optax's test_dtype_stability: tensor hyperparameters and a value_fn of other dtypes; the state keeps its
    dtypes and the update the params' dtype."""
    kw = (["slope_rtol", "decrease_factor", "increase_factor", "max_learning_rate", "atol", "rtol"]
          if "backtracking" in name else
          ["tol", "increase_factor", "slope_rtol", "curv_rtol", "approx_dec_rtol", "stepsize_precision"])
    tx = getattr(fx, name)(5, **{k: torch.tensor(1e-5, dtype=confuse) for k in kw})
    x = torch.tensor([1.0, 2.0], dtype=dtype)
    state = tx.init(x)
    u, new = tx.update(x, state, x, value=1.0, grad=x, value_fn=lambda p: (p ** 2).sum().to(confuse))
    assert u.dtype == dtype
    assert [t.dtype for t in fx.tree.leaves(new)] == [t.dtype for t in fx.tree.leaves(state)]


# --- zoom --------------------------------------------------------------------------------------------

@pytest.mark.optax
@pytest.mark.parametrize("problem,seed", [(p, i % 2) for i, p in enumerate(PROBLEMS)])
def test_zoom_matches_optax(problem, seed):
    """Optax's test_linesearch setup (a direction preconditioned by a random positive diagonal), 30 trials."""
    optax = pytest.importorskip("optax")
    fn, jfn, x0, precond = _problem(problem, seed)
    direction = -precond * torch.func.grad(fn)(x0)
    args = {"max_linesearch_steps": 30, "max_learning_rate": None}
    ours = run_fx(fx.scale_by_zoom_linesearch(**args), fn, x0, direction)
    theirs = run_optax(optax.scale_by_zoom_linesearch(**args), jfn, x0, direction)
    assert_same_search(ours, theirs, rtol=1e-4, atol=1e-5)
    # the value and gradient in the state are those at the new params
    p, s = ours
    grad, value = torch.func.grad_and_value(fn)(p)
    assert_trees_close(s.value, value, rtol=1e-5, atol=1e-5)
    assert_trees_close(s.grad, grad, rtol=1e-5, atol=1e-5)


ZOOM = {
    "keep_capped": {"max_linesearch_steps": 8, "max_learning_rate": 0.5, "initial_guess_strategy": "keep"},
    "one_no_approx": {"max_linesearch_steps": 8, "initial_guess_strategy": "one", "approx_dec_rtol": None},
    "tight": {"max_linesearch_steps": 12, "curv_rtol": 0.1, "slope_rtol": 0.3, "increase_factor": 3.0,
              "stepsize_precision": 1e-3, "tol": 1e-6},
}


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", ZOOM.values(), ids=ZOOM.keys())
def test_zoom_arguments_match_optax(kwargs):
    optax = pytest.importorskip("optax")
    for problem in ("himmelblau", "zakharov"):
        fn, jfn, x0, precond = _problem(problem)
        direction = -precond * torch.func.grad(fn)(x0)
        ours = run_fx(fx.scale_by_zoom_linesearch(**kwargs), fn, x0, direction, guess=0.3)
        theirs = run_optax(optax.scale_by_zoom_linesearch(**kwargs), jfn, x0, direction, guess=0.3)
        assert_same_search(ours, theirs, rtol=1e-4, atol=1e-5)


def _square(x):
    return (x * x).sum()


def _verbose_run(tx, fn, w, u):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        p, state = run_fx(tx, fn, w, u, guess=1.0)
    return p, state, out.getvalue()


def test_zoom_not_a_descent_direction():
    """Optax's test_failure_descent_direction: no step (or an infinitesimal one), and it says why."""
    tx = fx.scale_by_zoom_linesearch(max_linesearch_steps=18, curv_rtol=0.5, verbose=True)
    _, state, out = _verbose_run(tx, _square, torch.tensor([60.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert state.learning_rate < 1e-5
    assert _linesearch.FLAG_NOT_A_DESCENT_DIRECTION in out and _linesearch.FLAG_NO_STEPSIZE_FOUND in out


def test_zoom_max_stepsize_too_small():
    """Optax's test_failure_too_small_max_stepsize: takes the largest step allowed, and says why."""
    tx = fx.scale_by_zoom_linesearch(max_linesearch_steps=10, curv_rtol=0.5, verbose=True, max_learning_rate=10.0)
    _, state, out = _verbose_run(tx, _square, torch.tensor([-60.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert state.learning_rate == 10.0
    assert _linesearch.FLAG_INTERVAL_NOT_FOUND in out and _linesearch.FLAG_CURVATURE_COND_NOT_SATISFIED in out


def test_zoom_not_enough_steps():
    """Optax's test_failure_not_enough_iter: 5 trials reach 16 (not 30, the first valid step); 30 trials do."""
    w, u = torch.tensor([-60.0, 0.0]), torch.tensor([1.0, 0.0])
    tx = fx.scale_by_zoom_linesearch(max_linesearch_steps=5, curv_rtol=0.5, verbose=True)
    _, state, out = _verbose_run(tx, _square, w, u)
    assert state.learning_rate == 16.0
    assert not (state.info.decrease_error <= 0 and state.info.curvature_error <= 0)
    assert _linesearch.FLAG_NOT_A_DESCENT_DIRECTION not in out
    p, state = run_fx(fx.scale_by_zoom_linesearch(max_linesearch_steps=30, curv_rtol=0.5), _square, w, u, guess=1.0)
    assert state.learning_rate >= 30.0
    slope0, slope1 = (torch.func.grad(_square)(x) @ u for x in (w, p))
    assert _square(p) <= _square(w) + 1e-4 * state.learning_rate * slope0
    assert slope1.abs() <= 0.5 * slope0.abs()


def test_zoom_flat_function():
    """Optax's test_failure_flat_fun: the interval shrinks below the threshold, and it says so."""
    fn = lambda x: torch.exp(-1 / x ** 2)  # noqa: E731
    w = torch.tensor(-0.2)
    tx = fx.scale_by_zoom_linesearch(max_linesearch_steps=30, verbose=True)
    _, _, out = _verbose_run(tx, fn, w, -torch.func.grad(fn)(w))
    assert _linesearch.FLAG_INTERVAL_TOO_SMALL in out


def test_zoom_inf_values():
    """Optax's test_failure_inf_value: log(x) from 1 along -2 (inf and NaN beyond 0.5) still steps."""
    _, state = run_fx(fx.scale_by_zoom_linesearch(max_linesearch_steps=30), torch.log, torch.tensor(1.0),
                      torch.tensor(-2.0), guess=1.0)
    assert state.learning_rate > 0.0


def test_zoom_high_smaller_than_low():
    """Optax's test_high_smaller_than_low (google/jax#16236): the first trial overshoots; still succeeds."""
    w = torch.tensor(-1.0)
    _, state = run_fx(fx.scale_by_zoom_linesearch(max_linesearch_steps=20), lambda x: x ** 2, w, 1.95 * -w,
                      guess=1.0)
    assert state.info.decrease_error <= 0.0 and state.info.curvature_error <= 0.0


def test_zoom_state_before_and_after_one_update():
    tx = fx.scale_by_zoom_linesearch(max_linesearch_steps=5)
    assert torch.isinf(tx.init(torch.zeros(2)).value)
    _, state = run_fx(tx, _square, torch.zeros(2))
    assert torch.isfinite(state.value)


def test_params_and_frozen_leaves_are_left_alone():
    """A tree with a frozen leaf (None update) and a None param: the line moves only the others."""
    fn = lambda p: ((p["a"] - 1.0) ** 2).sum() + (p["b"] ** 2).sum()  # noqa: E731
    params = {"a": torch.zeros(2), "b": torch.ones(3), "c": None}
    grad = {**torch.func.grad(fn)({"a": params["a"], "b": params["b"]}), "c": None}
    for tx in (fx.scale_by_backtracking_linesearch(5, store_grad=True), fx.scale_by_zoom_linesearch(5)):
        before = fx.tree.clone(params)
        u, state = tx.update({"a": -grad["a"], "b": None, "c": None}, tx.init(params), params, value=fn(params),
                             grad=grad, value_fn=fn)
        assert u["b"] is None and u["c"] is None and state.grad["c"] is None
        assert_trees_close(params, before, rtol=0, atol=0)
        assert fn(fx.apply_updates(params, u)) < fn(params)
        assert_trees_close(state.grad["b"], grad["b"])  # b did not move
    assert_trees_close(u["a"], torch.ones(2), rtol=1e-6, atol=1e-6)  # zoom: the exact minimum along the line


# --- value_and_grad_from_state -------------------------------------------------------------------------

def test_value_and_grad_from_state():
    """Optax's test_value_and_grad_from_state: errors without (or with two) stored values; reuse after one
    update (a function returning 1.0 is not called)."""
    value_and_grad = fx.value_and_grad_from_state(_square)
    params = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="holds no value or grad"):
        value_and_grad(params, state=fx.scale_by_adam().init(params))
    two = fx.chain(fx.scale_by_backtracking_linesearch(15), fx.scale_by_backtracking_linesearch(15))
    with pytest.raises(KeyError, match="2 entries named 'value'"):
        value_and_grad(params, state=two.init(params))
    tx = fx.chain(fx.sgd(1.0), fx.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True))
    state = tx.init(params)
    value, grad = value_and_grad(params, state=state)
    assert value == 14.0 and grad.tolist() == [2.0, 4.0, 6.0]
    u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=_square)
    params = fx.apply_updates(params, u)
    value, grad = fx.value_and_grad_from_state(lambda p: torch.tensor(1.0))(params, state=state)
    assert value != 1.0
    assert_trees_close(grad, torch.func.grad(_square)(params))


# --- composability: vmap over starting points (no host sync in update) ---------------------------------

@pytest.mark.parametrize("name,kw", [("scale_by_backtracking_linesearch", {"store_grad": True}),
                                     ("scale_by_backtracking_linesearch", {}),
                                     ("scale_by_zoom_linesearch", {}),
                                     ("scale_by_zoom_linesearch", {"branchless": True})])
def test_vmap_over_starting_points(name, kw):
    """Four starting points of Himmelblau's function, vmapped, 3 updates: each member equals its own run
    (which the tests above compare with Optax). vmap refuses host syncs (``.item()``, ``bool``) and Python
    branches on tensors, so this also shows that a branchless update has none (the zoom search is
    branchless under vmap by itself). Backtracking without store_grad keeps no gradient: its state's
    ``grad`` is an EmptyState (no leaf); it was None, which vmap refuses as an output (issue 25)."""
    fn = lambda x: _himmelblau(x, torch)  # noqa: E731
    tx = getattr(fx, name)(10, **kw)

    def step(x, state):
        grad, value = torch.func.grad_and_value(fn)(x)
        u, state = tx.update(-grad, state, x, value=value, grad=grad, value_fn=fn)
        return x + u, state

    xs = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    x, state = xs, torch.func.vmap(tx.init)(xs)
    members = [(xs[i], tx.init(xs[i])) for i in range(4)]
    for _ in range(3):
        x, state = torch.func.vmap(step)(x, state)
        members = [step(*m) for m in members]
        for i, (one, one_state) in enumerate(members):
            assert_trees_close(x[i], one, rtol=1e-6, atol=1e-6)
            assert_trees_close(fx.tree.map(lambda t: t[i], state), one_state, rtol=1e-6, atol=1e-6)


# --- gradients through a search at a converged point (issue 35) -------------------------------------------

@pytest.mark.parametrize("name", ["scale_by_backtracking_linesearch", "scale_by_zoom_linesearch"])
@pytest.mark.parametrize("by", ["func", "autograd"])
def test_grad_through_a_search_at_the_minimum_is_the_taken_branch(name, by):
    """At the minimum the direction and the slope are 0: the zoom search's interval has length 0 (its cubic and
    quadratic interpolate equal points: 0/0) and every trial of a branchless search (torch.func) sees the same
    value. The Jacobian of x -> x + search(-grad f(x)) there is finite and is the accepted step's, I - eta H
    (float64), not NaN from the branches not taken."""
    scales = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)
    f = lambda x: 0.5 * (scales * (x - 1.0) ** 2).sum()  # noqa: E731
    search = (fx.scale_by_zoom_linesearch(10, initial_guess_strategy="one") if name == "scale_by_zoom_linesearch"
              else fx.scale_by_backtracking_linesearch(10))
    tx = fx.chain(fx.sgd(1.0), search)
    state = tx.init(torch.ones(3, dtype=torch.float64))

    def step(x):
        grad, value = torch.func.grad_and_value(f)(x)
        u, _ = tx.update(grad, state, x, value=value, grad=grad, value_fn=f)
        return x + u

    x = torch.ones(3, dtype=torch.float64)
    if by == "func":
        jac = torch.func.jacrev(step)(x)
    else:
        x = x.clone().requires_grad_()
        out = step(x)
        jac = torch.stack([torch.autograd.grad(out[i], x, retain_graph=True)[0] for i in range(3)])
    _, after = tx.update(torch.zeros(3, dtype=torch.float64), state, torch.ones(3, dtype=torch.float64),
                         value=f(torch.ones(3)), grad=torch.zeros(3, dtype=torch.float64), value_fn=f)
    eta = after[-1].learning_rate
    assert torch.isfinite(jac).all(), jac
    assert_trees_close(jac, torch.eye(3, dtype=torch.float64) - eta * torch.diag(scales), rtol=1e-12, atol=1e-12)
