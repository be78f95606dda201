"""Tests for fxtrain/amp.py: Policy, loss scales, amp_cast, presets (single process; 2 gloo ranks at the end).

References: torch.amp.GradScaler + torch.optim.SGD (loss-scale sequence, skip decisions, parameter
trajectory), torch._amp_update_scale_ (the scale arithmetic), and a plain-Python transcription of
Megatron-LM's DynamicGradScaler.update (hysteresis, floors).
"""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch
import torch.distributed as dist

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from tests import _worlds

F16 = "p=f32,c=f16,o=f32"


# --- helpers --------------------------------------------------------------------------------------------

def _init(seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(4, 8, generator=g) * 0.5, torch.randn(8, 2, generator=g) * 0.5
    return {"w1": w1, "b1": torch.zeros(8), "w2": w2}


def _batches(n, seed=1, inf_at=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
        if i in inf_at:
            x[3, 1] = float("inf")
        out.append((x, y))
    return out


def _loss(params, batch):
    x, y = batch
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def _run(tx, batches, params=None, donate=True, loss_fn=_loss):
    params = fx.tree.clone(params if params is not None else _init())
    state = tx.init(params)
    step = fx.train_step(loss_fn, tx, donate=donate)
    history = []
    for b in batches:
        params, state, m = step(params, state, b)
        history.append((fx.tree.clone(params), m))
    return params, state, history


def _equal(a, b) -> bool:
    la, lb = fx.tree.leaves(a), fx.tree.leaves(b)
    return fx.tree.structure(a) == fx.tree.structure(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


def _megatron(pattern, init, growth, backoff, interval, hysteresis, lo=None, hi=None):
    """Megatron-LM's DynamicGradScaler.update in plain Python (with ColossalAI's max_scale)."""
    scale, tracker, left, out = init, 0, hysteresis, []
    for overflow in pattern:
        if overflow:
            tracker, left = 0, left - 1
            if left <= 0:
                scale = max(scale * backoff, lo or 0.0)
        else:
            tracker += 1
            if tracker == interval:
                tracker, left = 0, hysteresis
                scale = min(scale * growth, hi or math.inf)
        out.append(scale)
    return out


# --- Policy -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("f32", ("f32", "f32", "f32")),
    ("half", ("f16", "f16", "f16")),
    ("bf16", ("f32", "bf16", "f32")),                          # the preset (issue 15, finding 11), not jmp's
    ("pure_bf16", ("bf16", "bf16", "bf16")),
    ("bfloat16", ("bf16", "bf16", "bf16")),                    # jmp: a bare dtype that is no preset name
    ("p=bf16", ("bf16", "bf16", "bf16")),
    ("c=bf16", ("f32", "bf16", "bf16")),                       # jmp: compute follows params, output compute
    ("p=f16,c=bf16", ("f16", "bf16", "bf16")),
    ("params=float32,compute=bfloat16,output=float32", ("f32", "bf16", "f32")),
    ("p=full, c=float16, o=single", ("f32", "f16", "f32")),
    ("o=f64", ("f32", "f32", "f64")),
])
def test_policy_grammar(text, expected):
    p = fx.Policy.parse(text)
    assert str(p) == "p={},c={},o={}".format(*expected)
    assert fx.Policy.parse(eval(repr(p))) == p and repr(p) == repr(str(p))  # quoted short form round-trips


def test_policy_from_dtypes_and_casts():
    p = fx.Policy(torch.float32, torch.bfloat16)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    assert fx.Policy("f32", "f16", "f32") == fx.Policy.parse("p=f32,c=f16,o=f32")
    t = {"x": torch.ones(2), "label": torch.tensor([1, 2]), "mask": torch.tensor([True]), "none": None, "k": 3}
    c = p.cast_to_compute(t)
    assert c["x"].dtype == torch.bfloat16 and c["label"].dtype == torch.int64 and c["mask"].dtype == torch.bool
    assert c["none"] is None and c["k"] == 3
    assert p.cast_to_param(c)["x"].dtype == torch.float32 and p.cast_to_output(t)["x"].dtype == torch.bfloat16


@pytest.mark.parametrize("text,named", [
    ("params=float33", "float33"),
    ("p=f32,q=f16", "'q'"),
    ("p=f32,c", "'c'"),
    ("p=f32,p=f16", "param dtype given twice"),
    ("float33", "float33"),
    ("", "''"),
    ("c=int8", "int8"),
])
def test_malformed_policy_names_the_bad_part(text, named):
    with pytest.raises(ValueError, match="amp policy") as e:
        fx.Policy.parse(text)
    assert named in str(e.value)
    with pytest.raises(ValueError):
        fx.amp_cast(fx.sgd(0.1), text)  # the same error through amp_cast


def test_policy_rejects_non_float_dtypes_and_types():
    with pytest.raises(ValueError, match="torch.int32"):
        fx.Policy(torch.int32)
    with pytest.raises(ValueError, match="fx.Policy"):
        fx.Policy.parse(16)


# --- loss scales: arithmetic -------------------------------------------------------------------------

@pytest.mark.parametrize("functional", [False, True], ids=["in-place", "out-of-place"])
def test_dynamic_scale_matches_torch_amp_update_scale_bitwise(functional):
    # Factors that are not powers of two exercise the float64-then-float32 rounding of the kernel.
    rng = random.Random(0)
    ls = fx.DynamicLossScale(init_scale=3.0e4, growth_factor=1.7, backoff_factor=0.37, growth_interval=3)
    state = ls.init(None)
    ref_scale, ref_tracker = torch.full((1,), 3.0e4), torch.zeros((1,), dtype=torch.int32)
    for _ in range(400):
        overflow = rng.random() < 0.3
        before = state
        with fx.tree.functional(functional):
            state = ls.adjust_(state, torch.tensor(overflow))
        assert (state is before) != functional  # a new state out of place; the same one, updated, in place
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.full((1,), float(overflow)), 1.7, 0.37, 3)
        assert torch.equal(state.scale.reshape(1), ref_scale) and int(state.growth_tracker) == int(ref_tracker)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_out_of_place_unscale_matches_the_gradscaler_kernel_bitwise(dtype):
    from fxtrain.amp import _unscale_, _unscaled

    g = torch.Generator().manual_seed(0)
    for scale, bad in [(3.0e4, None), (1024.0, float("inf")), (0.37, float("nan"))]:
        xs = [(torch.randn(5, 7, generator=g) * 100).to(dtype), (torch.randn(3, generator=g) * 1e-3).to(dtype)]
        if bad is not None:
            xs[1][2] = bad
        s = torch.tensor(scale)
        out, found = _unscaled(xs, s)
        copies = [x.clone() for x in xs]
        ref_found = _unscale_(copies, s)  # torch._amp_foreach_non_finite_check_and_unscale_
        assert float(found) == float(ref_found) == float(bad is not None)
        for a, b in zip(out, copies):
            assert a.dtype == dtype and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_growth_stops_at_float32_max_like_gradscaler():
    ls = fx.DynamicLossScale(init_scale=2.0 ** 127, growth_interval=1)
    state = ls.init(None)
    for _ in range(3):
        state = ls.adjust_(state, torch.tensor(False))
    assert float(state.scale) == 2.0 ** 127 and int(state.growth_tracker) == 0


@pytest.mark.parametrize("hysteresis,lo,hi", [(1, None, None), (2, 1.0, None), (3, 4.0, 2.0 ** 12),
                                               (2, None, 2.0 ** 9)])
def test_hysteresis_and_bounds_match_megatron(hysteresis, lo, hi):
    rng = random.Random(hysteresis)
    # Mixed, then mostly finite (reaches any ceiling), then mostly overflowing (reaches any floor).
    pattern = [rng.random() < rate for rate in [0.35] * 100 + [0.03] * 100 + [0.9] * 100]
    ls = fx.DynamicLossScale(init_scale=256.0, growth_interval=4, hysteresis=hysteresis, min_scale=lo, max_scale=hi)
    state, got = ls.init(None), []
    for overflow in pattern:
        state = ls.adjust_(state, torch.tensor(overflow))
        got.append(float(state.scale))
    assert got == _megatron(pattern, 256.0, 2.0, 0.5, 4, hysteresis, lo, hi)
    if lo is not None:
        assert min(got) >= lo and lo in got  # the floor was reached and held
    if hi is not None:
        assert max(got) <= hi and hi in got


def test_hysteresis_two_keeps_then_halves():
    ls = fx.DynamicLossScale(init_scale=1024.0, growth_interval=3, hysteresis=2)
    tx = fx.amp_cast(fx.sgd(0.1), "f32", loss_scale=ls)
    ok, bad = {"w": torch.ones(2)}, {"w": torch.tensor([1.0, float("inf")])}
    state, scales, skipped = tx.init(ok), [], []
    for g in [ok, bad, ok, bad, bad, ok, ok, ok, bad, bad]:
        _, state = tx.update(g, state, ok)
        scales.append(float(state.loss_scale.scale))
        skipped.append(int(state.skipped))
    # 1st overflow since the start: kept; 2nd (finite steps between do not re-arm): halved; next: halved again;
    # three finite steps grow and re-arm, so it takes two more overflows to back off.
    assert scales == [1024, 1024, 1024, 512, 256, 256, 256, 512, 512, 256]
    assert skipped == [0, 1, 0, 1, 1, 0, 0, 0, 1, 1]  # every overflow is skipped, backed off or not


@pytest.mark.parametrize("kwargs,named", [
    ({"init_scale": 0.0}, "init_scale"), ({"init_scale": float("inf")}, "init_scale"),
    ({"growth_factor": 1.0}, "growth_factor"), ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": 0.0}, "backoff_factor"), ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 2.5}, "growth_interval"), ({"hysteresis": 0}, "hysteresis"),
    ({"min_scale": -1.0}, "min_scale"), ({"max_scale": 0.0}, "max_scale"),
    ({"init_scale": 8.0, "min_scale": 16.0}, "init_scale"), ({"init_scale": 8.0, "max_scale": 4.0}, "init_scale"),
    ({"hysteresis": True}, "hysteresis"),
])
def test_dynamic_loss_scale_bad_arguments(kwargs, named):
    with pytest.raises(ValueError, match=f"DynamicLossScale: {named}="):
        fx.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("value,named", [
    ("dynamc", "'dynamc'"), (-1.0, "-1.0"), (0, "loss_scale=0"), (float("nan"), "nan"), (float("inf"), "inf"),
    (True, "True"), ([2.0], "list"), ({"init_scale": 2.0, "hysterisis": 2}, "hysterisis"),
    ({"hysteresis": 0}, "hysteresis"),
])
def test_bad_loss_scale_values_name_the_value(value, named):
    with pytest.raises(ValueError) as e:
        fx.amp_cast(fx.sgd(0.1), F16, loss_scale=value)
    assert named in str(e.value)


def test_loss_scale_forms_and_defaults():
    def scaler(**kw):
        tx = fx.amp_cast(fx.identity(), **kw)
        return tx.init({"w": torch.zeros(1)}).loss_scale

    assert isinstance(scaler(policy="p=f32,c=bf16,o=f32"), fx.StaticLossScaleState)  # bf16: no scaling
    s = scaler(policy=F16)                                                             # f16: dynamic
    assert isinstance(s, fx.DynamicLossScaleState) and float(s.scale) == 2.0 ** 16
    assert float(scaler(policy=F16, loss_scale=128).scale) == 128.0
    assert float(scaler(policy=F16, loss_scale="none").scale) == 1.0
    assert float(scaler(policy="f32", loss_scale="dynamic").scale) == 2.0 ** 16
    s = scaler(policy=F16, loss_scale={"init_scale": 2.0 ** 32, "hysteresis": 2, "min_scale": 1})
    assert float(s.scale) == 2.0 ** 32 and int(s.hysteresis_tracker) == 2


# --- amp_cast against torch.amp.GradScaler ------------------------------------------------------------

def _gradscaler_reference(batches, lr, init_scale, growth_interval):
    params = {k: v.clone().requires_grad_() for k, v in _init().items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    traj, scales = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        half = {k: v.half() for k, v in params.items()}
        loss = _loss(half, (x.half(), y.half())).float()  # the policy p=f32,c=f16,o=f32 by hand
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        traj.append({k: v.detach().clone() for k, v in params.items()})
        scales.append(scaler.get_scale())
    return traj, scales


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "pure"])
def test_matches_gradscaler_step_for_step(donate):
    # 2**20 overflows float16 at once (natural backoff), growth every 3 finite steps, infs injected twice.
    batches = _batches(24, inf_at=(9, 10, 17))
    traj, scales = _gradscaler_reference(batches, 0.05, 2.0 ** 20, 3)
    tx = fx.amp_cast(fx.sgd(0.05), F16, loss_scale=fx.DynamicLossScale(init_scale=2.0 ** 20, growth_interval=3))
    _, _, history = _run(tx, batches, donate=donate)
    got_scales = [float(m["loss_scale"]) for _, m in history]
    assert got_scales == scales
    prev = [2.0 ** 20] + scales[:-1]
    assert [int(m["skipped"]) for _, m in history] == [int(s < p) for s, p in zip(scales, prev)]
    assert sum(int(m["skipped"]) for _, m in history) >= 7 and max(scales) > min(scales[4:])  # backoffs and growth
    for i, ((params, _), ref) in enumerate(zip(history, traj)):
        assert_trees_close(params, ref, rtol=1e-6, atol=1e-7)


def test_gradscaler_refuses_fp16_params_and_so_do_we():
    with pytest.raises(ValueError, match="GradScaler refuses"):
        fx.amp_cast(fx.sgd(0.1), "half")  # the f16 default is dynamic scaling
    tx = fx.amp_cast(fx.sgd(0.1), F16)
    with pytest.raises(ValueError, match="'w2' is float16"):
        tx.init({"w1": torch.zeros(2), "w2": torch.zeros(2, dtype=torch.float16)})
    # What torch does with float16 grads (the reason we refuse):
    p = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((p.float() * 2).sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)
    # Opting in, or not scaling dynamically, is allowed. (A float16 loss times 2**16 overflows: GradScaler's
    # first step with a float16 output is skipped too, and the next one at 2**15 goes through.)
    for tx, expected in [(fx.amp_cast(fx.sgd(0.1), "half", allow_fp16=True), 0.9),
                         (fx.amp_cast(fx.sgd(0.1), "half", loss_scale="none"), 0.8),
                         (fx.amp_cast(fx.sgd(0.1), "half", loss_scale=8.0), 0.8)]:
        params = {"w": torch.ones(2, dtype=torch.float16)}
        params, _, _ = _run(tx, [torch.ones(2, dtype=torch.float16)] * 2, params=params,
                            loss_fn=lambda p, x: (p["w"] * x).sum())
        assert params["w"].dtype == torch.float16
        torch.testing.assert_close(params["w"].float(), torch.full((2,), expected), atol=1e-3, rtol=0)


# --- skipping -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("donate", [True, False], ids=["donated", "pure"])
def test_skipped_step_leaves_params_and_inner_state_bit_identical(donate):
    inner = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2, weight_decay=1e-2))
    tx = fx.amp_cast(inner, F16, loss_scale=fx.DynamicLossScale(init_scale=1024.0, growth_interval=100))
    params = _init()
    state = tx.init(params)
    step = fx.train_step(_loss, tx, donate=donate)
    for b in _batches(3):
        params, state, _ = step(params, state, b)
    p_before, s_before = fx.tree.clone(params), fx.tree.clone(state.inner_state)
    params, state, m = step(params, state, _batches(1, seed=5, inf_at=(0,))[0])
    assert int(m["skipped"]) == 1 and float(m["loss_scale"]) == 512.0
    # Bit-identical but for the norm the clip reports, which says what was skipped (issue 15, finding 10).
    assert math.isnan(float(m["grad_norm"])) and math.isnan(float(state.inner_state[0].grad_norm))  # inf * 0
    assert _equal(params, p_before) and _equal(state.inner_state[1], s_before[1])
    params, state, m = step(params, state, _batches(1, seed=6)[0])  # training goes on from there
    assert int(m["skipped"]) == 0 and not _equal(params, p_before)
    assert int(state.inner_state[1][0].count) == 4  # adam's count: 3 + 1, the skipped step not counted


def test_update_is_pure_and_zero_on_overflow():
    tx = fx.amp_cast(fx.sgd(0.5, momentum=0.9), F16, loss_scale=4.0)
    g = {"a": torch.tensor([4.0, float("nan")]), "b": None, "c": torch.ones(3)}
    state = tx.init({"a": torch.zeros(2), "b": None, "c": torch.zeros(3)})
    g0, s0 = fx.tree.clone(g), fx.tree.clone(state)
    u, s = tx.update(g, state)
    assert_trees_close(g, g0, equal_nan=True)
    assert _equal(state, s0)
    assert u["b"] is None and u["a"].tolist() == [0.0, 0.0] and u["c"].tolist() == [0.0] * 3
    assert int(s.skipped) == 1 and float(s.loss_scale.scale) == 4.0  # static: skipped, scale unchanged
    u, s = tx.update({"a": torch.full((2,), 4.0), "b": None, "c": torch.ones(3)}, s)
    assert u["a"].tolist() == [-0.5, -0.5] and int(s.skipped) == 0  # 4 / 4 * -0.5
    d_u, d_s = fx.update_(tx, fx.tree.clone(g), fx.tree.clone(state))  # the donated kernel: same numbers
    assert d_u["a"].tolist() == [0.0, 0.0] and int(d_s.skipped) == 1


def test_no_loss_scale_passes_gradients_through_unchanged():
    g = {"w": torch.tensor([1.0, float("inf")])}
    u, s = fx.amp_cast(fx.identity(), "p=f32,c=bf16,o=f32").update(g, fx.amp_cast(fx.identity()).init(g))
    assert u["w"].tolist() == [1.0, float("inf")] and int(s.skipped) == 0 and float(s.loss_scale.scale) == 1.0


# --- policies in the step ---------------------------------------------------------------------------------

def test_bf16_policy_forward_in_bf16_master_params_float32():
    seen = {}

    def loss_fn(params, batch):
        x, y = batch
        seen.update(w=params["w1"].dtype, x=x.dtype, y=y.dtype)
        return _loss(params, batch)

    tx = fx.amp_cast(fx.sgd(0.1), "p=f32,c=bf16,o=f32")
    params0 = _init()
    params, state, history = _run(tx, _batches(3), params=params0, loss_fn=loss_fn)
    assert seen == {"w": torch.bfloat16, "x": torch.bfloat16, "y": torch.bfloat16}
    assert all(v.dtype == torch.float32 for v in fx.tree.leaves(params))
    assert not _equal(params, params0)  # the float32 masters received the updates
    m = history[0][1]
    assert m["loss"].dtype == torch.float32 and float(m["loss_scale"]) == 1.0 and int(m["skipped"]) == 0
    # Close to the float32 run, not equal to it (bf16 keeps ~3 significant digits).
    ref, _, _ = _run(fx.sgd(0.1), _batches(3))
    assert_trees_close(params, ref, rtol=0.05, atol=0.02)


def test_loss_is_reported_unscaled_and_gradients_unscaled_exactly():
    # A power-of-two static scale in float32 scales and unscales exactly: the run equals the plain one.
    params, _, history = _run(fx.amp_cast(fx.sgd(0.1), "f32", loss_scale=2.0 ** 10), _batches(4))
    # The reference must run the same kernel: amp_cast(sgd) and a bare fx.sgd in a donated step both take torch's
    # fused SGD kernel (fxtrain/transforms/_fused.py; amp_cast unscales, then the kernel runs).
    ref, _, ref_history = _run(fx.sgd(0.1), _batches(4))
    assert _equal(params, ref)
    assert [float(m["loss"]) for _, m in history] == [float(m["loss"]) for _, m in ref_history]


def test_data_ranks_keeps_a_ranks_float16_backward_at_one_process_magnitude():
    # One process's batch [40000, 0, 0, 0]: d mean(w * x) / dw = 10000, scaled by 4: 40000, finite in float16.
    # A rank of two holds the share [40000, 0]: its local mean's gradient is 20000 (the step averages it with
    # the other rank's 0), scaled by 4: 80000, which overflows float16 where one process's does not.
    share = torch.tensor([40000.0, 0.0])

    def run(**kwargs):
        tx = fx.amp_cast(fx.sgd(1.0), "p=f32,c=f16,o=f32", loss_scale=fx.DynamicLossScale(init_scale=4.0), **kwargs)
        step = fx.train_step(lambda p, x: (p["w"] * x).mean(), tx)
        params = {"w": torch.zeros(())}
        return step(params, tx.init(params), share)

    params, _, metrics = run()
    assert metrics["skipped"].item() == 1 and params["w"].item() == 0  # the bug: a skip one process never makes
    params, _, metrics = run(data_ranks=2)  # the loss times 4 / 2: this rank's backward at one process's size
    assert metrics["skipped"].item() == 0 and metrics["loss_scale"].item() == 4.0
    assert params["w"].item() == -20000.0  # the local mean's gradient, unscaled exactly (powers of two)
    with pytest.raises(ValueError, match=r"amp_cast: data_ranks=0 must be an integer >= 1"):
        fx.amp_cast(fx.sgd(1.0), "fp16", data_ranks=0)
    assert "data_ranks=2" in repr(fx.amp_cast(fx.sgd(1.0), "fp16", data_ranks=2))


def test_clipping_inside_sees_unscaled_gradients():
    inner = fx.chain(fx.clip_by_global_norm(0.5), fx.sgd(0.1))
    params, _, history = _run(fx.amp_cast(inner, "f32", loss_scale=fx.DynamicLossScale(2.0 ** 12)), _batches(4))
    ref, _, ref_history = _run(inner, _batches(4))
    # Clipped at 0.5 on the unscaled norm, as without amp. The bare stack may take a fused kernel in a donated
    # step (fxtrain/transforms/_fused.py), which rounds differently: float32 rounding, not bits.
    assert_trees_close(params, ref, rtol=1e-6, atol=1e-7)
    norms = [float(m["grad_norm"]) for _, m in history]  # reported through AmpCastState.report
    assert norms == pytest.approx([float(m["grad_norm"]) for _, m in ref_history], rel=1e-6) and max(norms) < 10


def test_inner_wrap_loss_sees_compute_dtype():
    seen = []

    def spy(loss_fn, state):
        def wrapped(params, batch):
            seen.append(params["w1"].dtype)
            return loss_fn(params, batch)
        return wrapped

    inner = fx.with_traits(fx.GradientTransformation(fx.identity().init, fx.identity().update), wrap_loss=spy)
    tx = fx.amp_cast(fx.chain(inner, fx.sgd(0.1)), "p=f32,c=bf16,o=f32")
    _run(tx, _batches(1))
    assert seen == [torch.bfloat16]


# --- protocol, presets --------------------------------------------------------------------------------

def test_repr_state_and_flags():
    tx = fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1)))
    assert repr(tx) == "amp_cast(policy='p=f32,c=bf16,o=f32', chain(clip_by_global_norm(1.0), sgd(0.1)))"
    assert repr(fx.amp_cast(fx.sgd(0.1), "params=float32,compute=float16,output=float32", loss_scale="dynamic")) == \
        "amp_cast(policy='p=f32,c=f16,o=f32', loss_scale=DynamicLossScale(), sgd(0.1))"
    assert not fx.is_elementwise(tx)
    state = tx.init(_init())
    assert isinstance(state, fx.AmpCastState) and state.skipped.dtype == torch.int32
    from fxtrain._base import report
    assert set(report(state)) == {"loss_scale", "skipped", "grad_norm"}


def test_state_structure_stable_and_conformance_like():
    tx = fx.amp_cast(fx.adam(1e-2), F16, loss_scale=fx.DynamicLossScale(8.0, growth_interval=1))
    params = _init()
    state = tx.init(params)
    spec = fx.tree.structure(state)
    for g in [_init(1), fx.tree.map(lambda x: x * float("inf"), _init(2)), _init(3)]:
        with torch.no_grad():  # bit-exact: under no_grad the pure update runs the donated kernel on copies
            u, new = tx.update(g, state, params)
        du, dnew = fx.update_(tx, fx.tree.clone(g), fx.tree.clone(state), params)
        assert _equal(u, du) and _equal(new, dnew)
        assert fx.tree.structure(new) == spec
        state = new


@pytest.mark.parametrize("name", ["off", "bf16", "fp16", "naive_fp16", "pure_bf16", "pure_fp16"])
def test_presets_build_and_train(name):
    kw = fx.amp_preset(name)
    tx = fx.amp_cast(fx.sgd(0.1), **kw)
    assert repr(tx).startswith("amp_cast(policy=")
    dtype = fx.Policy.parse(kw["policy"]).param_dtype or torch.float32  # off: the params' own dtype
    params = fx.tree.cast(_init(), dtype)
    out, _, history = _run(tx, _batches(3), params=params)
    assert all(v.dtype == dtype for v in fx.tree.leaves(out))
    assert math.isfinite(float(history[-1][1]["loss"]))


# --- issue 15, finding 11: a preset's name means the same in amp_cast, Policy and the runner --------------

PRESET_NAMES = ["off", "bf16", "fp16", "naive_fp16", "pure_bf16", "pure_fp16"]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_amp_cast_takes_a_preset_by_name(name):
    by_name = fx.amp_cast(fx.sgd(0.1), name)
    assert repr(by_name) == repr(fx.amp_cast(fx.sgd(0.1), **fx.amp_preset(name)))
    assert fx.Policy.parse(name) == fx.Policy.parse(fx.amp_preset(name)["policy"])
    dtype = fx.Policy.parse(name).param_dtype
    out, _, history = _run(by_name, _batches(2), params=fx.tree.cast(_init(), dtype))
    assert math.isfinite(float(history[-1][1]["loss"]))  # (naive_fp16 starts at 2**32: it skips first)


def test_bf16_by_name_is_mixed_and_off_casts_nothing():
    expected = "amp_cast(policy='p=f32,c=bf16,o=f32', loss_scale=NoLossScale(), sgd(0.1))"
    assert repr(fx.amp_cast(fx.sgd(0.1), "bf16")) == expected
    assert str(fx.amp_cast(fx.sgd(0.1), "off")).startswith("amp_cast(policy='off'")
    assert fx.Policy.parse(eval(repr(fx.Policy.parse("off")))) == fx.Policy(None, None, None)
    # An explicit loss scale wins over the preset's; the explicit grammar stays jmp's.
    assert "loss_scale=StaticLossScale(scale=8.0)" in repr(fx.amp_cast(fx.sgd(0.1), "fp16", loss_scale=8.0))
    assert str(fx.Policy.parse("p=bf16,c=bf16,o=bf16")) == "p=bf16,c=bf16,o=bf16"


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_runner_amp_configs_are_the_presets(name):
    # conf/amp/<name>.yaml is what `amp=<name>` gives the runner: the same policy and loss scale as the preset.
    import pathlib

    import yaml

    from fxtrain import amp
    conf = yaml.safe_load((pathlib.Path(__file__).parents[1] / "conf" / "amp" / f"{name}.yaml").read_text())
    preset = fx.amp_preset(name)
    policy = fx.Policy.parse(preset["policy"])
    if conf["policy"] is None:  # amp=off: no amp_cast at all, i.e. every dtype as given
        assert name == "off" and policy == fx.Policy.parse("off") == fx.Policy(None, None, None)
        return
    assert fx.Policy.parse(conf["policy"]) == policy == fx.Policy.parse(name)
    assert amp._as_loss_scale(conf["loss_scale"], policy) == amp._as_loss_scale(preset["loss_scale"], policy)


def test_naive_preset_is_megatron():
    ls = fx.amp_preset("naive_fp16")["loss_scale"]
    assert (ls.init_scale, ls.hysteresis, ls.min_scale, ls.growth_interval) == (2.0 ** 32, 2, 1.0, 1000)
    with pytest.raises(ValueError, match="unknown preset 'o2'"):
        fx.amp_preset("o2")


@pytest.mark.skipif(not hasattr(fx, "accumulate"), reason="fx.accumulate not built yet")
def test_overflow_inside_an_accumulation_window_skips_it_and_backs_off_once():
    every, lr = 2, 0.1
    scale = fx.DynamicLossScale(init_scale=2.0 ** 8, growth_interval=100)
    tx = fx.accumulate(fx.amp_cast(fx.sgd(lr), "f32", loss_scale=scale), every=every)
    micro = _batches(6, inf_at=(2,))  # windows [0, 1], [2*, 3], [4, 5]
    params, _, history = _run(tx, micro)
    emitted = [m for i, (_, m) in enumerate(history) if i % every == every - 1]
    assert [int(m["skipped"]) for m in emitted] == [0, 1, 0]
    assert [float(m["loss_scale"]) for m in emitted] == [256.0, 128.0, 128.0]
    assert _equal(history[3][0], history[1][0])  # the window with the overflow changed nothing
    # Reference: one batch of 2b per window (the mean loss), the second window skipped.
    joined = [tuple(torch.cat(z) for z in zip(micro[i], micro[i + 1])) for i in (0, 4)]
    ref, _, _ = _run(fx.sgd(lr), joined)
    assert_trees_close(params, ref, rtol=1e-5, atol=1e-6)


# --- composing with torch.func -----------------------------------------------------------------------------

def _stack(trees):
    return fx.tree.map(lambda *xs: torch.stack(xs), *trees)


def _member(t, i):
    return fx.tree.map(lambda x: x[i], t)


def _scaled_grads(step, scale, inf_at=None):
    g = fx.tree.map(lambda x: x * (1.0 + 0.1 * step) * scale, _init(seed=10 + step))
    if inf_at is not None:
        g["w2"][inf_at] = float("inf")
    return g


def test_vmap_over_an_ensemble_equals_separate_runs():
    # 3 models, each with its own dynamic loss scale: overflows at different steps back off different scales.
    ls = fx.DynamicLossScale(init_scale=2.0 ** 8, growth_interval=2, hysteresis=1)
    tx = fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1, momentum=0.9)), F16, loss_scale=ls)
    overflow = {0: {2}, 1: {1, 2}, 2: set()}  # member -> steps with an inf in the (scaled) gradient
    members = [_init(seed) for seed in range(3)]

    def grads(i, step):
        return _scaled_grads(step + 7 * i, 2.0 ** 8, (1, i) if step in overflow[i] else None)

    runs = []
    for i, params in enumerate(members):
        state, history = tx.init(params), []
        for step in range(6):
            u, state = tx.update(grads(i, step), state, params)
            history.append((u, state))
            params = fx.apply_updates(params, u)
        runs.append(history)

    update = torch.func.vmap(tx.update)
    params, state = _stack(members), _stack([tx.init(p) for p in members])
    for step in range(6):
        u, state = update(_stack([grads(i, step) for i in range(3)]), state, params)
        params = fx.apply_updates(params, u)
        for i, history in enumerate(runs):
            assert_trees_close(_member(u, i), history[step][0], rtol=1e-6, atol=1e-6)
            assert_trees_close(_member(state, i), history[step][1], rtol=1e-6, atol=1e-6)
        assert state.skipped.tolist() == [int(step in overflow[i]) for i in range(3)]
    assert state.loss_scale.scale.tolist() == [2.0 ** 9, 2.0 ** 7, 2.0 ** 11]  # per member: grown, backed off


def _reference_objective(grads, lr, weights, init_scale, growth_interval):
    """Plain torch, decisions on the host: GradScaler's unscale and skip, SGD with momentum 0.9."""
    params, trace = _init(), {k: torch.zeros_like(v) for k, v in _init().items()}
    scale, tracker = init_scale, 0
    for g in grads:
        if not all(bool(x.isfinite().all()) for x in g.values()):
            scale, tracker = scale * 0.5, 0
            continue
        inv = torch.tensor(1.0 / scale)
        trace = {k: g[k] * inv + 0.9 * trace[k] for k in g}
        params = {k: params[k] - lr * trace[k] for k in params}
        tracker += 1
        if tracker == growth_interval:
            scale, tracker = scale * 2.0, 0
    return sum(((weights[k] * params[k]) ** 2).sum() for k in params)


def test_grad_through_updates_matches_plain_torch():
    """d(a function of the params after 6 steps, one skipped) / d(every scaled gradient, the learning rate).

    Optax has no loss scaling to compare with: the reference is the same math written in plain torch
    (host decisions, autograd), and a central finite difference for the learning rate.
    """
    init_scale, interval = 2.0 ** 6, 2
    grads = [_scaled_grads(step, 2.0 ** 6, (0, 1) if step == 3 else None) for step in range(6)]
    weights = _init(seed=99)

    def objective(grads, lr):
        ls = fx.DynamicLossScale(init_scale=init_scale, growth_interval=interval)
        tx = fx.amp_cast(fx.sgd(lr, momentum=0.9), F16, loss_scale=ls)
        p, state = _init(), tx.init(_init())
        for g in grads:
            u, state = tx.update(g, state, p)
            p = fx.apply_updates(p, u)
        return sum(((weights[k] * p[k]) ** 2).sum() for k in p)

    lr = torch.tensor(0.1)
    d_grads, d_lr = torch.func.grad(objective, argnums=(0, 1))(grads, lr)
    leaves = [x.clone().requires_grad_() for x in fx.tree.leaves(grads)]
    ref_grads_in = fx.tree.unflatten(fx.tree.structure(grads), leaves)
    ref_lr = lr.clone().requires_grad_()
    r = torch.autograd.grad(_reference_objective(ref_grads_in, ref_lr, weights, init_scale, interval),
                            [*leaves, ref_lr], allow_unused=True, materialize_grads=True)
    assert_trees_close(d_grads, fx.tree.unflatten(fx.tree.structure(grads), list(r[:-1])), rtol=1e-5, atol=1e-9)
    assert all(float(x.abs().max()) == 0 for x in d_grads[3].values())  # the skipped step's
    assert math.isclose(float(d_lr), float(r[-1]), rel_tol=1e-5)
    with torch.no_grad():
        h = 1e-3
        fd = (objective(grads, lr + h) - objective(grads, lr - h)) / (2 * h)
    assert math.isclose(float(d_lr), float(fd), rel_tol=1e-3)


# --- two gloo ranks: every rank takes the same decision ---------------------------------------------------
# One world of 2 CPU ranks runs every case below (spawning is the cost; tests/_worlds.py); each reports per case.

WORLD, TIMEOUT_S = 2, 180
CASES, case = _worlds.registry(worlds=(WORLD,))


@case()
def case_dtensor_data_parallel(world):
    """Replicate params, Shard(0) batch: Partial gradients; an inf only in rank 1's rows: both skip."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    batches = _batches(8, inf_at=(4,))  # row 3 of batch 4 is on rank 0; move the inf to rank 1's half
    batches[4][0][3, 1], batches[4][0][12, 1] = 0.0, float("inf")
    ls = fx.DynamicLossScale(init_scale=2.0 ** 20, growth_interval=2)
    tx = fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1)), F16, loss_scale=ls)
    ref, _, ref_hist = _run(tx, batches)  # single process, full batch
    params = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in _init().items()}
    state, step = tx.init(params), fx.train_step(_loss, tx)
    for i, (x, y) in enumerate(batches):
        b = (distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)]))
        params, state, m = step(params, state, b)
        assert int(m["skipped"]) == int(ref_hist[i][1]["skipped"]), (i, rank)
        assert float(m["loss_scale"]) == float(ref_hist[i][1]["loss_scale"]), (i, rank)
    assert int(ref_hist[4][1]["skipped"]) == 1 and int(ref_hist[5][1]["skipped"]) == 0
    assert_trees_close(params, ref, rtol=1e-3, atol=1e-4)  # float16 sums over half batches vs the whole
    assert all(p.placements == (Replicate(),) for p in params.values())


@case()
def case_sharded_leaf_one_rank_overflows(world):
    """Shard(0) gradients and Adam state: an inf in rank 1's piece only; the update is skipped everywhere."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    tx = fx.amp_cast(fx.adam(1e-2), F16, loss_scale=fx.DynamicLossScale(64.0))
    params = {"w": distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]),
              "b": distribute_tensor(torch.zeros(3), mesh, [Replicate()])}
    state = tx.init(params)
    g = {"w": distribute_tensor(torch.full((4, 3), 64.0), mesh, [Shard(0)]),
         "b": distribute_tensor(torch.full((3,), 64.0), mesh, [Replicate()])}
    u, state = tx.update(g, state, params)
    assert int(state.skipped) == 0 and torch.allclose(u["b"].to_local(), torch.full((3,), -1e-2))
    before = fx.tree.clone(state.inner_state)
    bad = torch.full((4, 3), 64.0)
    bad[3, 2] = float("inf")  # row 3 lives on rank 1
    g = {"w": distribute_tensor(bad, mesh, [Shard(0)]),
         "b": distribute_tensor(torch.full((3,), 64.0), mesh, [Replicate()])}
    u, state = tx.update(g, state, params)
    assert int(state.skipped) == 1 and float(state.loss_scale.scale) == 32.0, rank
    assert u["w"].to_local().abs().sum() == 0 and u["b"].to_local().abs().sum() == 0
    assert u["w"].placements == (Shard(0),) and u["b"].placements == (Replicate(),)
    assert _equal(fx.tree.map(lambda x: x.to_local() if hasattr(x, "to_local") else x, state.inner_state),
                  fx.tree.map(lambda x: x.to_local() if hasattr(x, "to_local") else x, before))


@case()
def case_plain_tensors_need_groups(world):
    """Plain gradients that differ by rank (pipeline stages): ``groups`` makes the ranks agree."""
    rank = dist.get_rank()
    inner = fx.sgd(0.1)
    g = {"w": torch.full((3,), float("inf") if rank == 1 else 2.0)}
    tx = fx.amp_cast(inner, F16, loss_scale=2.0, groups=[dist.group.WORLD])
    u, s = tx.update(g, tx.init(g))
    assert int(s.skipped) == 1 and u["w"].tolist() == [0.0] * 3, rank
    alone = fx.amp_cast(inner, F16, loss_scale=2.0)  # without groups each rank decides alone
    _, s = alone.update(g, alone.init(g))
    assert int(s.skipped) == rank


test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])


# --- issue 15, finding 11: buffers keep their own dtype -------------------------------------------------

def _batchnorm_run(policy, steps, wrap):
    """Running mean of a BatchNorm1d(momentum=0.01) fed inputs of mean -51.8, after ``steps`` steps."""
    net = torch.nn.BatchNorm1d(4, momentum=0.01)
    apply, params, buffers = fx.functional(net)

    def loss_fn(params, batch):
        buffers, x = batch
        # BatchNorm on CPU wants its weight and bias in its running statistics' dtype (the input may be bf16).
        params = fx.tree.cast(params, buffers["running_mean"].dtype)
        out, new = apply(params, buffers, x, train=True)
        return out.float().square().mean(), new

    tx = fx.sgd(0.1) if policy is None else fx.amp_cast(fx.sgd(0.1), policy)
    step = fx.train_step(loss_fn, tx, has_aux=True)
    state = tx.init(params)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(64, 4, generator=g) - 51.8
        params, state, m = step(params, state, (wrap(buffers), x))
        buffers = m["aux"]
    return buffers


def test_uncast_buffers_keep_their_dtype_through_amp_cast():
    ref = _batchnorm_run(None, 300, lambda b: b)["running_mean"]
    kept = _batchnorm_run("bf16", 300, fx.amp.Uncast)
    assert kept["running_mean"].dtype == torch.float32 and kept["num_batches_tracked"].dtype == torch.int64
    # bf16 inputs, float32 statistics: as torch.autocast keeps them (the batch mean is taken from bf16 values).
    assert torch.allclose(kept["running_mean"], ref, rtol=2e-3), (kept["running_mean"], ref)
    # What the runner did before: the statistics ride in the batch and are rounded to bf16 every step.
    rounded = _batchnorm_run("p=f32,c=bf16,o=f32", 300, lambda b: b)["running_mean"]
    assert (rounded.float() - ref).abs().min() > 5.0


def test_uncast_is_unwrapped_for_the_loss_without_amp():
    seen = []

    def loss_fn(params, batch):
        seen.append(type(batch[0]))
        return (params["w"] * batch[1]).sum()

    tx = fx.sgd(0.1)
    for donate in (True, False):
        params = {"w": torch.ones(2)}
        batch = (fx.amp.Uncast({"b": torch.ones(1)}), torch.ones(2))
        fx.train_step(loss_fn, tx, donate=donate)(params, tx.init(params), batch)
    assert seen == [dict, dict]
    assert repr(fx.amp.Uncast(torch.zeros(1, dtype=torch.float64))).startswith("Uncast(")


# --- issue 25: amp "off" casts nothing (a float64 run stays float64 end to end) ----------------------

@pytest.mark.parametrize("how", ["name", "preset", "policy"])
def test_off_keeps_float64_end_to_end(how):
    tx = {"name": lambda: fx.amp_cast(fx.sgd(0.1), "off"),
          "preset": lambda: fx.amp_cast(fx.sgd(0.1), **fx.amp_preset("off")),
          "policy": lambda: fx.amp_cast(fx.sgd(0.1), fx.Policy(None, None, None))}[how]()
    seen = []

    def loss_fn(p, x):
        seen.append((p["w"].dtype, x.dtype))
        return ((p["w"] * x) ** 2).sum()

    params = {"w": torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64) / 3}
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) / 7
    step = fx.train_step(loss_fn, tx, donate=False)
    new, _, metrics = step(params, tx.init(params), x)
    assert seen == [(torch.float64, torch.float64)]
    assert new["w"].dtype == metrics["loss"].dtype == torch.float64
    # exactly plain float64 SGD: the gradient 2 w x^2, not rounded through float32
    torch.testing.assert_close(new["w"], params["w"] - 0.1 * 2 * params["w"] * x ** 2, rtol=1e-15, atol=0)
    assert fx.Policy.parse("off").cast_to_compute(params)["w"].dtype == torch.float64


def test_off_with_a_compute_dtype_is_refused():
    with pytest.raises(ValueError, match="param_dtype=None keeps every dtype"):
        fx.Policy(None, torch.bfloat16)
