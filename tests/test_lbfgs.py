"""L-BFGS (fxtrain/transforms/_lbfgs.py): the two-loop product against the dense inverse Hessian, Optax
trajectories (with and without line search, float32, float64, complex64), Optax's alias_test cases, vmap and
grad against Optax, DTensor leaves (2 gloo ranks) against plain ones."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, to_jnp
from fxtrain.transforms import _lbfgs
from tests import _worlds
from tests._parity import assert_parity


def rosenbrock(x, xnp=None):
    return (100.0 * (x[..., 1:] - x[..., :-1] ** 2) ** 2 + (1.0 - x[..., :-1]) ** 2).sum()


def quadratic(x, xnp=None):
    """An ill-conditioned quadratic (eigenvalues 1 to 50)."""
    scales = 1.0 + 49.0 * (x * 0 + 1).cumsum(-1) / x.shape[-1]
    return 0.5 * (scales * (x - 1.0) ** 2).sum()


def run_fx(tx, fn, params, steps):
    """``steps`` updates of ``tx`` on ``fn``, reusing the line search's value and gradient; params per step."""
    value_and_grad = fx.value_and_grad_from_state(fn)
    state, out = tx.init(params), []
    for _ in range(steps):
        value, grad = value_and_grad(params, state=state)
        u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
        params = fx.apply_updates(params, u)
        out.append(params)
    return out, state


def run_optax(otx, fn, params, steps, *, jit=False):
    """The same with Optax, op by op (compiling its loops costs more here than running them), or with ``jit``
    each update compiled once (cheaper where the line search runs many trials op by op: backtracking's
    8 updates took 4.5 s of CPU op by op, 1.5 s compiled). Complex gradients are conjugated as Optax's own
    tests do: then they are torch's."""
    import contextlib

    import jax
    import optax

    value_and_grad = optax.value_and_grad_from_state(fn)

    def step(params, state):
        value, grad = value_and_grad(params, state=state)
        grad = jax.tree.map(jax.numpy.conj, grad)
        u, state = otx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
        return optax.apply_updates(params, u), state

    params, out = to_jnp(params), []
    with contextlib.nullcontext() if jit else jax.disable_jit():
        step = jax.jit(step) if jit else step
        state = otx.init(params)
        for _ in range(steps):
            params, state = step(params, state)
            out.append(from_jnp(params))
    return out, state


def assert_same_trajectory(ours, theirs, rtol, atol):
    for k, (a, b) in enumerate(zip(ours, theirs)):
        try:
            assert_trees_close(a, b, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"iteration {k}: {e}") from None


# --- the two-loop recursion ---------------------------------------------------------------------------

def dense_inverse_hessian(dws, dus, gamma):
    """Nocedal and Wright's (7.19) as matrices, oldest pair first (float64)."""
    d = dws.shape[1]
    p = gamma * np.eye(d)
    for dw, du in zip(dws, dus):
        rho = 1.0 / (dw @ du)
        v = np.eye(d) - rho * np.outer(du, dw)
        p = v.T @ p @ v + rho * np.outer(dw, dw)
    return p


@pytest.mark.parametrize("idx", [0, 1, 3])
def test_two_loop_equals_the_dense_product(idx):
    """Optax's test_preconditioning_by_lbfgs_on_vectors/trees: the product by the circular memory starting
    at slot ``idx`` equals the dense inverse Hessian approximation times the vector, for a tree too."""
    g = torch.Generator().manual_seed(idx)
    m, d = 4, 5
    dws, dus, vec = torch.randn(m, d, generator=g), torch.randn(m, d, generator=g), torch.randn(d, generator=g)
    rhos = 1.0 / (dws * dus).sum(1)
    order = [(idx + j) % m for j in range(m)]  # slot order, oldest first
    dense = dense_inverse_hessian(dws[order].double().numpy(), dus[order].double().numpy(), 0.7)
    expected = dense @ vec.double().numpy()
    got = _lbfgs._two_loop([vec], [dws], [dus], rhos, torch.tensor(0.7), torch.tensor(idx), m)[0]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)
    split = (slice(0, 2), slice(2, 5))  # the same vectors as a tree of two leaves
    got = _lbfgs._two_loop([vec[s] for s in split], [dws[:, s] for s in split], [dus[:, s] for s in split], rhos,
                           torch.tensor(0.7), torch.tensor(idx), m)
    np.testing.assert_allclose(torch.cat(got).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_first_update_is_the_capped_normalized_gradient():
    tx = fx.scale_by_lbfgs()
    params = {"a": torch.zeros(2), "b": torch.zeros(())}
    u, state = tx.update({"a": torch.tensor([3.0, 0.0]), "b": torch.tensor(4.0)}, tx.init(params), params)
    assert u["a"].tolist() == pytest.approx([0.6, 0.0]) and u["b"].item() == pytest.approx(0.8)
    small = {"a": torch.tensor([0.3, 0.0]), "b": torch.tensor(0.4)}
    u, _ = tx.update(small, tx.init(params), params)  # norm 0.5: scaled by min(1, 1/0.5) = 1
    assert_trees_close(u, small)
    assert int(state.count) == 1 and state.diff_params_memory["a"].shape == (10, 2)


def test_memory_size_must_be_positive():
    with pytest.raises(ValueError, match="scale_by_lbfgs: memory_size=0 must be an int >= 1"):
        fx.scale_by_lbfgs(memory_size=0)


# --- against Optax ------------------------------------------------------------------------------------

@pytest.mark.optax
def test_scale_by_lbfgs_matches_optax():
    """The parity harness (nested params, pure and donated) with a fixed step, no line search."""
    scale_init_precond = True
    optax = pytest.importorskip("optax")
    # 6 steps (memory 3 wraps around): on these gradients (not of one objective) the curvature pairs grow
    # near singular and float32 rounding differences pass 1e-5 after about 13. Optax's update jitted (the
    # harness's default): its lax loops op by op compile at every call, under jax.disable_jit they cost 6.6 s
    # of CPU, compiled 3.3 s.
    assert_parity(fx.lbfgs(0.05, memory_size=3, scale_init_precond=scale_init_precond, linesearch=None),
                  optax.lbfgs(0.05, memory_size=3, scale_init_precond=scale_init_precond, linesearch=None),
                  steps=6)


@pytest.mark.optax
def test_lbfgs_with_zoom_matches_optax_float64():
    """lbfgs with its default zoom line search (20 trials) on a tree (Rosenbrock + an ill-conditioned
    quadratic), float64: equal to Optax's iterates to 1e-13 over 8 iterations (in float32 they
    agree to 1e-7 for about 10 iterations of Rosenbrock's function, then rounding differences grow as the
    iterates cross the valley: 1e-5 at 13, 1e-2 at 20; tests/test_linesearch.py compares single float32
    searches and the complex64 test below float32 iterations). Memory 3, wrapped around several times."""
    optax = pytest.importorskip("optax")
    import jax

    fn = lambda p: rosenbrock(p["x"]) + quadratic(p["y"])  # noqa: E731
    params = {"x": torch.tensor([-1.2, 1.0, 0.5, -0.3], dtype=torch.float64),
              "y": torch.tensor([0.8, 1.3, -0.4], dtype=torch.float64)}
    with jax.enable_x64(True):
        ours, state = run_fx(fx.lbfgs(memory_size=3), fn, params, 8)
        theirs, _ = run_optax(optax.lbfgs(memory_size=3), fn, params, 8)
    assert_same_trajectory(ours, theirs, rtol=1e-13, atol=1e-14)
    assert fn(ours[-1]) < 0.1 * fn(params) and int(state[0].count) == 8


@pytest.mark.optax
def test_lbfgs_backtracking_and_learning_rate_match_optax():
    optax = pytest.importorskip("optax")
    fn = lambda p: quadratic(p["x"])  # noqa: E731
    params = {"x": torch.tensor([-1.2, 1.0, 0.5, -0.3, 2.0])}
    args = {"memory_size": 4, "scale_init_precond": False}
    ours, _ = run_fx(fx.lbfgs(0.5, linesearch=fx.scale_by_backtracking_linesearch(15, store_grad=True), **args),
                     fn, params, 8)
    theirs, _ = run_optax(optax.lbfgs(0.5, linesearch=optax.scale_by_backtracking_linesearch(
        15, store_grad=True), **args), fn, params, 8, jit=True)
    assert_same_trajectory(ours, theirs, rtol=1e-5, atol=1e-6)


def _complex_objective(z):
    mat = torch.tensor([[1, -2], [3, 4], [-4 + 2j, 5 - 3j], [-2 - 2j, 6]], dtype=torch.complex64)
    return ((mat @ z).abs() ** 1.5).sum()


@pytest.mark.optax
def test_lbfgs_complex_matches_optax():
    """complex64 with the zoom line search, 6 iterations (Optax's test_lbfgs_complex objective)."""
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    mat = jnp.array([[1, -2], [3, 4], [-4 + 2j, 5 - 3j], [-2 - 2j, 6]], dtype=jnp.complex64)
    z0 = {"z": torch.tensor([1 - 1j, 0 + 1j], dtype=torch.complex64)}
    ours, _ = run_fx(fx.lbfgs(memory_size=3), lambda p: _complex_objective(p["z"]), z0, 6)
    theirs, _ = run_optax(optax.lbfgs(memory_size=3), lambda p: (jnp.abs(mat @ p["z"]) ** 1.5).sum(), z0, 6)
    assert_same_trajectory(ours, theirs, rtol=1e-4, atol=1e-5)


def _solve(tx, fn, params, maxiter=25, tol=1e-5):
    """Optax's _run_opt: iterate until the gradient norm is below ``tol`` (the test reads it on the host)."""
    value_and_grad = fx.value_and_grad_from_state(fn)
    state = tx.init(params)
    for _ in range(maxiter):
        value, grad = value_and_grad(params, state=state)
        if fx.transforms._linesearch.vdot(fx.tree.leaves(grad), fx.tree.leaves(grad)).sqrt() < tol:
            break
        u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
        params = fx.apply_updates(params, u)
    return params


@pytest.mark.parametrize("linesearch", ["backtracking", "zoom"])
def test_lbfgs_complex_equals_the_real_problem(linesearch):
    """Optax's test_lbfgs_complex: optimizing over C^2 gives the solution of the same problem over R^(2x2)."""
    def make():
        return fx.lbfgs(linesearch=fx.scale_by_backtracking_linesearch(20, store_grad=True) if linesearch ==
                        "backtracking" else
                        fx.scale_by_zoom_linesearch(20, initial_guess_strategy="one"))

    z0 = torch.tensor([1 - 1j, 0 + 1j], dtype=torch.complex64)
    sol_complex = _solve(make(), _complex_objective, z0)
    sol_real = _solve(make(), lambda x: _complex_objective(torch.complex(x[0], x[1])), torch.stack([z0.real, z0.imag]))
    assert_trees_close(sol_complex, torch.complex(sol_real[0], sol_real[1]), rtol=1e-4, atol=1e-4)


def test_lbfgs_handles_trees():
    """Optax's test_handling_pytrees: a (2, 4) array and the tuple of its rows give the same iterates."""
    init = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    rows = lambda p: rosenbrock(p[0]) + rosenbrock(p[1])  # noqa: E731
    as_array, _ = run_fx(fx.lbfgs(), lambda x: rows((x[0], x[1])), init, 3)
    as_tree, _ = run_fx(fx.lbfgs(), rows, (init[0], init[1]), 3)
    assert_trees_close(torch.stack(as_tree[-1]), as_array[-1], rtol=5e-5, atol=5e-5)


def test_lbfgs_steep_objective():
    """Optax's test_steep_objective (google/jax#4594): mean((1e4 I x)^2) from ones reaches 0."""
    fn = lambda x: ((1e4 * x) ** 2).mean()  # noqa: E731
    assert_trees_close(_solve(fx.lbfgs(), fn, torch.ones(2)), torch.zeros(2), rtol=1e-5, atol=1e-5)


def test_lbfgs_default_linesearch_is_optax_default():
    assert repr(fx.lbfgs()) == "lbfgs()"
    assert repr(fx.lbfgs(linesearch=None)) == "lbfgs(linesearch=None)"
    ls = fx.lbfgs()  # chain(scale_by_lbfgs, scale(-1), zoom(20, "one"))
    assert "scale_by_zoom_linesearch(20, initial_guess_strategy='one')" in repr(
        fx.lbfgs(linesearch=fx.scale_by_zoom_linesearch(20, initial_guess_strategy="one")))
    assert not fx.is_elementwise(ls) and not fx.is_elementwise(fx.scale_by_lbfgs())


# --- composability against jitted Optax (tests/cases/linesearch.py's COMPOSABLE runs no Optax) -------------

def _run_plain(tx, x, fn, steps, grad):
    state = tx.init(x)
    for _ in range(steps):
        u, state = tx.update(grad(fn)(x), state, x)
        x = x + u
    return x


@pytest.mark.optax
def test_vmap_matches_optax():
    """vmap over 3 starting points of 4 updates against jax.vmap of Optax's lbfgs (no line search: the
    composable harness's update takes no value_fn)."""
    optax = pytest.importorskip("optax")
    import jax

    tx, otx = (m.lbfgs(0.1, memory_size=3, linesearch=None) for m in (fx, optax))
    xs = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    ours = torch.func.vmap(lambda x: _run_plain(tx, x, quadratic, 4, torch.func.grad))(xs)
    # compiled once: 1.9 s of CPU, op by op under jax.disable_jit 3.8 s
    theirs = jax.jit(jax.vmap(lambda x: _run_plain(otx, x, quadratic, 4, jax.grad)))(to_jnp(xs))
    assert_trees_close(ours, from_jnp(theirs), rtol=1e-5, atol=1e-6)


def _differentiated_first_scale(monkeypatch, jax):
    """Optax's lbfgs as fxtrain's derivatives see it: the first step's scale min(1, 1/|u_0|) differentiated (Optax
    reads jax.lax.stop_gradient when it builds the update: the only place its lbfgs stops a gradient)."""
    monkeypatch.setattr(jax.lax, "stop_gradient", lambda x: x)


@pytest.mark.optax
@pytest.mark.parametrize("start", ["far", "near"])
def test_grad_through_updates_matches_optax(start, monkeypatch):
    """grad of a loss after 3 updates w.r.t. the initial params against jax.grad through Optax's lbfgs. Far from the
    minimum (|u_0| > 1) with Optax's first-step stop_gradient lifted, as fxtrain differentiates that scale
    (lbfgs' docstring: its one difference in derivatives before convergence); near it (|u_0| < 1, the scale is
    the constant 1) against Optax as it is."""
    optax = pytest.importorskip("optax")
    import jax

    tx, otx = (m.lbfgs(0.1, memory_size=3, linesearch=None) for m in (fx, optax))
    run = _run_plain
    xs = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    fn = rosenbrock
    if start == "far":
        _differentiated_first_scale(monkeypatch, jax)
    else:
        xs, fn = 1.0 + 2e-3 * xs, quadratic
        assert float(torch.func.grad(fn)(xs[0]).norm()) < 1.0
    meta = lambda run_, grad, x: (run_(x, fn, 3, grad) ** 2).sum()  # noqa: E731
    ours = torch.func.grad(lambda x: meta(lambda *a: run(tx, *a), torch.func.grad, x))(xs[0])
    # compiled once: 2.9 s of CPU, op by op under jax.disable_jit 3.7 s
    theirs = jax.jit(jax.grad(lambda x: meta(lambda *a: run(otx, *a), jax.grad, x)))(to_jnp(xs[0]))
    assert_trees_close(ours, from_jnp(theirs), rtol=1e-4, atol=1e-5)


# --- cost: the zoom line search stops at the first accepted step, as Optax's while loop ----------------

def _counted(fn):
    def counting(*args, **kwargs):
        counting.calls += 1
        return fn(*args, **kwargs)

    counting.calls = 0
    return counting


def _run_counting(tx, fn, params, steps):
    """``steps`` updates; the value_fn calls (each a value and gradient evaluation) of each update."""
    value_and_grad, counting = fx.value_and_grad_from_state(fn), _counted(fn)
    state, calls, out = tx.init(params), [], []
    for _ in range(steps):
        value, grad = value_and_grad(params, state=state)
        before = counting.calls
        u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=counting)
        calls.append(counting.calls - before)
        if not _branchless(tx):  # the state counts the trials that decided (Optax's), the calls when stopped early
            assert calls[-1] == int(state[-1].info.num_linesearch_steps)
        params = fx.apply_updates(params, u)
        out.append(params)
    return calls, out


BRANCHLESS = dict(max_linesearch_steps=20, initial_guess_strategy="one", branchless=True)


def _branchless(tx) -> bool:
    return "branchless=True" in repr(tx)


@pytest.mark.optax
def test_default_lbfgs_evaluates_as_often_as_optax():
    """The default lbfgs() on Rosenbrock's function (float64, 15 updates): the value_fn calls of each update
    equal Optax's trials (its state's num_linesearch_steps, jitted; under jax.disable_jit a counting value_fn
    gives the same), 19 calls for 15 updates (1.27 per update: issue 25 measured 20 per update before), and
    the iterates equal Optax's to 1e-12. branchless=True: 20 calls every update, the same iterates bit for bit."""
    optax = pytest.importorskip("optax")
    import jax

    x0 = torch.tensor([-1.2, 1.0, 0.5, -0.3], dtype=torch.float64)
    calls, ours = _run_counting(fx.lbfgs(), rosenbrock, x0, 15)
    with jax.enable_x64(True):
        otx = optax.lbfgs()
        value_and_grad = optax.value_and_grad_from_state(rosenbrock)

        @jax.jit
        def step(x, state):
            value, grad = value_and_grad(x, state=state)
            u, state = otx.update(grad, state, x, value=value, grad=grad, value_fn=rosenbrock)
            return optax.apply_updates(x, u), state

        x, state, theirs, their_calls = to_jnp(x0), otx.init(to_jnp(x0)), [], []
        for _ in range(15):
            x, state = step(x, state)
            theirs.append(from_jnp(x))
            their_calls.append(int(optax.tree.get(state, "num_linesearch_steps")))
    assert calls == their_calls and sum(calls) == 19, (calls, their_calls)
    assert_same_trajectory(ours, theirs, rtol=1e-12, atol=1e-13)
    branchless_calls, branchless = _run_counting(fx.lbfgs(linesearch=fx.scale_by_zoom_linesearch(**BRANCHLESS)),
                                                 rosenbrock, x0, 15)
    assert branchless_calls == [20] * 15
    assert_same_trajectory(branchless, ours, rtol=0, atol=0)


def test_zoom_stops_at_the_first_accepted_step_and_branchless_vmaps():
    """Without Optax: on the ill-conditioned quadratic the default search accepts its first trial every
    update (1 call, where it made 20); under vmap (no host decision possible) the default and
    branchless=True searches both run every trial and each member equals its own run."""
    calls, ours = _run_counting(fx.lbfgs(), quadratic, torch.zeros(6), 8)
    assert calls == [1] * 8
    assert float(quadratic(ours[-1])) < 1e-6 * float(quadratic(torch.zeros(6)))
    xs = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for tx in (fx.lbfgs(memory_size=3), fx.lbfgs(memory_size=3, linesearch=fx.scale_by_zoom_linesearch(**BRANCHLESS))):
        def run(x, tx=tx):
            return run_fx(tx, rosenbrock, x, 3)[0][-1]

        batched = torch.func.vmap(run)(xs)
        for i in range(3):
            assert_trees_close(batched[i], run(xs[i]), rtol=1e-5, atol=1e-6)
    assert "branchless=True" in repr(fx.scale_by_zoom_linesearch(**BRANCHLESS))


# --- gradients through the zoom line search (meta-learning through L-BFGS) ------------------------------

def _unrolled(tx_factory, fn, steps):
    """``x0 -> sum(x_steps ** 2)`` after ``steps`` updates of ``tx_factory()`` on ``fn`` from ``x0``."""
    def meta(x):
        tx = tx_factory()
        state = tx.init(x)
        for _ in range(steps):
            grad, value = torch.func.grad_and_value(fn)(x)
            u, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=fn)
            x = x + u
        return (x ** 2).sum()

    return meta


@pytest.mark.parametrize("name", ["lbfgs", "zoom"])
def test_grad_through_zoom_linesearch_equals_finite_differences(name):
    """torch.func.grad (branchless search) and plain autograd (the search stopping early) through 3 updates
    equal central finite differences in float64 (it was all NaN: the interpolations of the branches not
    taken, and the trials a branchless search discards, gave 0 * NaN). lbfgs as built by default: its first
    step's scale is differentiated (a stop_gradient in Optax, which finite differences do not see)."""
    make = fx.lbfgs if name == "lbfgs" else (
        lambda: fx.chain(fx.sgd(1e-3), fx.scale_by_zoom_linesearch(10)))
    meta = _unrolled(make, rosenbrock, 3)
    x0 = torch.tensor([-1.2, 1.0, 0.5], dtype=torch.float64)
    by_func = torch.func.grad(meta)(x0)
    x = x0.clone().requires_grad_()
    (by_autograd,) = torch.autograd.grad(meta(x), x)
    eps = 1e-6
    fd = torch.stack([(meta(x0 + eps * e) - meta(x0 - eps * e)) / (2 * eps) for e in torch.eye(3, dtype=torch.float64)])
    assert torch.isfinite(by_func).all()
    assert_trees_close(by_func, fd, rtol=1e-6, atol=1e-6)
    assert_trees_close(by_autograd, by_func, rtol=1e-10, atol=1e-12)


def rosenbrock_mild(x):
    """Rosenbrock's valley with a weight 5 instead of 100: lbfgs converges from (0.3, 0.6, 0.2) in about 20
    updates, on a path whose line searches take the same branches near the start (finite differences hold)."""
    return (5.0 * (x[..., 1:] - x[..., :-1] ** 2) ** 2 + (1.0 - x[..., :-1]) ** 2).sum()


PAST_CONVERGENCE = {  # objective, start, and the update counts K: before, near and after convergence
    "quadratic": (quadratic, [-1.2, 0.7, 0.4], (3, 6, 12, 20)),
    "rosenbrock": (rosenbrock_mild, [0.3, 0.6, 0.2], (6, 12, 18, 25)),
}
SEARCHES = {
    "zoom": fx.lbfgs,  # as built by default
    "backtracking": lambda: fx.lbfgs(linesearch=fx.scale_by_backtracking_linesearch(15)),
}


def _losses_along(make, fn, x, steps):
    """``sum(x_k ** 2)`` after k = 1..max(steps) updates of ``make()`` from ``x``: the losses at ``steps``."""
    tx = make()
    state, out = tx.init(x), {}
    for k in range(1, max(steps) + 1):
        grad, value = torch.func.grad_and_value(fn)(x)
        u, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=fn)
        x = x + u
        if k in steps:
            out[k] = (x ** 2).sum()
    return out


@pytest.mark.parametrize("search", sorted(SEARCHES))
@pytest.mark.parametrize("problem", sorted(PAST_CONVERGENCE))
def test_grad_through_lbfgs_past_convergence_equals_finite_differences(problem, search):
    """Issue 35: the gradient of a loss after K updates w.r.t. the start, for K across convergence, equals central
    finite differences of the unrolled function (float64; eps 1e-6, so atol 1e-7 covers their rounding noise of
    about 1e-9). It was NaN from K = 8 on the quadratic (0/0: the empty curvature pair of a converged step,
    rho = 1/<s, y> and the scale <s, y>/|y|^2 under a single where)."""
    fn, start, steps = PAST_CONVERGENCE[problem]
    x0 = torch.tensor(start, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    losses = _losses_along(SEARCHES[search], fn, x, steps)
    eps, basis = 1e-6, torch.eye(len(start), dtype=torch.float64)
    ups = [_losses_along(SEARCHES[search], fn, x0 + eps * e, steps) for e in basis]
    downs = [_losses_along(SEARCHES[search], fn, x0 - eps * e, steps) for e in basis]
    for k in steps:
        (grad,) = torch.autograd.grad(losses[k], x, retain_graph=True)
        fd = torch.stack([(up[k] - down[k]) / (2 * eps) for up, down in zip(ups, downs)])
        assert torch.isfinite(grad).all(), f"K={k}: {grad}"
        assert_trees_close(grad, fd, rtol=1e-5, atol=1e-7)
    assert abs(float(losses[max(steps)].detach()) - len(start)) < 1e-12  # converged: x = (1, 1, 1)


def test_grad_through_branchless_lbfgs_past_convergence_is_finite():
    """torch.func.grad runs the zoom search branchless: all 20 trials every update, after convergence too (trials
    over zero-length intervals, interpolations of equal values), discarded by torch.where. Their gradients are
    zero, not NaN: the same gradient as autograd's early-stopping search, 12 updates in (converged at 8)."""
    fn, start, _ = PAST_CONVERGENCE["quadratic"]
    x0 = torch.tensor(start, dtype=torch.float64)
    by_func = torch.func.grad(lambda x: _losses_along(fx.lbfgs, fn, x, (12,))[12])(x0)
    x = x0.clone().requires_grad_()
    (by_autograd,) = torch.autograd.grad(_losses_along(fx.lbfgs, fn, x, (12,))[12], x)
    assert torch.isfinite(by_func).all()
    assert_trees_close(by_func, by_autograd, rtol=1e-6, atol=1e-20)


def test_a_converged_step_keeps_the_memory():
    """A zero gradient and no step: the memory keeps its pairs and the newest stays newest (Optax writes the empty
    pair over the oldest; the direction is 0 either way), so the derivative of a converged step stays I - P H with
    the learned P. Donated (under no_grad) and pure updates agree."""
    fn, start, _ = PAST_CONVERGENCE["quadratic"]

    def run(steps):
        x = torch.tensor(start, dtype=torch.float64)
        tx = fx.lbfgs(memory_size=4)
        state = tx.init(x)
        for _ in range(steps):
            grad, value = torch.func.grad_and_value(fn)(x)
            u, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=fn)
            x = x + u
        return grad, u, state

    _, _, before = run(24)
    grad, u, after = run(25)
    with torch.no_grad():
        assert_trees_close(run(25)[2], after, rtol=0, atol=0)
    assert not grad.any() and not u.any()  # converged
    before, after = before[0], after[0]
    prev, newest = (int(before.count) - 1) % 4, (int(before.count) - 2) % 4
    assert sorted(after.weights_memory.tolist()) == sorted(before.weights_memory.tolist())
    assert after.weights_memory[prev] == before.weights_memory[newest] != 0
    assert torch.equal(after.diff_params_memory[prev], before.diff_params_memory[newest])
    assert torch.equal(after.diff_params_memory[newest], before.diff_params_memory[prev])


@pytest.mark.optax
def test_grad_through_default_lbfgs_matches_optax(monkeypatch):
    """The gradient of a loss after 2 default lbfgs() updates w.r.t. the initial params equals Optax's under
    JAX differentiation: forward mode (jax.jacfwd, compiled), as jax.grad cannot reverse Optax's while_loop
    under jit and op by op its unguarded interpolation gives NaN (0 * NaN in the branch not taken). Optax's first step's
    stop_gradient lifted, as fxtrain differentiates that scale (lbfgs' docstring)."""
    pytest.importorskip("optax")
    import jax
    import optax

    _differentiated_first_scale(monkeypatch, jax)

    def optax_meta(x):
        tx = optax.lbfgs()
        state = tx.init(x)
        for _ in range(2):
            value, grad = jax.value_and_grad(rosenbrock)(x)
            u, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=rosenbrock)
            x = x + u
        return (x ** 2).sum()

    x0 = torch.tensor([-1.2, 1.0, 0.5])
    ours = torch.func.grad(_unrolled(fx.lbfgs, rosenbrock, 2))(x0)
    theirs = jax.jit(jax.jacfwd(optax_meta))(to_jnp(x0))  # compiled: half the CPU of op by op (4 s against 9)
    assert torch.isfinite(ours).all()
    assert_trees_close(ours, from_jnp(theirs), rtol=1e-4, atol=1e-5)


@pytest.mark.optax
def test_inject_hyperparams_lbfgs_matches_optax():
    """inject_hyperparams(lbfgs): memory_size becomes a 0-dim int32 tensor (as Optax makes an array of it); it
    sizes the memory at init and update reads it off the state (no host sync). It failed ("memory_size must
    be an int"); now Optax's numbers, with the default line search (its extra arguments passed through)."""
    optax = pytest.importorskip("optax")
    import jax

    params = {"x": torch.tensor([-1.2, 1.0, 0.5, -0.3])}
    fn = lambda p: rosenbrock(p["x"])  # noqa: E731
    tx = fx.inject_hyperparams(fx.lbfgs)(memory_size=3)
    otx = optax.inject_hyperparams(optax.lbfgs)(memory_size=3)
    ours, state = run_fx(tx, fn, params, 5)
    with jax.disable_jit():
        theirs, _ = run_optax(otx, fn, params, 5)
    assert_same_trajectory(ours, theirs, rtol=1e-5, atol=1e-6)
    assert state.hyperparams["memory_size"].dtype == torch.int32
    assert state.inner_state[0].diff_params_memory["x"].shape == (3, 4)


# --- DTensor leaves: 2 gloo ranks, one spawn (tests/_worlds.py) ------------------------------------------

CASES, case = _worlds.registry(worlds=(2,))


@case()
def case_dtensor_leaves(world: int) -> None:
    """lbfgs with each line search, polyak_sgd and the global dot products on Shard(0) DTensor leaves
    give the plain tensors' numbers (every inner product sums over both ranks' shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    plain = {"x": torch.tensor([-1.2, 1.0, 0.5, -0.3]), "w": torch.tensor([[0.3, -0.2], [1.1, 0.4]])}
    sharded = fx.tree.map(lambda t: distribute_tensor(t, mesh, [Shard(0)]), plain)
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    # (elementwise in w: DTensor computes cumsum, which quadratic uses, shard by shard on a Shard(0) leaf)
    fn = lambda p: rosenbrock(p["x"]) + ((p["w"] - 1.0) ** 2 + 0.1 * p["w"] ** 4).sum()  # noqa: E731
    xs, ys = fx.tree.leaves(sharded), fx.tree.leaves(plain)
    assert torch.allclose(fx.transforms._linesearch.vdot(xs, xs), fx.transforms._linesearch.vdot(ys, ys))
    for tx in (fx.lbfgs(memory_size=3), fx.lbfgs(memory_size=3, linesearch=fx.scale_by_backtracking_linesearch(
            10, store_grad=True))):
        ours, _ = run_fx(tx, fn, sharded, 4)
        expected, _ = run_fx(tx, fn, plain, 4)
        for a, b in zip(ours, expected):
            assert isinstance(a["x"], DTensor) and a["x"].placements == (Shard(0),)
            assert_trees_close(fx.tree.map(full, a), b, rtol=1e-6, atol=1e-6)
    tx = fx.polyak_sgd(max_learning_rate=0.5)
    grads = fx.tree.map(lambda p: 2 * p, sharded)
    u, _ = tx.update(grads, tx.init(sharded), sharded, value=fn(sharded))  # a DTensor value
    expected, _ = tx.update(fx.tree.map(lambda p: 2 * p, plain), tx.init(plain), plain, value=fn(plain))
    assert_trees_close(fx.tree.map(full, u), expected, rtol=1e-6, atol=1e-6)


test_case = _worlds.tests(__file__, CASES, timeout_s=240)

if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
