"""Tests for fxtrain/schedules.py: every schedule against Optax's, tensor counts, reprs and argument errors."""

import math

import numpy as np
import pytest
import torch

import fxtrain as fx

# (name, kwargs, last step worth checking): the kwargs are passed unchanged to Optax.
CASES = [
    ("constant_schedule", dict(value=0.3), 10),
    ("constant_schedule", dict(value=7), 10),
    ("linear_schedule", dict(init_value=0.1, end_value=1e-4, transition_steps=97, transition_begin=13), 110),
    ("linear_schedule", dict(init_value=0.0, end_value=3e-3, transition_steps=10), 12),
    ("linear_schedule", dict(init_value=1.0, end_value=2.0, transition_steps=0), 5),
    ("cosine_decay_schedule", dict(init_value=0.1, decay_steps=100), 100),
    ("cosine_decay_schedule", dict(init_value=3e-4, decay_steps=77, alpha=0.1, exponent=2.0), 77),
    ("cosine_decay_schedule", dict(init_value=3e-4, decay_steps=77, alpha=0.05, exponent=0.5), 77),
    ("cosine_decay_schedule", dict(init_value=1.0, decay_steps=5000), 5000),
    ("warmup_cosine_decay_schedule",
     dict(init_value=0.0, peak_value=1e-3, warmup_steps=10, decay_steps=100, end_value=1e-5), 100),
    ("warmup_cosine_decay_schedule",
     dict(init_value=1e-5, peak_value=1e-3, warmup_steps=0, decay_steps=50, exponent=1.5), 50),
    ("warmup_cosine_decay_schedule", dict(init_value=0.1, peak_value=0.0, warmup_steps=3, decay_steps=9), 9),
    ("exponential_decay", dict(init_value=0.1, transition_steps=7, decay_rate=0.9), 100),
    ("exponential_decay", dict(init_value=0.1, transition_steps=7, decay_rate=0.5, transition_begin=5,
                               staircase=True, end_value=1e-3), 100),
    ("exponential_decay", dict(init_value=0.1, transition_steps=3, decay_rate=1.1, end_value=0.5), 60),
    ("exponential_decay", dict(init_value=0.1, transition_steps=0, decay_rate=0.5), 10),
    ("exponential_decay", dict(init_value=0.1, transition_steps=4, decay_rate=0.0), 10),
    ("piecewise_constant_schedule", dict(init_value=0.1, boundaries_and_scales={20: 0.1, 50: 0.3, 10: 2.0}), 60),
    ("piecewise_constant_schedule", dict(init_value=0.1), 5),
    ("piecewise_constant_schedule", dict(init_value=0.1, boundaries_and_scales={0: 0.5, 3: 0.0}), 6),
]


def _steps(last):
    """Every step up to past the end, plus far beyond."""
    return list(range(0, last + 12)) + [10 * last + 7, 10**6]


def _close(actual, expected, scale):
    # float32 as Optax computes it, to a few ulps. Near zero the value is a difference of O(scale)
    # float32 numbers (1 + cos(pi t/T) near t = T), where one ulp of cos moves it by ~6e-8 * scale in
    # both libraries alike: so relative 1e-6, absolute 1e-7 of the schedule's scale.
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7 * scale)


@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, last", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_optax(name, kwargs, last):
    optax = pytest.importorskip("optax")
    ours, ref = getattr(fx, name)(**kwargs), getattr(optax, name)(**kwargs)
    steps = _steps(last)
    expected = np.array([np.float32(ref(t)) for t in steps], np.float64)
    scale = np.abs(expected).max() or 1.0

    from_ints = np.array([ours(t).item() for t in steps])
    from_tensors = np.array([ours(torch.tensor(t, dtype=torch.int32)).item() for t in steps])
    batched = ours(torch.tensor(steps, dtype=torch.int64)).numpy()
    _close(from_ints, expected, scale)
    _close(from_tensors, expected, scale)
    _close(batched, expected, scale)


@pytest.mark.optax
def test_join_schedules_matches_optax():
    optax = pytest.importorskip("optax")
    parts = [dict(init_value=0.0, end_value=1.0, transition_steps=5), dict(value=0.5),
             dict(init_value=1.0, decay_steps=10, alpha=0.2)]
    makers = ["linear_schedule", "constant_schedule", "cosine_decay_schedule"]
    ours = fx.join_schedules([getattr(fx, m)(**k) for m, k in zip(makers, parts)], [5, 8])
    ref = optax.join_schedules([getattr(optax, m)(**k) for m, k in zip(makers, parts)], [5, 8])
    steps = _steps(20)
    _close(np.array([ours(t).item() for t in steps]), np.array([float(ref(t)) for t in steps]), 1.0)
    _close(ours(torch.tensor(steps)).numpy(), np.array([float(ref(t)) for t in steps]), 1.0)


def test_join_accepts_plain_functions():
    s = fx.join_schedules([lambda c: 1.0, lambda c: 2.0 + c], [3])
    assert [s(t).item() for t in range(5)] == [1.0, 1.0, 1.0, 2.0, 3.0]


# --- what a schedule returns --------------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs, last", CASES[::3], ids=[c[0] for c in CASES[::3]])
def test_float32_scalar_on_count_device_without_host_sync(name, kwargs, last):
    s = getattr(fx, name)(**kwargs)
    for count in (3, torch.tensor(3, dtype=torch.int32), torch.tensor(3)):
        v = s(count)
        assert isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.shape == ()
    # A meta tensor has no data: reading it on the host, or branching on it, would raise.
    v = s(torch.tensor(3, dtype=torch.int32, device="meta"))
    assert v.device.type == "meta" and v.dtype == torch.float32 and v.shape == ()


def test_tensor_hyperparameters():
    s = fx.cosine_decay_schedule(init_value=torch.tensor(0.1), decay_steps=10, alpha=torch.tensor(0.5))
    assert math.isclose(s(10).item(), 0.05, rel_tol=1e-6)
    w = fx.warmup_cosine_decay_schedule(0.0, torch.tensor(2.0), warmup_steps=2, decay_steps=4, end_value=1.0)
    assert [w(t).item() for t in range(6)] == [0.0, 1.0, 2.0, 1.5, 1.0, 1.0]


def test_reprs():
    assert repr(fx.cosine_decay_schedule(init_value=0.1, decay_steps=100)) == \
        "cosine_decay_schedule(init_value=0.1, decay_steps=100)"
    assert repr(fx.cosine_decay_schedule(0.1, 100, alpha=0.01)) == \
        "cosine_decay_schedule(init_value=0.1, decay_steps=100, alpha=0.01)"
    assert repr(fx.join_schedules([fx.constant_schedule(1.0), fx.linear_schedule(1.0, 0.0, 5)], [3])) == (
        "join_schedules(schedules=[constant_schedule(value=1.0), "
        "linear_schedule(init_value=1.0, end_value=0.0, transition_steps=5)], boundaries=[3])")
    assert repr(fx.piecewise_constant_schedule(1.0, {10: 0.1})) == \
        "piecewise_constant_schedule(init_value=1.0, boundaries_and_scales={10: 0.1})"


def test_integral_float_steps_accepted():
    # Configs often say 1e4: an integral float is a step count, a fractional one is not.
    assert fx.cosine_decay_schedule(1.0, 1e1)(10).item() == 0.0
    with pytest.raises(TypeError, match=r"cosine_decay_schedule: decay_steps must be an integer number of steps"):
        fx.cosine_decay_schedule(1.0, 10.5)


# --- bad input ----------------------------------------------------------------------------------

def test_unknown_argument_names_schedule_and_valid_ones():
    with pytest.raises(TypeError) as e:
        fx.cosine_decay_schedule(init_value=1.0, decay_step=10)
    msg = str(e.value)
    assert "decay_step is not an argument of cosine_decay_schedule" in msg
    assert "did you mean decay_steps?" in msg
    assert "init_value, decay_steps, alpha, exponent" in msg


def test_missing_argument_named():
    with pytest.raises(TypeError, match=r"warmup_cosine_decay_schedule: .*'decay_steps'"):
        fx.warmup_cosine_decay_schedule(init_value=0.0, peak_value=1.0, warmup_steps=10)


@pytest.mark.parametrize("build, match", [
    (lambda: fx.cosine_decay_schedule(1.0, 0), r"cosine_decay_schedule: decay_steps=0 must be >= 1"),
    (lambda: fx.cosine_decay_schedule(1.0, -5), r"cosine_decay_schedule: decay_steps=-5 must be >= 1"),
    (lambda: fx.linear_schedule(1.0, 0.0, -1), r"linear_schedule: transition_steps=-1 must be >= 0"),
    (lambda: fx.linear_schedule(1.0, 0.0, 10, transition_begin=-2), r"transition_begin=-2 must be >= 0"),
    (lambda: fx.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10), r"decay_steps=10 must be greater than warmup"),
    (lambda: fx.warmup_cosine_decay_schedule(0.0, 1.0, -1, 10), r"warmup_steps=-1 must be >= 0"),
    (lambda: fx.exponential_decay(1.0, -3, 0.5), r"exponential_decay: transition_steps=-3 must be >= 0"),
    (lambda: fx.exponential_decay(1.0, 3, -0.5), r"exponential_decay: decay_rate=-0.5 must be >= 0"),
    (lambda: fx.piecewise_constant_schedule(1.0, {5: -0.1}), r"boundaries_and_scales\[5\]=-0.1: scales must be"),
    (lambda: fx.join_schedules([fx.constant_schedule(1.0)] * 2, [1, 2]), r"2 schedules need 1 boundaries, got 2"),
    (lambda: fx.join_schedules([fx.constant_schedule(1.0)] * 3, [5, 2]), r"must be non-decreasing"),
    (lambda: fx.join_schedules([fx.constant_schedule(1.0)] * 2, [-1]), r"boundaries\[0\]=-1 must be >= 0"),
])
def test_invalid_values_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("build, match", [
    (lambda: fx.cosine_decay_schedule("0.1", 10), r"cosine_decay_schedule: init_value must be a number"),
    (lambda: fx.linear_schedule(1.0, None, 10), r"linear_schedule: end_value must be a number"),
    (lambda: fx.exponential_decay(1.0, 10, 0.5, staircase="yes"), r"staircase must be a bool"),
    (lambda: fx.piecewise_constant_schedule(1.0, [(10, 0.1)]), r"boundaries_and_scales must be a dict"),
    (lambda: fx.join_schedules([1.0, 2.0], [3]), r"schedules\[0\] is not callable"),
    (lambda: fx.constant_schedule(torch.ones(2)), r"constant_schedule: value must be a number or a 0-dim"),
    (lambda: fx.constant_schedule(1.0)("3"), r"constant_schedule\(value=1.0\): the step count must be an int"),
])
def test_wrong_types_raise_type_error(build, match):
    with pytest.raises(TypeError, match=match):
        build()
