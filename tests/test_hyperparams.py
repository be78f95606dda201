"""Tests for fxtrain/transforms/_hyperparams.py: inject_hyperparams against Optax, state, metrics, errors,
and composed with torch.func (vmap over hyperparameters, hypergradients) against Optax under jax."""

import inspect
from typing import Any

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain import _base, tree
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests import cases
from tests._parity import assert_pure_and_donated_agree, growing_grads, noise, reference_trace


def _sgd(learning_rate, momentum=0.9):
    """Optax's ``sgd`` with momentum: ``chain(trace(momentum), scale(-learning_rate))``."""
    return fx.chain(reference_trace(momentum), fx.scale(-learning_rate))


def _run(tx, otx, steps, change=None, rtol=1e-5, atol=1e-7):
    """Runs fxtrain and Optax side by side; ``change(step, state, ostate)`` may edit both states."""
    optax = pytest.importorskip("optax")
    params = nested_params(seed=0)
    oparams = to_jnp(params)
    state, ostate = tx.init(params), otx.init(oparams)
    spec = fx.tree.structure(state)
    for step in range(steps):
        if change is not None:
            change(step, state, ostate)
        g = growing_grads(step)
        u, state = tx.update(g, state, params)
        ou, ostate = otx.update(to_jnp(g), ostate, oparams)
        params, oparams = fx.apply_updates(params, u), optax.apply_updates(oparams, ou)
        assert fx.tree.structure(state) == spec, f"state structure changed at step {step}"
        assert int(state.count) == int(ostate.count) == step + 1
        assert_trees_close(state.hyperparams, from_jnp(dict(ostate.hyperparams)), rtol=1e-6, atol=0)
        assert_trees_close(u, from_jnp(ou), rtol=rtol, atol=atol)
        assert_trees_close(params, from_jnp(oparams), rtol=rtol, atol=atol)
    return state, ostate


# --- Optax parity ------------------------------------------------------------------------------

@pytest.mark.optax
def test_schedule_and_midrun_change_match_optax():
    optax = pytest.importorskip("optax")
    tx = fx.inject_hyperparams(_sgd)(learning_rate=fx.warmup_cosine_decay_schedule(0.0, 0.1, 5, 25), momentum=0.9)
    otx = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.warmup_cosine_decay_schedule(0.0, 0.1, 5, 25),
                                              momentum=0.9)

    def change(step, state, ostate):
        if step == 8:  # a Python number, as in Optax's documentation
            state.hyperparams["momentum"] = ostate.hyperparams["momentum"] = 0.5
        if step == 15:  # a tensor
            state.hyperparams["momentum"] = torch.tensor(0.7)
            ostate.hyperparams["momentum"] = to_jnp(torch.tensor(0.7))

    state, ostate = _run(tx, otx, steps=30, change=change)
    assert_trees_close(state.inner_state[0].trace, from_jnp(ostate.inner_state[0].trace))
    assert float(state.hyperparams["momentum"]) == pytest.approx(0.7)


@pytest.mark.optax
@pytest.mark.skipif(not hasattr(fx, "adamw"), reason="fx.adamw not built yet")
def test_adamw_with_schedule_and_midrun_change_matches_optax():
    optax = pytest.importorskip("optax")
    tx = fx.inject_hyperparams(fx.adamw)(learning_rate=fx.cosine_decay_schedule(1e-2, 20, alpha=0.1),
                                         weight_decay=1e-4)
    otx = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.cosine_decay_schedule(1e-2, 20, alpha=0.1),
                                                weight_decay=1e-4)

    def change(step, state, ostate):
        if step == 10:
            state.hyperparams["weight_decay"] = ostate.hyperparams["weight_decay"] = 0.1
            state.hyperparams["b1"] = ostate.hyperparams["b1"] = 0.5

    _run(tx, otx, steps=25, change=change)


@pytest.mark.optax
def test_scheduled_value_written_into_state_is_overridden_as_in_optax():
    optax = pytest.importorskip("optax")
    tx = fx.inject_hyperparams(fx.scale)(step_size=fx.linear_schedule(1.0, 0.0, 10))
    otx = optax.inject_hyperparams(optax.scale)(step_size=optax.linear_schedule(1.0, 0.0, 10))

    def change(step, state, ostate):
        state.hyperparams["step_size"] = ostate.hyperparams["step_size"] = 123.0

    _run(tx, otx, steps=12, change=change)


# --- state, metrics, None leaves, purity ----------------------------------------------------------

def test_learning_rate_reported_and_state_stable():
    sched = fx.cosine_decay_schedule(init_value=0.1, decay_steps=10)
    tx = fx.inject_hyperparams(_sgd)(learning_rate=sched)
    params = nested_params()
    state = tx.init(params)
    assert _base.report(state)["learning_rate"].item() == pytest.approx(0.1)
    spec = fx.tree.structure(state)
    for step in range(12):
        _, state = tx.update(growing_grads(step), state, params)
        metrics = _base.report(state)
        assert set(metrics) == {"learning_rate", "momentum"}
        assert metrics["learning_rate"].item() == sched(step).item()  # the value used by this update
        assert fx.tree.structure(state) == spec
        assert state.count.dtype == torch.int32 and state.count.shape == ()


def test_train_step_metrics_show_learning_rate():
    tx = fx.inject_hyperparams(_sgd)(learning_rate=fx.linear_schedule(1.0, 0.0, 4), momentum=0.0)
    step = fx.train_step(lambda p, b: ((p["w"] - b) ** 2).sum(), tx)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    seen = []
    for _ in range(3):
        params, state, metrics = step(params, state, torch.ones(2))
        seen.append(metrics["learning_rate"].item())
    assert seen == [1.0, 0.75, 0.5]


@pytest.mark.parametrize("donate", [True, False])
def test_train_step_reports_what_varies_and_the_state_keeps_every_hyperparameter(donate):
    # Issue 19: b1, b2, eps (constants) showed in every step's metrics. learning_rate and scheduled values
    # show, given directly, inside chain and named_chain; the state keeps all of them, as Optax's.
    def loss(p, b):
        return ((p["w"] - b) ** 2).sum()

    adam = fx.inject_hyperparams(fx.adam)
    cases = [
        (adam(learning_rate=fx.linear_schedule(0.1, 0.0, 4)), {"learning_rate"}),
        (adam(learning_rate=0.1), {"learning_rate"}),
        (adam(learning_rate=0.1, b1=fx.constant_schedule(0.8)), {"learning_rate", "b1"}),
        (fx.chain(fx.clip_by_global_norm(1.0), adam(learning_rate=fx.constant_schedule(0.1))),
         {"learning_rate", "grad_norm"}),
        (fx.named_chain(("opt", adam(learning_rate=0.1, eps=fx.constant_schedule(1e-6)))), {"learning_rate", "eps"}),
        # Through the wrappers of the runner's stack (fxtrain._base.forwarded passes the constants on).
        (fx.accumulate(fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), fx.sharded_apply(adam(learning_rate=0.1))),
                                   "params=float32,compute=float32,output=float32"), every=1),
         {"learning_rate", "grad_norm", "emitted", "skipped", "loss_scale"}),
        (fx.apply_if_finite(adam(learning_rate=0.1), 3), {"learning_rate", "total_notfinite"}),
    ]
    for tx, shown in cases:
        params = {"w": torch.zeros(2)}
        state = tx.init(params)
        _, state, metrics = fx.train_step(loss, tx, donate=donate)(params, state, torch.ones(2))
        assert set(metrics) == {"loss"} | shown, tx
        hyper = fx.tree.get(state, "hyperparams")
        assert set(hyper) == {"learning_rate", "b1", "b2", "eps", "eps_root"}
        assert float(hyper["b2"]) == pytest.approx(0.999)


def test_none_leaves_pass():
    tx = fx.inject_hyperparams(_sgd)(learning_rate=fx.constant_schedule(0.1))
    params = nested_params()
    params["blocks"][1] = (None, params["blocks"][1][1])
    state = tx.init(params)
    for step in range(3):
        g = growing_grads(step)
        g["blocks"][1] = (None, g["blocks"][1][1])
        u, state = tx.update(g, state, params)
        assert u["blocks"][1][0] is None
        params = fx.apply_updates(params, u)


def test_update_is_pure_and_donated_kernel_agrees():
    tx = fx.inject_hyperparams(_sgd)(learning_rate=fx.linear_schedule(0.1, 0.0, 5), momentum=0.9)
    with torch.no_grad():  # bit-exact claim: the pure update then runs the donated (in-place) kernel on copies
        assert_pure_and_donated_agree(tx, growing_grads, steps=3)


def test_no_host_sync_on_meta_tensors():
    # Meta tensors carry no data: any .item() or Python branch on a value would raise.
    tx = fx.inject_hyperparams(_sgd)(learning_rate=fx.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10))
    params = {"w": torch.zeros(3, device="meta")}
    state = tx.init(params)
    for _ in range(2):
        u, state = tx.update({"w": torch.ones(3, device="meta")}, state, params)
    assert u["w"].device.type == "meta" and state.hyperparams["learning_rate"].device.type == "meta"


# --- dtypes, static arguments, flags ------------------------------------------------------------

def test_hyperparameter_dtypes():
    build = fx.inject_hyperparams(_sgd)
    f32 = build(learning_rate=0.1).init(nested_params())
    assert f32.hyperparams["learning_rate"].dtype == torch.float32
    # bfloat16 params keep float32 hyperparameters (Optax would round momentum=0.999 to 1.0 in bfloat16).
    bf16 = build(learning_rate=0.1, momentum=0.999).init(nested_params(dtype=torch.bfloat16))
    assert bf16.hyperparams["momentum"].dtype == torch.float32 and bf16.hyperparams["momentum"].item() != 1.0
    f64 = build(learning_rate=fx.constant_schedule(0.1)).init(nested_params(dtype=torch.float64))
    assert f64.hyperparams["learning_rate"].dtype == torch.float64
    forced = fx.inject_hyperparams(_sgd, hyperparam_dtype=torch.bfloat16)(learning_rate=0.1)
    assert forced.init(nested_params()).hyperparams["learning_rate"].dtype == torch.bfloat16
    given = build(learning_rate=torch.tensor(0.1, dtype=torch.float64)).init(nested_params())
    assert given.hyperparams["learning_rate"].dtype == torch.float64  # a tensor keeps its dtype (as in Optax)


def test_static_bool_and_callable_arguments():
    seen = {}

    def factory(step_size, flag=False, fn=None, every=2):
        seen.update(step_size=step_size, flag=flag, fn=fn, every=every)
        return fx.scale(step_size)

    tx = fx.inject_hyperparams(factory, static_args="fn")(0.5, flag=True, fn=abs)
    state = tx.init({"w": torch.ones(1)})
    assert set(state.hyperparams) == {"step_size", "every"}
    assert state.hyperparams["every"].dtype == torch.int32  # ints are numeric hyperparameters, as in Optax
    u, state = tx.update({"w": torch.ones(1)}, state)
    assert u["w"].tolist() == [0.5]
    assert seen["flag"] is True and seen["fn"] is abs and isinstance(seen["step_size"], torch.Tensor)


def test_repr_and_flags():
    tx = fx.inject_hyperparams(_sgd)(learning_rate=fx.cosine_decay_schedule(0.1, 100), momentum=0.5)
    assert repr(tx) == ("inject_hyperparams(_sgd)(learning_rate=cosine_decay_schedule(init_value=0.1, "
                        "decay_steps=100), momentum=0.5)")
    assert fx.is_elementwise(tx)
    tx = fx.inject_hyperparams(fx.scale, static_args=(), hyperparam_dtype=torch.float64)(0.1)
    assert repr(tx) == "inject_hyperparams(scale, hyperparam_dtype=torch.float64)(step_size=0.1)"
    tx = fx.inject_hyperparams(lambda step_size: fx.stateless(lambda u, p: u))(0.1)
    assert not fx.is_elementwise(tx)


def test_wrap_loss_sees_current_hyperparameters():
    def scaled(factor):
        def wrap(fn, state):
            def wrapped(params, batch):
                objective, rest = fn(params, batch)
                return objective * factor, rest
            return wrapped
        return fx.with_traits(fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (u, s)),
                              wrap_loss=wrap)

    tx = fx.inject_hyperparams(scaled)(factor=fx.linear_schedule(1.0, 3.0, 2))
    params = {"w": torch.ones(1)}
    state = tx.init(params)
    fn = lambda p, b: (p["w"].sum(), (None, None))  # noqa: E731
    assert _base.wrap_loss(tx, fn, state)(params, None)[0].item() == 1.0
    _, state = tx.update({"w": torch.ones(1)}, state, params)
    assert _base.wrap_loss(tx, fn, state)(params, None)[0].item() == 2.0
    assert fx.inject_hyperparams(fx.scale)(0.1).wrap_loss is None


# --- bad input ----------------------------------------------------------------------------------

def test_unknown_argument_names_factory():
    with pytest.raises(TypeError, match=r"inject_hyperparams\(scale\): step is not an argument of scale "
                                        r"\(did you mean step_size\?\)"):
        fx.inject_hyperparams(fx.scale)(step=0.1)


def test_bad_static_args_and_dtype():
    with pytest.raises(ValueError, match=r"static_args \['nope'\] are not arguments of scale"):
        fx.inject_hyperparams(fx.scale, static_args="nope")
    with pytest.raises(TypeError, match="hyperparam_dtype must be a torch.dtype"):
        fx.inject_hyperparams(fx.scale, hyperparam_dtype="float32")


# --- composing with torch.func: an ensemble of learning rates, hypergradients ----------------------

LRS = [1e-3, 3e-3, 1e-2, 3e-2]
STEPS = 20


def _stack(t: Any, n: int) -> Any:
    return tree.map(lambda x: torch.stack([x] * n), t)


def _ensemble(tx, lrs, steps):
    """``len(lrs)`` models (same start), each with its own learning rate, in one vmapped update per step;
    gradients ``0.5 * params + noise_k`` as in the parity tests. Returns (updates per step, params, state)."""
    params = _stack(nested_params(), len(lrs))
    state = _stack(tx.init(nested_params()), len(lrs))
    state.hyperparams["learning_rate"] = torch.tensor(lrs)
    update = torch.func.vmap(tx.update)
    history = []
    for k in range(steps):
        g = tree.map(lambda p, n: 0.5 * p + n, params, noise(k))  # noise broadcasts over the models
        u, state = update(g, state, params)
        history.append(u)
        params = fx.apply_updates(params, u)
    return history, params, state


def test_vmap_over_learning_rates_equals_separate_runs():
    tx = fx.inject_hyperparams(fx.adam)(learning_rate=0.1)
    history, params, state = _ensemble(tx, LRS, STEPS)
    for i, lr in enumerate(LRS):
        one = fx.inject_hyperparams(fx.adam)(learning_rate=lr)
        p = nested_params()
        s = one.init(p)
        for k in range(STEPS):
            u, s = one.update(tree.map(lambda x, n: 0.5 * x + n, p, noise(k)), s, p)
            assert_trees_close(tree.map(lambda x: x[i], history[k]), u, rtol=1e-6, atol=1e-7)
            p = fx.apply_updates(p, u)
        assert_trees_close(tree.map(lambda x: x[i], params), p, rtol=1e-6, atol=1e-7)
        assert_trees_close(tree.map(lambda x: x[i], state), s, rtol=1e-6, atol=1e-7)
    assert state.count.tolist() == [STEPS] * len(LRS)


@pytest.mark.optax
def test_vmap_over_learning_rates_matches_optax_under_jax_vmap():
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp

    history, params, state = _ensemble(fx.inject_hyperparams(fx.adam)(learning_rate=0.1), LRS, STEPS)
    otx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    op = jax.tree.map(lambda x: jnp.stack([x] * len(LRS)), to_jnp(nested_params()))
    ostate = jax.tree.map(lambda x: jnp.stack([x] * len(LRS)), otx.init(to_jnp(nested_params())))
    ostate.hyperparams["learning_rate"] = jnp.asarray(LRS, dtype=jnp.float32)
    update = jax.vmap(otx.update)
    for k in range(STEPS):
        g = jax.tree.map(lambda p, n: 0.5 * p + n, op, to_jnp(noise(k)))
        ou, ostate = update(g, ostate, op)
        op = optax.apply_updates(op, ou)
        assert_trees_close(history[k], from_jnp(ou), rtol=1e-5, atol=1e-7)
    assert_trees_close(params, from_jnp(op), rtol=1e-5, atol=1e-7)
    assert_trees_close(state.inner_state[0].mu, from_jnp(ostate.inner_state[0].mu), rtol=1e-5, atol=1e-7)
    assert_trees_close(state.inner_state[0].nu, from_jnp(ostate.inner_state[0].nu), rtol=1e-5, atol=1e-7)


def _loss_after_updates(tx, state, steps=3):
    """``sum |params|^2`` after ``steps`` updates from ``state`` (gradients ``0.5 * params + noise_k``)."""
    p = nested_params()
    for k in range(steps):
        u, state = tx.update(tree.map(lambda x, n: 0.5 * x + n, p, noise(k)), state, p)
        p = fx.apply_updates(p, u)
    return sum((x ** 2).sum() for x in tree.leaves(p))


@pytest.mark.optax
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # jvp's first import
def test_grad_wrt_injected_learning_rate_matches_optax_under_jax_grad():
    optax = pytest.importorskip("optax")
    import jax

    tx = fx.inject_hyperparams(fx.adam)(learning_rate=0.1)

    def loss(lr):
        state = tx.init(nested_params())
        state.hyperparams["learning_rate"] = lr
        return _loss_after_updates(tx, state)

    otx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)

    def oloss(lr):
        p = to_jnp(nested_params())
        state = otx.init(p)
        state.hyperparams["learning_rate"] = lr
        for k in range(3):
            u, state = otx.update(jax.tree.map(lambda x, n: 0.5 * x + n, p, to_jnp(noise(k))), state, p)
            p = optax.apply_updates(p, u)
        return sum((x ** 2).sum() for x in jax.tree.leaves(p))

    expected = float(jax.grad(oloss)(np.float32(0.1)))
    assert abs(expected) > 1.0  # a real dependence, not a vacuous 0 == 0
    got = torch.func.grad(loss)(torch.tensor(0.1))
    assert float(got) == pytest.approx(expected, rel=1e-4)
    # Plain autograd on the state tensor, and forward mode, agree.
    lr = torch.tensor(0.1, requires_grad=True)
    loss(lr).backward()
    assert float(lr.grad) == pytest.approx(float(got), rel=1e-5)
    # (forward mode: the loss's own gradients would be 0.5 * x on a 0-dim leaf, whose tangent torch promotes to
    # float64 under jvp, pytorch/functorch#1073; the hyperparameter's tangent is what is checked here)
    _, tangent = torch.func.jvp(lambda lr: _loss_after_updates(tx, _with_lr(tx, lr), steps=1),
                                (torch.tensor(0.1),), (torch.tensor(1.0),))
    one_step = torch.func.grad(lambda lr: _loss_after_updates(tx, _with_lr(tx, lr), steps=1))(torch.tensor(0.1))
    assert float(tangent) == pytest.approx(float(one_step), rel=1e-5)


def _with_lr(tx, lr):
    state = tx.init(nested_params())
    state.hyperparams["learning_rate"] = lr
    return state


def test_hyperparameter_tensor_that_requires_grad_is_never_detached():
    lr = torch.tensor(0.1, requires_grad=True)
    tx = fx.inject_hyperparams(fx.adam)(learning_rate=lr, b1=torch.tensor(0.8, requires_grad=True))
    state = tx.init(nested_params())
    assert state.hyperparams["learning_rate"].requires_grad  # a differentiable copy, not lr itself
    assert state.hyperparams["learning_rate"] is not lr
    _loss_after_updates(tx, state).backward()
    fixed = fx.inject_hyperparams(fx.adam)(learning_rate=0.1, b1=0.8)

    def loss(lr):
        s = fixed.init(nested_params())
        s.hyperparams["learning_rate"] = lr
        return _loss_after_updates(fixed, s)

    assert float(lr.grad) == pytest.approx(float(torch.func.grad(loss)(torch.tensor(0.1))), rel=1e-5)


def test_bad_hyperparameter_tensors_are_named():
    build = fx.inject_hyperparams(fx.adam)
    with pytest.raises(ValueError, match=r"inject_hyperparams\(adam\): hyperparameter learning_rate must be a "
                                         r"number or a 0-dim tensor, got a tensor of shape \(4,\)"):
        build(learning_rate=torch.tensor(LRS))
    with pytest.raises(ValueError, match=r"hyperparameter b1 must be a number or a 0-dim tensor, got an array"):
        build(learning_rate=0.1, b1=np.array([0.9, 0.8]))
    with pytest.raises(ValueError, match=r"inject_hyperparams\(adam\): adam: learning_rate must be a number or a "
                                         r"0-dim floating-point tensor, got a tensor of dtype torch.int64"):
        build(learning_rate=torch.tensor(1))  # an int tensor is an int hyperparameter (as in Optax): adam refuses it
    tx = build(learning_rate=0.1)
    params = nested_params()
    state = tx.init(params)
    state.hyperparams["learning_rate"] = torch.tensor(LRS)  # stacked, but the update is not vmapped
    with pytest.raises(ValueError, match=r"inject_hyperparams\(adam\).*: state.hyperparams\['learning_rate'\] must "
                                         r"be a number or a 0-dim tensor, got a tensor of shape \(4,\)"):
        tx.update(params, state, params)
    state.hyperparams["learning_rate"] = torch.tensor(1)  # an int tensor where a float was given
    with pytest.raises(ValueError, match=r"inject_hyperparams\(adam\): state.hyperparams\['learning_rate'\] must "
                                         r"be floating-point \(its value was\), got a tensor of dtype torch.int64"):
        fx.update_(tx, tree.clone(params), state, params)
    state.hyperparams["learning_rate"] = 1  # a Python int for a float hyperparameter: a float, as in the state
    u, state = tx.update(params, state, params)
    assert state.hyperparams["learning_rate"].dtype == torch.float32


# --- integers where floats are expected (issue 25) ------------------------------------------------
# Hydra reads `weight_decay=0` as an int; inject_hyperparams made it an int32 tensor, which the optimizer
# refused with a traceback. Integers given for a float argument become floats of the params' dtype: the
# updates are those with the float given, bit for bit; counts stay int32 (as in Optax).
INTEGER_HYPERPARAMS = {
    "adamw.weight_decay": (fx.adamw, dict(learning_rate=1e-2, weight_decay=0), dict(weight_decay=0.0)),
    "adamw.learning_rate": (fx.adamw, dict(learning_rate=1, weight_decay=1e-2), dict(learning_rate=1.0)),
    "sgd.momentum": (fx.sgd, dict(learning_rate=1, momentum=0), dict(learning_rate=1.0, momentum=0.0)),
    "adam.b1_eps": (fx.adam, dict(learning_rate=1e-2, b1=0, eps=0), dict(b1=0.0, eps=0.0)),
    "lion.b1": (fx.lion, dict(learning_rate=1, b1=0), dict(learning_rate=1.0, b1=0.0)),
    "rmsprop": (fx.rmsprop, dict(learning_rate=1, decay=1, momentum=0), dict(learning_rate=1.0, decay=1.0,
                                                                          momentum=0.0)),
    "clip_by_global_norm": (fx.clip_by_global_norm, dict(max_norm=1), dict(max_norm=1.0)),
    "muon": (fx.contrib.muon, dict(learning_rate=0.02, weight_decay=0, adam_eps_root=0),
             dict(weight_decay=0.0, adam_eps_root=0.0)),
}


def _run_three(tx, params, donate):
    state, out = tx.init(params), []
    for k in range(3):
        g = fx.tree.map(lambda p: 0.5 * p - 0.1 * k, params)
        if donate:
            u, state = fx.update_(tx, fx.tree.clone(g), state, params)
        else:
            with torch.enable_grad():
                u, state = tx.update(g, state, params)
        out.append(u)
        params = fx.apply_updates(params, u)
    return out, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("case", INTEGER_HYPERPARAMS)
def test_integer_given_for_a_float_hyperparameter(case, donate, dtype):
    factory, ints, floats = INTEGER_HYPERPARAMS[case]
    params = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0), dtype=dtype),
              "b": torch.tensor([-1.0, 0.3, 0.7], dtype=dtype)}
    for build in (factory, fx.inject_hyperparams(factory)):  # each against itself with the floats given
        expected, _ = _run_three(build(**{**ints, **floats}), params, donate)
        actual, state = _run_three(build(**ints), params, donate)
        for a, e in zip(actual, expected):
            assert_trees_close(a, e, rtol=0, atol=0)
    for k in floats:  # the injected value is a float of the params' dtype
        assert state.hyperparams[k].dtype == dtype, (k, state.hyperparams[k])


def test_integer_for_a_counting_hyperparameter_stays_an_integer():
    state = fx.inject_hyperparams(fx.contrib.muon)(learning_rate=1, ns_steps=3).init({"w": torch.ones(2, 2)})
    assert state.hyperparams["ns_steps"].dtype == torch.int32
    assert state.hyperparams["learning_rate"].dtype == torch.float32
    # an int written into the state later for a float argument is read as a float too
    tx = fx.inject_hyperparams(fx.sgd)(learning_rate=1)
    p = {"w": torch.ones(2)}
    state = tx.init(p)
    state.hyperparams["learning_rate"] = 2
    u, state = tx.update(p, state, p)
    assert u["w"].tolist() == [-2.0, -2.0] and state.hyperparams["learning_rate"].dtype == torch.float32


# --- every catalogue optimizer's non-float arguments through inject_hyperparams (generated) --------------

def _factory(name: str):
    return getattr(fx, name, None) or getattr(fx.contrib, name)


def _kind(p) -> str | None:
    """What a factory argument is when it is not a float: 'key', 'bool', 'int', 'callable' (a mask, a function
    the factory calls), else None (floats, dtypes, strings, sub-transforms: not generated here)."""
    note = str(p.annotation)
    if p.name == "key" or "Generator" in note:
        return "key"
    if "Mask" in note or "Callable" in note.replace("Scalar | Callable", "") and "LearningRate" not in note:
        return "callable"
    if isinstance(p.default, bool) or note == "bool":
        return "bool"
    if (isinstance(p.default, int) and not isinstance(p.default, bool)) or "int" in {t.strip() for t in note.split("|")}:
        return "int"
    return None


def _value(p, kind: str):
    """A value of ``p`` other than its default, of its kind."""
    if kind == "key":
        return 3
    if kind == "bool":
        return not p.default if isinstance(p.default, bool) else True
    if kind == "int":  # (adafactor's decay_offset=1 makes its first update NaN: offsets keep their default 0)
        return (p.default + 1 if p.default else 0) if isinstance(p.default, int) else 2
    if callable(p.default) and not isinstance(p.default, fx.GradientTransformation):
        return p.default  # a function the factory calls (adopt's clip_value_fn)
    return lambda params: fx.tree.map(lambda x: x.ndim > 1, params)  # a mask: the matrices only


def _required(name: str) -> dict:
    args = {}
    for k, p in inspect.signature(_factory(name)).parameters.items():
        if p.default is inspect.Parameter.empty or k == "learning_rate":  # adadelta's default is None
            args[k] = fx.sgd(0.1) if "GradientTransformation" in str(p.annotation) else 1e-2
    return args


CATALOGUE = sorted({"sgd", "adam", "adamw", "lion", "rmsprop", "adagrad"} | set(cases.merged("OPTIMIZERS")))
NON_FLOAT = [(name, k, kind) for name in CATALOGUE for k, p in inspect.signature(_factory(name)).parameters.items()
             if p.default is not inspect.Parameter.empty and (kind := _kind(p)) is not None]


def test_the_non_float_cases_are_generated_from_the_catalogue():
    kinds = {kind for _, _, kind in NON_FLOAT}
    assert ("noisy_sgd", "key", "key") in NON_FLOAT and kinds == {"key", "bool", "int", "callable"}, NON_FLOAT


def _extra(name: str, tx, f, params, grads, opaque: bool) -> dict:
    """The extra arguments of an update: the line search's (lbfgs), sam's grad_fn in opaque mode, ``value``."""
    if opaque:
        return {"grad_fn": lambda p, i: fx.tree.map(lambda x: x + 1.0, p)}
    if not fx.traits(tx).extra_args:
        return {}
    return {"value": f(params), "grad": grads, "value_fn": f} if name == "lbfgs" else {"value": f(params)}


@pytest.mark.parametrize("name,arg,kind", NON_FLOAT, ids=[f"{n}-{a}" for n, a, _ in NON_FLOAT])
@pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated:DeprecationWarning")
def test_inject_hyperparams_takes_every_non_float_argument(name, arg, kind):
    """inject_hyperparams(opt)(..., arg=value) updates as opt(..., arg=value) does, for every catalogue optimizer
    and each of its key, int, bool and callable arguments (a callable named in static_args, as Optax asks).
    inject_hyperparams(noisy_sgd)(key=0) was a TypeError at the first update (the int key became a float);
    mechanize(num_betas), sam(sync_period) and schedule_free's warmup_steps refused their int32 tensors."""
    factory = _factory(name)
    kwargs = {**_required(name), arg: _value(inspect.signature(factory).parameters[arg], kind)}
    static = (arg,) if kind == "callable" else ()
    tx, ref = fx.inject_hyperparams(factory, static_args=static)(**kwargs), factory(**kwargs)
    f = lambda p: sum(0.5 * (x ** 2).sum() + x.sum() for x in fx.tree.leaves(p))  # noqa: E731
    # float64 (the state's hyperparameters are float64 too). Not bit for bit: a 0-dim float64 tensor where the
    # factory had a Python float moves torch's rounding (noisy_sgd's noise scale is float32 with a float eta
    # and float64 with a tensor one; measured up to 7e-6 relative, in muon), hence rtol=1e-5
    params = {"w": torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3),
              "b": torch.linspace(0.5, -0.5, 3, dtype=torch.float64)}
    ref_params, state, ref_state = params, tx.init(params), ref.init(params)
    opaque = kwargs.get("opaque_mode") is True
    for _ in range(3):
        grads, ref_grads = fx.tree.map(lambda x: x + 1.0, params), fx.tree.map(lambda x: x + 1.0, ref_params)
        u, state = tx.update(grads, state, params, **_extra(name, ref, f, params, grads, opaque))
        ref_u, ref_state = ref.update(ref_grads, ref_state, ref_params,
                                      **_extra(name, ref, f, ref_params, ref_grads, opaque))
        params, ref_params = fx.apply_updates(params, u), fx.apply_updates(ref_params, ref_u)
        assert_trees_close(u, ref_u, rtol=1e-5, atol=1e-9)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-9)
