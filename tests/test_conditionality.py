"""Tests for fxtrain/transforms/_conditionality.py: apply_if_finite against Optax, skipped steps, errors."""

import math

import pytest
import torch

import fxtrain as fx
from fxtrain import _base
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from fxtrain.transforms._conditionality import conditionally_mask, conditionally_transform
from tests._parity import assert_pure_and_donated_agree, growing_grads, reference_trace
from tests.cases.wrappers import reads_value


# Steps whose gradients hold a NaN or an Inf: single ones, then a run of 4 (> max_consecutive_errors=2,
# so the third of the run is accepted, NaN and all), then finite again.
BAD = {2: float("nan"), 5: float("inf"), 6: float("nan"), 10: float("nan"), 11: -float("inf"), 12: float("nan"),
       13: float("nan"), 17: float("nan")}


def _grads(step):
    g = growing_grads(step)
    if step in BAD:
        g["blocks"][0][1, 0, 1] = BAD[step]
    return g


@pytest.mark.optax
def test_matches_optax_and_skipped_steps_keep_inner_state_bit_identical():
    optax = pytest.importorskip("optax")
    tx = fx.apply_if_finite(fx.chain(reference_trace(0.9), fx.scale(-0.1)), max_consecutive_errors=2)
    otx = optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), max_consecutive_errors=2)
    params = nested_params(seed=0)
    state, ostate = tx.init(params), otx.init(to_jnp(params))
    spec = fx.tree.structure(state)
    skipped = []
    for step in range(20):
        g = _grads(step)
        before = fx.tree.clone(state.inner_state)
        u, state = tx.update(g, state, params)
        ou, ostate = otx.update(to_jnp(g), ostate, to_jnp(params))
        assert fx.tree.structure(state) == spec
        assert_trees_close(u, from_jnp(ou), equal_nan=True)
        assert_trees_close(state.inner_state[0].trace, from_jnp(ostate.inner_state[0].trace), equal_nan=True)
        for field in ("notfinite_count", "last_finite", "total_notfinite"):
            assert getattr(state, field).item() == getattr(ostate, field).item(), (step, field)
        assert state.notfinite_count.dtype == state.total_notfinite.dtype == torch.int32
        if not bool(state.last_finite) and int(state.notfinite_count) <= 2:
            skipped.append(step)
            assert_trees_close(state.inner_state, before, rtol=0, atol=0, equal_nan=True)
            assert all(bool((x == 0).all()) for x in fx.tree.leaves(u))
    assert skipped == [2, 5, 6, 10, 11, 17]
    assert int(state.total_notfinite) == len(BAD)


@pytest.mark.optax
@pytest.mark.skipif(not hasattr(fx, "adam"), reason="fx.adam not built yet")
def test_adam_matches_optax():
    optax = pytest.importorskip("optax")
    tx = fx.apply_if_finite(fx.adam(1e-2), max_consecutive_errors=2)
    otx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=2)
    params = nested_params(seed=0)
    oparams = to_jnp(params)
    state, ostate = tx.init(params), otx.init(oparams)
    for step in range(12):  # before the accepted NaNs of step 12: Adam's state is NaN from there on
        g = _grads(step)
        u, state = tx.update(g, state, params)
        ou, ostate = otx.update(to_jnp(g), ostate, oparams)
        params, oparams = fx.apply_updates(params, u), optax.apply_updates(oparams, ou)
        assert_trees_close(params, from_jnp(oparams))
        assert int(state.total_notfinite) == int(ostate.total_notfinite)


def test_none_leaves_pass_and_report():
    tx = fx.apply_if_finite(reference_trace(0.5), max_consecutive_errors=0)
    params = nested_params()
    params["blocks"][1] = (None, params["blocks"][1][1])
    state = tx.init(params)
    for step in range(3):
        g = _grads(step)
        g["blocks"][1] = (None, g["blocks"][1][1])
        u, state = tx.update(g, state, params)
        assert u["blocks"][1][0] is None
    # max_consecutive_errors=0: a non-finite update is never skipped, only counted.
    assert not bool(state.last_finite) and torch.isnan(u["blocks"][0]).any()
    assert _base.report(state) == {"total_notfinite": torch.tensor(1, dtype=torch.int32)}


def test_update_is_pure_and_donated_kernel_agrees():
    tx = fx.apply_if_finite(reference_trace(0.9), max_consecutive_errors=1)
    with torch.no_grad():  # bit-exact: under no_grad the pure update runs the donated kernel on copies
        assert_pure_and_donated_agree(tx, _grads, steps=4, equal_nan=True)


def test_no_host_sync_on_meta_tensors():
    # Meta tensors carry no data: any .item() or Python branch on a value would raise.
    tx = fx.apply_if_finite(reference_trace(0.9), max_consecutive_errors=1)
    params = {"w": torch.zeros(3, device="meta")}
    u, state = tx.update({"w": torch.ones(3, device="meta")}, tx.init(params), params)
    assert u["w"].device.type == "meta" and state.notfinite_count.device.type == "meta"


def test_repr_flags_and_wrap_loss():
    tx = fx.apply_if_finite(fx.scale(-0.1), max_consecutive_errors=3)
    assert repr(tx) == "apply_if_finite(max_consecutive_errors=3, scale(-0.1))"
    assert not fx.is_elementwise(tx)  # the finiteness test reduces over every leaf
    assert tx.wrap_loss is None

    def wrap(fn, state):
        return lambda p, b: (fn(p, b), state)

    inner = fx.with_traits(fx.GradientTransformation(lambda p: "inner-state", lambda u, s, p=None: (u, s)),
                           wrap_loss=wrap)
    tx = fx.apply_if_finite(inner, max_consecutive_errors=3)
    assert _base.wrap_loss(tx, lambda p, b: 1.0, tx.init({}))(None, None) == (1.0, "inner-state")


@pytest.mark.parametrize("path", ["composable", "pure-no_grad", "donated"])
def test_inner_state_with_non_tensor_leaves(path):
    # A hand-written inner transform whose state holds a Python number: host values cannot wait for the
    # device decision, so they come from the inner transform's new state; tensors are restored on a skip.
    inner = fx.GradientTransformation(lambda p: {"calls": 0, "sum": torch.zeros(2)},
                                      lambda u, s, p=None: (u, {"calls": s["calls"] + 1, "sum": s["sum"] + u["w"]}))
    tx = fx.apply_if_finite(inner, max_consecutive_errors=2)
    state = tx.init({"w": torch.zeros(2)})
    for g in ([1.0, 2.0], [float("nan"), 1.0], [3.0, 4.0]):
        g = {"w": torch.tensor(g)}
        if path == "donated":
            u, state = fx.update_(tx, g, state)
        elif path == "pure-no_grad":
            with torch.no_grad():
                u, state = tx.update(g, state)
        else:
            u, state = tx.update(g, state)
    assert state.inner_state["calls"] == 3 and state.inner_state["sum"].tolist() == [4.0, 6.0]
    assert int(state.total_notfinite) == 1 and u["w"].tolist() == [3.0, 4.0]


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_max_consecutive_errors(bad, error):
    with pytest.raises(error, match="apply_if_finite: max_consecutive_errors"):
        fx.apply_if_finite(fx.scale(1.0), max_consecutive_errors=bad)


def test_inner_metrics_are_reported_through_apply_if_finite():
    tx = fx.apply_if_finite(fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1)), max_consecutive_errors=2)
    g = {"w": torch.full((4,), 3.0)}
    _, state = tx.update(g, tx.init(g), g)
    metrics = _base.report(state)
    assert set(metrics) >= {"total_notfinite", "grad_norm"}
    assert float(metrics["grad_norm"]) == 6.0


# --- composing with torch.func -------------------------------------------------------------------------

def _stack(trees):
    return fx.tree.map(lambda *xs: torch.stack(xs), *trees)


def _member(t, i):
    return fx.tree.map(lambda x: x[i], t)


def test_vmap_over_an_ensemble_equals_separate_runs():
    # 3 models whose gradients go non-finite at different steps: each member decides for itself.
    tx = fx.apply_if_finite(fx.sgd(0.1, momentum=0.9), max_consecutive_errors=1)
    bad = {0: {2: float("nan")}, 1: {3: float("inf"), 4: float("nan")}, 2: {}}  # member -> step -> value
    members = [nested_params(seed=i) for i in range(3)]

    def grads(i, step):
        g = growing_grads(10 * i + step)
        if step in bad[i]:
            g["blocks"][0][0, 1, 0] = bad[i][step]
        return g

    runs = []
    for i, params in enumerate(members):
        state, history = tx.init(params), []
        for step in range(6):
            u, state = tx.update(grads(i, step), state, params)
            history.append((u, state))
            params = fx.apply_updates(params, u)
        runs.append((history, params))

    update = torch.func.vmap(tx.update)
    params, state = _stack(members), _stack([tx.init(p) for p in members])
    for step in range(6):
        u, state = update(_stack([grads(i, step) for i in range(3)]), state, params)
        params = fx.apply_updates(params, u)
        for i, (history, _) in enumerate(runs):
            assert_trees_close(_member(u, i), history[step][0], rtol=1e-6, atol=1e-6, equal_nan=True)
            assert_trees_close(_member(state, i), history[step][1], rtol=1e-6, atol=1e-6, equal_nan=True)
    assert state.total_notfinite.tolist() == [1, 2, 0]
    assert state.last_finite.tolist() == [True, True, True]
    for i, (_, p_ref) in enumerate(runs):  # member 1's second non-finite step in a row was accepted: NaN
        assert_trees_close(_member(params, i), p_ref, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.optax
def test_grad_through_skipped_updates_matches_optax():
    """d(a function of the params after 6 steps, one of them skipped) / d(every gradient, the learning rate)."""
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp

    params = nested_params(seed=0)
    grads = [_grads(step) for step in range(6)]  # step 2 holds a NaN: skipped, and its gradient is zero
    weights = nested_params(seed=99)

    def objective(grads, lr):
        tx = fx.apply_if_finite(fx.sgd(lr, momentum=0.9), max_consecutive_errors=1)
        p, state = params, tx.init(params)
        for g in grads:
            u, state = tx.update(g, state, p)
            p = fx.apply_updates(p, u)
        return sum(((w * x) ** 2).sum() for w, x in zip(fx.tree.leaves(weights), fx.tree.leaves(p)))

    def o_objective(grads, lr):
        otx = optax.apply_if_finite(optax.sgd(lr, momentum=0.9), max_consecutive_errors=1)
        p = to_jnp(params)
        state = otx.init(p)
        for g in grads:
            u, state = otx.update(g, state, p)
            p = optax.apply_updates(p, u)
        return sum(jnp.sum((w * x) ** 2) for w, x in zip(jax.tree.leaves(to_jnp(weights)), jax.tree.leaves(p)))

    d_grads, d_lr = torch.func.grad(objective, argnums=(0, 1))(grads, torch.tensor(0.1))
    o_grads, o_lr = jax.grad(o_objective, argnums=(0, 1))(to_jnp(grads), jnp.float32(0.1))
    assert_trees_close(d_grads, from_jnp(o_grads), rtol=1e-5, atol=1e-6)
    assert all(float(x.abs().max()) == 0 for x in fx.tree.leaves(d_grads[2]))  # the skipped step's
    assert math.isfinite(float(d_lr)) and math.isclose(float(d_lr), float(o_lr), rel_tol=1e-5)


# --- Optax's cases (optax/transforms/_conditionality_test.py), inputs and expected numbers -----------------

def _with_python_number_state():
    # Optax's _build_sgd_extra_args: an inner state {'foo': 1} (a Python number; parity bug 3) and a
    # transform reading an extra argument.
    def update_fn(grads, state, params=None, *, foo=None, **extra_args):
        return grads, state

    return fx.chain(fx.sgd(1.0), fx.GradientTransformation(lambda params: {"foo": 1}, update_fn))


@pytest.mark.parametrize("path", ["pure", "donated"])
@pytest.mark.parametrize("build", [lambda: fx.sgd(1.0), lambda: fx.sgd(1.0, momentum=0.0), _with_python_number_state],
                         ids=["sgd", "stateful_sgd", "sgd_extra_args"])
def test_optax_apply_if_finite(build, path):
    tx = fx.apply_if_finite(build(), 2)
    params = torch.tensor(0.0)
    state = tx.init(params)

    def step(x):  # the gradient of p * x
        nonlocal params, state
        g = torch.tensor(x)
        u, state = fx.update_(tx, g, state, params) if path == "donated" else tx.update(g, state, params)
        params = fx.apply_updates(params, u)

    step(1.0)
    assert params.item() == -1.0 and bool(state.last_finite)
    for expected in (-1.0, -2.0):
        for k in range(2):
            step(math.nan)
            assert params.item() == expected and not bool(state.last_finite) and int(state.notfinite_count) == k + 1
        if expected == -1.0:
            step(1.0)
            assert params.item() == -2.0 and bool(state.last_finite)
    step(math.nan)  # the third in a row is accepted
    assert math.isnan(params.item()) and int(state.total_notfinite) == 5


@fx.transform(elementwise=True)
def _zero_nans():
    """Optax's zero_nans (written here): NaNs become 0; the state says, per leaf, whether one was found."""
    def init_fn(params):
        return {"found_nan": fx.tree.map(lambda p: torch.zeros((), dtype=torch.bool), params)}

    def update_fn(updates, state, params=None):
        found = fx.tree.map(lambda u: u.isnan().any(), updates)
        return fx.tree.map(lambda u: torch.nan_to_num(u, nan=0.0, posinf=math.inf, neginf=-math.inf), updates), \
            {"found_nan": found}

    return fx.GradientTransformation(init_fn, update_fn)


WRAPPERS = {"transform": conditionally_transform, "mask": conditionally_mask}


@pytest.mark.parametrize("wrapper", ["transform", "mask"])
def test_optax_conditionally_stateless_inner(wrapper):
    tx = WRAPPERS[wrapper](fx.scale(2.0), lambda step: step < 3)
    state = tx.init(torch.zeros(()))
    for _ in range(3):
        u, state = tx.update(torch.ones(()), state)
        assert u.item() == 2.0
    for _ in range(5):  # the inner transform no longer applies
        u, state = tx.update(torch.ones(()), state)
        assert u.item() == (1.0 if wrapper == "transform" else 0.0)


@pytest.mark.parametrize("path", ["pure", "donated"])
@pytest.mark.parametrize("wrapper", ["transform", "mask"])
def test_optax_conditionally_stateful_inner(wrapper, path):
    tx = WRAPPERS[wrapper](_zero_nans(), lambda step: step < 3)
    state = tx.init(torch.zeros(()))

    def step(x):
        nonlocal state
        g = torch.tensor(x)
        u, state = fx.update_(tx, g, state) if path == "donated" else tx.update(g, state)
        return u

    for _ in range(2):
        assert step(math.nan).item() == 0.0 and bool(state.inner_state["found_nan"])
    assert step(1.0).item() == 1.0 and not bool(state.inner_state["found_nan"])
    for _ in range(5):  # the inner state is no longer updated
        u = step(math.nan)
        assert math.isnan(u.item()) if wrapper == "transform" else u.item() == 0.0
        assert not bool(state.inner_state["found_nan"])
    assert int(state.step) == 8


def test_optax_conditionally_mask_with_extra_args():
    def should_update(step, loss, **extra_args):
        return loss > 0.1

    tx = conditionally_mask(fx.scale(2.0), should_update, forward_extra_args=True)
    assert fx.traits(tx).extra_args
    state = tx.init(torch.zeros(()))
    for _ in range(3):
        u, state = tx.update(torch.ones(()), state, loss=torch.tensor(0.2))
        assert u.item() == 2.0
    for _ in range(5):
        u, state = tx.update(torch.ones(()), state, loss=torch.tensor(0.0))
        assert u.item() == 0.0


def test_condition_decided_on_the_host_when_it_is_a_python_bool():
    calls = []
    tx = conditionally_transform(fx.scale(2.0), lambda step: calls.append(1) or len(calls) <= 1)
    state = tx.init(torch.zeros(2))
    u, state = tx.update(torch.ones(2), state)
    v, state = tx.update(torch.ones(2), state)
    assert u.tolist() == [2.0, 2.0] and v.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="conditionally_transform: should_transform_fn must be a callable"):
        conditionally_transform(fx.scale(2.0), True)




@pytest.mark.optax
@pytest.mark.parametrize("wrapper", ["transform", "mask"])
def test_conditionally_matches_optax_over_20_steps(wrapper):
    optax = pytest.importorskip("optax")
    from tests._parity import assert_parity

    def every_third(step):
        return step % 3 != 0

    import jax

    ours = WRAPPERS[wrapper](fx.sgd(0.1, momentum=0.9), every_third)
    theirs = getattr(optax, f"conditionally_{wrapper}")(optax.sgd(0.1, momentum=0.9), every_third)
    # jitted: op by op, lax.cond compiles on every call
    assert_parity(ours, optax.GradientTransformation(theirs.init, jax.jit(theirs.update)))


def test_extra_args_reach_the_inner_transforms():
    inner = reads_value()
    for tx in (fx.apply_if_finite(inner, 2), conditionally_transform(inner, lambda s: s < 5),
               conditionally_mask(inner, lambda s: s < 5)):
        assert fx.traits(tx).extra_args
        u, _ = tx.update(torch.ones(2), tx.init(torch.zeros(2)), value=torch.tensor(2.0))
        assert u.tolist() == [3.0, 3.0]
        u, _ = fx.update_(tx, torch.ones(2), tx.init(torch.zeros(2)), value=torch.tensor(2.0))
        assert u.tolist() == [3.0, 3.0]
    assert not fx.traits(fx.apply_if_finite(fx.sgd(0.1), 2)).extra_args
    assert not fx.traits(conditionally_mask(fx.sgd(0.1), lambda s: s < 5)).extra_args
