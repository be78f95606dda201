"""Tests for fxtrain/transforms/_conditionality.py: apply_if_finite against Optax, skipped steps, errors."""

import pytest
import torch

import fxtrain as fx
from fxtrain import _base
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests._parity import assert_pure_and_donated_agree, growing_grads, reference_trace


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

    inner = fx.GradientTransformation(lambda p: "inner-state", lambda u, s, p=None: (u, s), wrap)
    tx = fx.apply_if_finite(inner, max_consecutive_errors=3)
    assert _base.wrap_loss(tx, lambda p, b: 1.0, tx.init({}))(None, None) == (1.0, "inner-state")


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
