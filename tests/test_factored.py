"""scale_by_factored_rms, adafactor, scale_by_sm3, sm3 (fxtrain/transforms/_factored.py): Optax parity,
Optax's factorized_test and test_optimization cases, dtypes, errors."""

import numpy as np
import pytest
import torch

import fxtrain as fx
from tests import _parity
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure
from tests.cases.scaling import trajectories


def _sched(count):
    return 0.05 * 0.9 ** count


def _without_scalar(seed=0, dtype=torch.float32):
    # Optax's scale_by_sm3 fails on 0-dim params (its state has no accumulator for them)
    params = fx.testing.nested_params(seed, dtype)
    del params["scalar"]
    return params


SM3 = {  # sm3's default is scale_by_sm3's default followed by scale
    "sm3": (lambda m: m.sm3(0.01)),
    "sm3_momentum": (lambda m: m.sm3(0.1, momentum=0.0)),
    "scale_by_sm3_args": (lambda m: m.chain(m.scale_by_sm3(b1=0.5, b2=0.9, eps=1e-3), m.scale(-0.01))),
}


@pytest.mark.optax
@pytest.mark.parametrize("case", SM3)
def test_sm3_matches_optax(case, monkeypatch):
    optax = pytest.importorskip("optax")
    monkeypatch.setattr(_parity, "nested_params", _without_scalar)
    assert_parity(SM3[case](fx), SM3[case](optax))


@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, target, complex_", [
    ("adafactor", {"learning_rate": 5e-3}, "parabola", False),
    ("adafactor", {"learning_rate": 5e-3}, "rosenbrock", True),
    ("adafactor", {}, "parabola", False),
    ("sm3", {"learning_rate": 1.0}, "parabola", False),
    ("sm3", {"learning_rate": 1.0}, "rosenbrock", False),
])
def test_optimization_trajectory_matches_optax(name, kwargs, target, complex_):
    # Optax's alias_test.test_optimization (float32 and complex64), 50 steps against Optax's trajectory
    pytest.importorskip("optax")
    ours, theirs = trajectories(name, kwargs, target, complex_)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")


def test_factored_rms_finite_and_shaped():
    # Optax's factorized_test.test_scale_by_factored_rms
    params = (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    updates = (torch.tensor([500.0, 5.0]), torch.tensor([300.0, 3.0]))
    tx = fx.scale_by_factored_rms()
    state = tx.init(params)
    u, state = tx.update(updates, state, params)
    for x in fx.tree.leaves((u, state)):
        assert torch.isfinite(x).all()
    assert [x.shape for x in u] == [x.shape for x in params]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("factored", [True, False], ids=["factored", "vector"])
def test_preserves_dtype_and_accumulates(factored, dtype):
    # Optax's factorized_test.test_preserve_dtype and test_gradient_accumulation (MultiSteps: fx.accumulate)
    params = torch.ones(129, 129, dtype=dtype) if factored else torch.tensor([1.0, 2.0], dtype=dtype)
    grads = 2 * params
    tx = fx.scale_by_factored_rms()
    u, state = tx.update(grads, tx.init(params), params)
    assert u.dtype == dtype
    assert (state.v_row.shape, state.v_col.shape, state.v.shape) == (
        ((129,), (129,), (1,)) if factored else ((1,), (1,), (2,)))
    acc = fx.accumulate(fx.scale_by_factored_rms(), every=4)
    u, _ = acc.update(grads, acc.init(params), params)
    assert torch.equal(u, torch.zeros_like(grads))


def test_factored_update_is_the_gradient_over_its_rms_at_the_first_step():
    tx = fx.scale_by_factored_rms(min_dim_size_to_factor=2, epsilon=0.0)
    g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    u, state = tx.update(g, tx.init(g), g)
    # decay 0 at the first step: the factored estimate of g^2 is row_mean x col_mean / mean
    sq = g * g
    v = sq.mean(1, keepdim=True) * sq.mean(0, keepdim=True) / sq.mean()
    torch.testing.assert_close(u, g / v.sqrt())
    torch.testing.assert_close(state.v_row, sq.mean(1))


def test_sm3_zero_dim_leaf_and_values():
    # a 0-dim leaf has no accumulator in Optax's state layout: its a_t is g^2 (b2 = 1), so with b1 = 0 the
    # update is g / sqrt(g^2 + eps)
    tx = fx.scale_by_sm3(b1=0.0, eps=0.0)
    params = {"s": torch.tensor(0.0), "m": torch.zeros(2, 2)}
    g = {"s": torch.tensor(-3.0), "m": torch.tensor([[3.0, 0.0], [0.0, 4.0]])}
    state = tx.init(params)
    assert state.mu["s"] == [] and [x.shape for x in state.mu["m"]] == [(2,), (2,)]
    u, state = tx.update(g, state)
    assert u["s"].item() == -1.0 and u["m"].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert state.mu["m"][0].tolist() == [9.0, 16.0] and state.mu["m"][1].tolist() == [9.0, 16.0]
    u, state = tx.update(g, state)  # a_t = g^2 + min(mu rows, mu cols): 18 on the diagonal
    torch.testing.assert_close(u["m"], torch.tensor([[3.0 / 18 ** 0.5, 0.0], [0.0, 4.0 / 32 ** 0.5]]))


@pytest.mark.parametrize("build", [lambda: fx.scale_by_factored_rms(min_dim_size_to_factor=2),
                                   lambda: fx.adafactor(0.01, min_dim_size_to_factor=2, momentum=0.9),
                                   lambda: fx.scale_by_sm3()],
                         ids=["scale_by_factored_rms", "adafactor", "scale_by_sm3"])
def test_pure_dtypes_and_none_leaves(build):
    tx = build()
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx, state_dtypes={"ema": torch.float32})  # adafactor's momentum: dtype_momentum


def test_needs_params_and_refuses_complex():
    tx = fx.scale_by_factored_rms()
    with pytest.raises(ValueError, match="scale_by_factored_rms needs the params"):
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))
    with pytest.raises(ValueError, match="scale_by_sm3 does not support complex params"):
        fx.scale_by_sm3().init({"w": torch.ones(2, dtype=torch.complex64)})


@pytest.mark.parametrize("build, message", [
    (lambda: fx.scale_by_factored_rms(decay_rate=-0.8), r"scale_by_factored_rms: decay_rate=-0.8 must be >= 0"),
    (lambda: fx.adafactor(0.1, momentum=-0.9), r"adafactor: momentum=-0.9 must be >= 0"),
    (lambda: fx.scale_by_sm3(b2=-1.0), r"scale_by_sm3: b2=-1.0 must be >= 0"),
    (lambda: fx.sm3(_sched), r"sm3: learning_rate=<function _sched .*> must be a number or a 0-dim tensor"),
])
def test_errors_name_the_argument(build, message):
    with pytest.raises(ValueError, match=message):
        build()
