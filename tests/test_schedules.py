"""Tests for fxtrain/schedules.py: every schedule against Optax's, tensor counts, reprs and argument errors."""

import math

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain import schedules

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
    ("polynomial_schedule", dict(init_value=25.0, end_value=10.0, power=2, transition_steps=10), 12),
    ("polynomial_schedule", dict(init_value=30.0, end_value=10.0, power=2, transition_steps=10,
                                 transition_begin=4), 16),
    ("polynomial_schedule", dict(init_value=1e-3, end_value=1e-5, power=0.5, transition_steps=37,
                                 transition_begin=3), 40),
    ("polynomial_schedule", dict(init_value=0.1, end_value=0.0, power=3, transition_steps=20), 20),
    ("polynomial_schedule", dict(init_value=10.0, end_value=20.0, power=1, transition_steps=0), 5),
    ("sgdr_schedule", dict(cosine_kwargs=[
        dict(init_value=0.0, peak_value=1.6, warmup_steps=5, decay_steps=20),
        dict(init_value=0.1, peak_value=0.8, warmup_steps=5, decay_steps=30, end_value=0.01),
        dict(init_value=0.0, peak_value=0.4, warmup_steps=0, decay_steps=25, exponent=2.0)]), 75),
    ("piecewise_interpolate_schedule", dict(interpolate_type="linear", init_value=200.0,
                                            boundaries_and_scales={5: 1.5, 10: 0.25}), 12),
    ("piecewise_interpolate_schedule", dict(interpolate_type="cosine", init_value=400.0,
                                            boundaries_and_scales={5: 1.2, 3: 0.6, 7: 1.0}), 9),
    ("piecewise_interpolate_schedule", dict(interpolate_type="linear", init_value=13.0,
                                            boundaries_and_scales={0: 2.0, 5: 3.0, 6: 0.1}), 8),
    ("piecewise_interpolate_schedule", dict(interpolate_type="cosine", init_value=17.0), 3),
    ("linear_onecycle_schedule", dict(transition_steps=10, peak_value=1000, pct_start=0.3, pct_final=0.7,
                                      div_factor=10.0, final_div_factor=100.0), 12),
    ("linear_onecycle_schedule", dict(transition_steps=97, peak_value=0.1), 97),
    ("cosine_onecycle_schedule", dict(transition_steps=5, peak_value=1000.0, pct_start=0.4, div_factor=10.0,
                                      final_div_factor=100.0), 7),
    ("cosine_onecycle_schedule", dict(transition_steps=97, peak_value=0.1), 97),
]


# Optax's piecewise-interpolated schedules (stack, cumprod, dot per call) and sgdr are compiled once with
# jax.jit for the reference values: op by op they would dominate this file's time. The others are called
# op by op (compiled, Optax's polynomial_schedule gives NaN for 0 ** 0.5).
_JIT = {"sgdr_schedule", "piecewise_interpolate_schedule", "linear_onecycle_schedule", "cosine_onecycle_schedule"}


def _compiled(name, fn):
    import jax

    return jax.jit(fn) if name in _JIT else fn


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
def test_values_match_optax(name, kwargs, last):
    optax = pytest.importorskip("optax")
    ours, ref = getattr(schedules, name)(**kwargs), _compiled(name, getattr(optax, name)(**kwargs))
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


# Optax's own cases (optax/schedules/_schedule_test.py): (schedule, kwargs, steps 0.., expected values)
OPTAX_EXPECTED = [
    ("polynomial_schedule", dict(init_value=10.0, end_value=20.0, power=1, transition_steps=10),
     list(range(10, 20)) + [20] * 5),
    ("polynomial_schedule", dict(init_value=10.0, end_value=20.0, power=1, transition_steps=0), [10.0] * 15),
    ("polynomial_schedule", dict(init_value=25.0, end_value=10.0, power=2, transition_steps=10),
     [10.0 + 15.0 * (1.0 - n / 10) ** 2 for n in range(10)] + [10] * 5),
    ("polynomial_schedule", dict(init_value=30.0, end_value=10.0, power=2, transition_steps=10, transition_begin=4),
     [30.0] * 4 + [10.0 + 20.0 * (1.0 - n / 10) ** 2 for n in range(10)] + [10] * 6),
    ("piecewise_interpolate_schedule", dict(interpolate_type="linear", init_value=200.0,
                                            boundaries_and_scales={5: 1.5, 10: 0.25}),
     [200.0, 220.0, 240.0, 260.0, 280.0, 300.0, 255.0, 210.0, 165.0, 120.0, 75.0, 75.0, 75.0]),
    ("piecewise_interpolate_schedule", dict(interpolate_type="cosine", init_value=400.0,
                                            boundaries_and_scales={5: 1.2, 3: 0.6, 7: 1.0}),
     [400.0, 360.0, 280.0, 240.0, 264.0, 288.0, 288.0, 288.0, 288.0]),
    ("piecewise_interpolate_schedule", dict(interpolate_type="linear", init_value=13.0, boundaries_and_scales={}),
     [13.0] * 5),
    ("piecewise_interpolate_schedule", dict(interpolate_type="cosine", init_value=17.0), [17.0] * 3),
    ("linear_onecycle_schedule", dict(transition_steps=10, peak_value=1000, pct_start=0.3, pct_final=0.7,
                                      div_factor=10.0, final_div_factor=100.0),
     [100.0, 400.0, 700.0, 1000.0, 775.0, 550.0, 325.0, 100.0, 67.0, 34.0, 1.0, 1.0]),
    ("cosine_onecycle_schedule", dict(transition_steps=5, peak_value=1000.0, pct_start=0.4, div_factor=10.0,
                                      final_div_factor=100.0),
     [100.0, 550.0, 1000.0, 750.25, 250.75, 1.0, 1.0]),
]


@pytest.mark.parametrize("name, kwargs, expected", OPTAX_EXPECTED,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(OPTAX_EXPECTED)])
def test_optax_expected_values(name, kwargs, expected):
    s = getattr(schedules, name)(**kwargs)
    np.testing.assert_allclose(s(torch.arange(len(expected))).numpy(), expected, atol=1e-3)


def test_piecewise_interpolate_zero_length_interval():
    # a boundary at 0 applies its scale at once (Optax's test_zero_interval_size): finite, no 0/0
    s = schedules.piecewise_interpolate_schedule("linear", 13.0, {0: 2.0, 5: 3.0})
    values = s(torch.arange(6))
    assert values.isfinite().all()
    assert values[0].item() == 26.0 and values[5].item() == 78.0


@pytest.mark.parametrize("lrs", [(1.6, 0.8, 0.4), (1.6, 1.6, 1.6)], ids=["step_decay", "no_step_decay"])
def test_sgdr_peaks_after_each_warmup(lrs):
    # Optax's SGDRTest.test_limits: cycles of 2000, 3000 and 5000 steps, each with a 500-step warmup
    kwargs = [dict(decay_steps=steps, peak_value=lr, init_value=0, end_value=0.0, warmup_steps=500)
              for steps, lr in zip((2000, 3000, 5000), lrs)]
    s = schedules.sgdr_schedule(kwargs)
    np.testing.assert_allclose(s(torch.tensor([500, 2500, 5500])).numpy(), lrs, rtol=1e-6)


def test_sgdr_derivative_wrt_a_cycle_peak():
    # Optax's jax.grad can trace a cycle's peak only op by op (its warmup cosine branches on it in Python),
    # slowly; the cycle itself, warmup_cosine_decay_schedule, is checked against Optax's derivative above.
    first = dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=6)

    def second(peak):
        return dict(init_value=0.1, peak_value=peak, warmup_steps=2, decay_steps=8, end_value=0.05)

    counts = torch.arange(16)
    ours = torch.func.jacrev(lambda h: schedules.sgdr_schedule([first, second(h)])(counts))(torch.tensor(0.5))
    cycle = torch.func.jacrev(lambda h: fx.warmup_cosine_decay_schedule(**second(h))(counts[6:] - 6))(
        torch.tensor(0.5))
    assert ours[:6].eq(0).all() and cycle.abs().max() > 0
    torch.testing.assert_close(ours[6:], cycle, rtol=0, atol=0)


def test_sgdr_vmap_over_a_cycle_peak():
    # Optax's warmup cosine branches on peak_value in Python (no jax.vmap); against one schedule per peak
    def values(peak):
        return schedules.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=6),
                                        dict(init_value=0.1, peak_value=peak, warmup_steps=2, decay_steps=8,
                                             end_value=0.05)])(torch.arange(16))

    peaks = [0.0, 0.5, 2.0]
    batched = torch.func.vmap(values)(torch.tensor(peaks))
    _close(batched.numpy(), torch.stack([values(p) for p in peaks]).numpy(), 1.0)


def test_linear_schedule_is_polynomial_of_power_one():
    counts = torch.arange(30)
    args = dict(init_value=0.3, end_value=1e-3, transition_steps=17, transition_begin=4)
    assert torch.equal(fx.linear_schedule(**args)(counts),
                       schedules.polynomial_schedule(power=1, **args)(counts))


# --- what a schedule returns --------------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs, last", CASES[::3], ids=[c[0] for c in CASES[::3]])
def test_float32_scalar_on_count_device_without_host_sync(name, kwargs, last):
    s = getattr(schedules, name)(**kwargs)
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
    assert repr(schedules.linear_onecycle_schedule(100, 0.1)) == \
        "linear_onecycle_schedule(transition_steps=100, peak_value=0.1)"
    assert repr(schedules.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_steps=3)])) == \
        "sgdr_schedule(cosine_kwargs=[{'init_value': 0.0, 'peak_value': 1.0, 'warmup_steps': 1, 'decay_steps': 3}])"


def test_integral_float_steps_accepted():
    # Configs often say 1e4: an integral float is a step count, a fractional one is not.
    assert fx.cosine_decay_schedule(1.0, 1e1)(10).item() == 0.0
    with pytest.raises(TypeError, match=r"cosine_decay_schedule: decay_steps must be an integer number of steps"):
        fx.cosine_decay_schedule(1.0, 10.5)


# --- composing with torch.func: tensor arguments are differentiable and batchable ---------------

_WARMUP = dict(init_value=0.01, peak_value=0.1, warmup_steps=3, decay_steps=10, end_value=1e-3, exponent=1.5)
_EXPONENTIAL = dict(init_value=0.1, transition_steps=3, decay_rate=0.5, transition_begin=2, end_value=0.02)
_POLY = dict(init_value=0.1, end_value=1e-3, power=1.5, transition_steps=10, transition_begin=2)
_INTERP_LINEAR = dict(interpolate_type="linear", init_value=0.1, boundaries_and_scales={3: 2.0, 6: 0.1, 9: 0.5})
# (schedule, kwargs, the argument passed as a tensor): every numeric argument Optax lets jax.grad trace
TENSOR_ARGS = [
    ("constant_schedule", dict(value=0.3), "value"),
    ("linear_schedule", dict(init_value=0.1, end_value=1e-3, transition_steps=10, transition_begin=2), "init_value"),
    ("linear_schedule", dict(init_value=0.1, end_value=1e-3, transition_steps=10, transition_begin=2), "end_value"),
    ("cosine_decay_schedule", dict(init_value=0.1, decay_steps=10, alpha=0.1, exponent=2.0), "init_value"),
    ("cosine_decay_schedule", dict(init_value=0.1, decay_steps=10, alpha=0.1, exponent=2.0), "alpha"),
    ("cosine_decay_schedule", dict(init_value=0.1, decay_steps=10, alpha=0.1, exponent=2.0), "exponent"),
    ("warmup_cosine_decay_schedule", _WARMUP, "init_value"),
    ("warmup_cosine_decay_schedule", _WARMUP, "peak_value"),
    ("warmup_cosine_decay_schedule", _WARMUP, "end_value"),
    ("warmup_cosine_decay_schedule", _WARMUP, "exponent"),
    ("exponential_decay", _EXPONENTIAL, "init_value"),
    ("exponential_decay", _EXPONENTIAL, "end_value"),
    ("exponential_decay", {**_EXPONENTIAL, "staircase": True, "end_value": None}, "init_value"),
    ("piecewise_constant_schedule", dict(init_value=0.1, boundaries_and_scales={3: 0.5, 6: 0.2}), "init_value"),
    ("polynomial_schedule", _POLY, "init_value"),
    ("polynomial_schedule", _POLY, "power"),
    ("piecewise_interpolate_schedule", _INTERP_LINEAR, "init_value"),
    ("linear_onecycle_schedule", dict(transition_steps=10, peak_value=0.1, pct_final=0.7), "peak_value"),
    ("cosine_onecycle_schedule", dict(transition_steps=11, peak_value=0.1, final_div_factor=10.0), "peak_value"),
]
_COUNTS = list(range(14))


def _with(name, kwargs, arg, h, module=schedules):
    return getattr(module, name)(**{**kwargs, arg: h})


@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, arg", TENSOR_ARGS, ids=[f"{c[0]}.{c[2]}" for c in TENSOR_ARGS])
def test_derivative_wrt_tensor_argument_matches_optax(name, kwargs, arg):
    import jax
    import jax.numpy as jnp

    optax = pytest.importorskip("optax")
    h, counts = kwargs[arg], torch.tensor(_COUNTS)
    # d value(t) / d arg at every step t, by reverse and forward mode, and by plain autograd
    rev = torch.func.jacrev(lambda h: _with(name, kwargs, arg, h)(counts))(torch.tensor(h))
    fwd = torch.func.jacfwd(lambda h: _with(name, kwargs, arg, h)(counts))(torch.tensor(h))
    leaf = torch.tensor(h, requires_grad=True)
    by_autograd = torch.stack([torch.autograd.grad(v, leaf, retain_graph=True)[0]
                               for v in _with(name, kwargs, arg, leaf)(counts)])
    # Optax's schedules of one count, vmapped over the counts (piecewise_interpolate takes scalars only)
    expected = np.asarray(_compiled(name, jax.jacrev(lambda h: jax.vmap(_with(name, kwargs, arg, h, optax))(
        jnp.asarray(_COUNTS))))(jnp.float32(h)))
    assert np.abs(expected).max() > 0, "a test of nothing"
    for d in (rev, fwd, by_autograd):
        np.testing.assert_allclose(d.numpy(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, arg", TENSOR_ARGS[::2], ids=[f"{c[0]}.{c[2]}" for c in TENSOR_ARGS[::2]])
def test_vmap_over_tensor_argument_matches_optax(name, kwargs, arg):
    import jax
    import jax.numpy as jnp

    optax = pytest.importorskip("optax")
    hs = [kwargs[arg] * f for f in (0.5, 1.0, 2.0)]
    counts = torch.tensor(_COUNTS)
    ours = torch.func.vmap(lambda h: _with(name, kwargs, arg, h)(counts))(torch.tensor(hs))
    if name != "warmup_cosine_decay_schedule":  # Optax branches on peak_value in Python: no jax.vmap
        theirs = _compiled(name, jax.vmap(lambda h: jax.vmap(_with(name, kwargs, arg, h, optax))(
            jnp.asarray(_COUNTS))))(jnp.asarray(hs))
        theirs = np.asarray(theirs, np.float64).reshape(len(hs), -1)  # Optax's constant ignores the count's shape
        _close(ours.numpy(), np.broadcast_to(theirs, ours.shape), 1.0)
    one_by_one = torch.stack([_with(name, kwargs, arg, h)(counts) for h in hs])  # Python-number arguments
    _close(ours.numpy(), one_by_one.numpy(), 1.0)


@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, last", CASES[::2], ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES[::2])])
def test_vmap_over_counts_matches_optax(name, kwargs, last):
    # what a vmapped ensemble does: each member's count is a 0-dim slice of a batched count
    import jax
    import jax.numpy as jnp

    optax = pytest.importorskip("optax")
    steps = _steps(last)[:-1]  # int32 counts
    ours = torch.func.vmap(getattr(schedules, name)(**kwargs))(torch.tensor(steps, dtype=torch.int32))
    theirs = _compiled(name, jax.vmap(getattr(optax, name)(**kwargs)))(jnp.asarray(steps, jnp.int32))
    expected = np.asarray(theirs, np.float64)
    _close(ours.numpy(), expected, np.abs(expected).max() or 1.0)


def test_exponential_decay_rate_is_differentiable_and_batchable():
    # Optax reads decay_rate in Python, so neither jax.grad nor jax.vmap can trace it: against the closed form.
    counts = torch.tensor(_COUNTS)
    init, every, begin = 0.1, 3, 2

    def value(rate, staircase=False):
        return fx.exponential_decay(init, every, rate, transition_begin=begin, staircase=staircase)(counts)

    p = (counts - begin).clamp(min=0).double() / every
    for staircase in (False, True):
        q = p.floor() if staircase else p
        d = torch.func.jacrev(lambda r: value(r, staircase))(torch.tensor(0.5))
        np.testing.assert_allclose(d.numpy(), (init * q * 0.5 ** (q - 1)).numpy(), rtol=1e-5, atol=1e-8)
    # rate 0 holds init_value; end_value bounds below for rates < 1 and above for rates >= 1: selected on
    # device for a tensor rate, as the Python-number path decides on the host
    rates = [0.0, 0.5, 1.0, 1.5]
    bounded = lambda r: fx.exponential_decay(init, every, r, end_value=0.05)(counts)  # noqa: E731
    for r, row in zip(rates, torch.func.vmap(bounded)(torch.tensor(rates))):
        assert torch.equal(row, bounded(r)), r


def test_tensor_arguments_are_never_read_on_the_host():
    # repr of a schedule with tensor arguments is built on demand; building and calling one under vmap
    # (where a tensor has no single value) works
    s = torch.func.vmap(lambda h: fx.piecewise_constant_schedule(h, {2: torch.tensor(0.5)})(torch.tensor(3)))
    assert s(torch.tensor([1.0, 2.0])).tolist() == [0.5, 1.0]
    assert repr(fx.constant_schedule(torch.tensor(0.5))) == "constant_schedule(value=tensor(0.5000))"


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
    (lambda: schedules.polynomial_schedule(1.0, 0.0, 2, -1), r"polynomial_schedule: transition_steps=-1 must be >= 0"),
    (lambda: schedules.piecewise_interpolate_schedule("linar", 13.0),
     r"piecewise_interpolate_schedule: interpolate_type='linar' must be 'linear' or 'cosine'"),
    (lambda: schedules.piecewise_interpolate_schedule("", 13.0, {5: 3.0}), r"interpolate_type='' must be"),
    (lambda: schedules.piecewise_interpolate_schedule(None, 13.0, {}), r"interpolate_type=None must be"),
    (lambda: schedules.piecewise_interpolate_schedule("linear", 13.0, {5: -3}),
     r"piecewise_interpolate_schedule: boundaries_and_scales\[5\]=-3.0: scales must be >= 0"),
    (lambda: schedules.linear_onecycle_schedule(transition_steps=0, peak_value=5.0),
     r"linear_onecycle_schedule: transition_steps=0 must be >= 1"),
    (lambda: schedules.cosine_onecycle_schedule(transition_steps=0, peak_value=5.0),
     r"cosine_onecycle_schedule: transition_steps=0 must be >= 1"),
    (lambda: schedules.sgdr_schedule([]), r"sgdr_schedule: cosine_kwargs is empty"),
    (lambda: schedules.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=3, decay_steps=3)]),
     r"sgdr_schedule: cosine_kwargs\[0\]: .*decay_steps=3 must be greater than warmup_steps=3"),
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
    (lambda: schedules.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_step=3)]),
     r"sgdr_schedule: cosine_kwargs\[0\]: .*decay_step is not an argument of warmup_cosine_decay_schedule"),
    (lambda: schedules.sgdr_schedule([(0.0, 1.0, 1, 3)]), r"sgdr_schedule: cosine_kwargs\[0\] must be a dict"),
    (lambda: schedules.cosine_onecycle_schedule(10, 1.0, pct_start="0.3"), r"pct_start must be a number"),
])
def test_wrong_types_raise_type_error(build, match):
    with pytest.raises(TypeError, match=match):
        build()


# --- issue 25: float64 runs keep float64 hyperparameters ------------------------------------------
# Schedules computed in float32 and then used against float64 updates were 1e-9..2e-6 off a float64
# reference. A transform evaluates its schedules in the precision of its updates (schedules.value_at).

@pytest.mark.optax
@pytest.mark.parametrize("name, kwargs, last", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_float64_values_match_optax_x64(name, kwargs, last):
    import jax

    optax = pytest.importorskip("optax")
    with jax.enable_x64(True):
        ref = getattr(optax, name)(**kwargs)
        expected = np.array([float(ref(t)) for t in _steps(last)[:40]])
    actual = schedules.value_at(getattr(fx, name)(**kwargs), torch.tensor(_steps(last)[:40]), torch.float64)
    assert actual.dtype == torch.float64
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-13, atol=1e-300)


def _f64_params():
    return {"w": torch.tensor([[0.3, -0.7], [1.1, 0.2]], dtype=torch.float64),
            "b": torch.tensor([0.5, -0.25, 0.125], dtype=torch.float64)}


# Optax's schedules called with its int32 counts compute in float32 even under x64: the reference is
# Optax's transform with each schedule called on the count as float64 (Optax's math, float64 arithmetic).
# Where Optax's transform itself computes in float32 under x64 (madgrad's sqrt of its int32 count...), the
# reference is fxtrain's transform fed the schedule's values computed by Optax in float64 (a plain function
# returning float64 tensors: that path never rounded).
SCHEDULED_F64 = {  # (transform module, schedule module, schedule wrapper) -> transform
    "sgd": lambda m, s, w: m.sgd(w(s.warmup_cosine_decay_schedule(0.0, 0.1, 2, 9, end_value=0.003)), momentum=0.9),
    "adamw": lambda m, s, w: m.adamw(w(s.cosine_decay_schedule(0.03, 7, alpha=0.1)),
                                     weight_decay=w(s.linear_schedule(0.1, 0.01, 5))),
    "inject_adam": lambda m, s, w: m.inject_hyperparams(m.adam)(
        learning_rate=w(s.exponential_decay(0.03, 2, 0.7)), b1=w(s.linear_schedule(0.9, 0.5, 6))),
    "ademamix": lambda m, s, w: m.contrib.ademamix(0.01, alpha=w(s.linear_schedule(1.0, 5.0, 6)),
                                                   b3=w(s.linear_schedule(0.9, 0.999, 6))),
    "madgrad": lambda m, s, w: m.contrib.madgrad(w(s.linear_schedule(0.01, 0.001, 6)), momentum=0.5),
    "prodigy": lambda m, s, w: m.contrib.prodigy(w(s.cosine_decay_schedule(1.0, 8))),
}
OPTAX_F32_INSIDE = {"ademamix", "madgrad", "prodigy"}


@pytest.mark.optax
@pytest.mark.parametrize("case", SCHEDULED_F64)
def test_float64_updates_with_schedules_match_a_float64_reference(case):
    import jax

    optax = pytest.importorskip("optax")
    from fxtrain.testing import to_jnp

    def run(tx):
        params = _f64_params()
        state, out = tx.init(params), []
        for k in range(8):
            u, state = tx.update(fx.tree.map(lambda p: torch.sin(3 * p + k), params), state, params)
            params = fx.apply_updates(params, u)
            out.append(u)
        return out

    ours = run(SCHEDULED_F64[case](fx, fx, lambda f: f))
    assert all(x.dtype == torch.float64 for u in ours for x in fx.tree.leaves(u))
    with jax.enable_x64(True):
        if case in OPTAX_F32_INSIDE:
            f64 = lambda f: lambda c: torch.tensor(float(f(int(c))), dtype=torch.float64)  # noqa: E731
            reference = run(SCHEDULED_F64[case](fx, optax, f64))
        else:
            otx = SCHEDULED_F64[case](optax, optax, lambda f: lambda c: f(jax.numpy.asarray(c, jax.numpy.float64)))
            p = to_jnp(_f64_params())
            ostate, reference = otx.init(p), []
            for k in range(8):
                u, ostate = otx.update(jax.tree.map(lambda x: jax.numpy.sin(3 * x + k), p), ostate, p)
                p = optax.apply_updates(p, u)
                reference.append({key: torch.from_numpy(np.asarray(v).copy()) for key, v in u.items()})
    for k in range(8):
        for key in ("w", "b"):
            np.testing.assert_allclose(ours[k][key].numpy(), reference[k][key].numpy(), rtol=1e-12, atol=1e-15,
                                       err_msg=f"step {k} leaf {key}")
