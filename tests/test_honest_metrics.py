"""Issue 15, finding 10: the metrics of a skipped step say what happened.

On a step skipped for a non-finite gradient (``amp_cast`` overflow, ``apply_if_finite``) ``grad_norm`` is the
norm that was seen (inf or NaN, not the previous step's value nor the initial 0.0) and ``skipped`` is 1 (where
the stack reports it: ``amp_cast``; ``apply_if_finite`` keeps Optax's state and reports ``total_notfinite``);
``apply_if_finite(amp_cast(...))`` backs the loss scale off; a skipped step leaves params bit-identical
(``-0.0`` included). Every case runs the donated step, the pure step under ``no_grad`` (the donated kernels
on copies) and the pure step with autograd recording (the out-of-place kernels).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import fxtrain as fx

INF, NAN = float("inf"), float("nan")
MODES = ["donated", "pure", "pure-no-grad"]


def _loss(params, x):
    return (params["w"] * x).sum()  # gradient: x (times the loss scale under amp_cast)


def _inner():
    return fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1))


def _amp(inner):
    return fx.amp_cast(inner, "p=f32,c=f16,o=f32", loss_scale=fx.DynamicLossScale(init_scale=4.0))


STACKS = {
    "amp_cast": lambda: _amp(_inner()),
    "apply_if_finite": lambda: fx.apply_if_finite(_inner(), max_consecutive_errors=3),
    "apply_if_finite(amp_cast)": lambda: fx.apply_if_finite(_amp(_inner()), max_consecutive_errors=3),
    "amp_cast(apply_if_finite)": lambda: _amp(fx.apply_if_finite(_inner(), max_consecutive_errors=3)),
}


def _run(tx, xs, mode):
    params = {"w": torch.tensor([-0.0, 1.0, -2.0])}
    state = tx.init(params)
    step = fx.train_step(_loss, tx, donate=mode == "donated")
    history = []
    for x in xs:
        before = params["w"].clone()
        with torch.no_grad() if mode == "pure-no-grad" else contextlib.nullcontext():
            params, state, m = step(params, state, torch.full((3,), x))
        history.append((before, params["w"].clone(), m))
    return history, state


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(STACKS))
def test_skipped_step_reports_the_norm_it_saw_and_skipped(name, mode):
    history, _ = _run(STACKS[name](), [INF, 1.0, INF, NAN, 1.0], mode)
    norms = [float(m["grad_norm"]) for _, _, m in history]
    # First step skipped: not the initial 0.0. Later ones: not the previous step's sqrt(3).
    assert norms[0] == INF and norms[2] == INF and math.isnan(norms[3]), norms
    assert norms[1] == pytest.approx(math.sqrt(3)) and norms[4] == pytest.approx(math.sqrt(3)), norms
    if name == "apply_if_finite":
        assert [int(m["total_notfinite"]) for _, _, m in history] == [1, 1, 2, 3, 3]
    else:
        assert [int(m["skipped"]) for _, _, m in history] == [1, 0, 1, 1, 0]
    for (before, after, _), skipped in zip(history, [1, 0, 1, 1, 0]):
        assert _same_bits(before, after) == bool(skipped)


@pytest.mark.parametrize("mode", MODES)
def test_apply_if_finite_around_amp_cast_backs_the_scale_off(mode):
    history, state = _run(STACKS["apply_if_finite(amp_cast)"](), [1.0, INF, 1.0, NAN, NAN], mode)
    assert [float(m["loss_scale"]) for _, _, m in history] == [4.0, 2.0, 2.0, 1.0, 0.5]
    assert [int(m["skipped"]) for _, _, m in history] == [0, 1, 0, 1, 1]
    assert int(state.total_notfinite) == 3 and int(state.notfinite_count) == 2
    assert int(state.inner_state.skipped) == 1 and float(state.inner_state.loss_scale.scale) == 0.5
    for before, after, m in history:  # skipped steps change nothing
        assert _same_bits(before, after) == bool(m["skipped"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(STACKS))
def test_negative_zero_survives_a_skipped_step(name, mode):
    history, _ = _run(STACKS[name](), [INF, NAN], mode)
    for before, after, m in history:
        assert int(m.get("skipped", 1)) == 1
        assert _same_bits(after, before), (before, after)
        assert torch.signbit(after[0])  # -0.0, not +0.0


def test_accepted_non_finite_update_after_too_many_errors_is_not_skipped():
    tx = fx.apply_if_finite(_inner(), max_consecutive_errors=1)
    history, _ = _run(tx, [INF, INF], "donated")
    assert [float(m["grad_norm"]) for _, _, m in history] == [INF, INF]
    assert _same_bits(history[0][0], history[0][1]) and not history[1][1].isfinite().any()  # 2nd applied (Optax)


@pytest.mark.parametrize("mode", MODES)
def test_inner_without_grad_norm_reports_none(mode):
    # Nothing in the stack computes a norm: no grad_norm metric appears (no extra pass over the gradients).
    for tx in (fx.amp_cast(fx.sgd(0.1), "p=f32,c=f16,o=f32"), fx.apply_if_finite(fx.sgd(0.1), 2)):
        history, _ = _run(tx, [INF, 1.0], mode)
        assert "grad_norm" not in history[0][2] and _same_bits(history[0][0], history[0][1])
