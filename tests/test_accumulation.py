"""Tests for fxtrain/transforms/_accumulation.py: accumulate (Optax's MultiSteps), split_backward and microbatch
(Optax's microbatching.microbatch).

The references: one big batch through the same transform (k micro-batches of b must give the update of
one batch of k*b), Optax's MultiSteps itself (under jax.vmap and jax.grad for the ensembles whose counters
are batched, decided on device), separate unbatched runs for the vmapped ones, and in a 2-rank gloo world a
single-process big-batch run computed in the same test. One spawn runs every data-parallel check.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from fxtrain.transforms import _accumulation as fx_acc
from tests import _worlds
from tests.cases import wrappers as wrappers_cases


def mlp_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (0.5 * torch.randn(shape, generator=g)).to(dtype)

    return {"l1": {"w": r(4, 8), "b": r(8)}, "l2": {"w": r(8, 3), "b": r(3)}, "frozen": None}


def loss_fn(params, batch):
    x, y = batch
    h = torch.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    return ((h @ params["l2"]["w"] + params["l2"]["b"] - y) ** 2).mean()


def batches(n: int, size: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randn(size, 3, generator=g)) for _ in range(n)]


def big(micro: list, k: int) -> list:
    """Consecutive groups of ``k`` micro-batches concatenated into one batch each."""
    return [tuple(torch.cat(parts) for parts in zip(*micro[i:i + k])) for i in range(0, len(micro), k)]


def run(tx, data, *, donate=True, params=None, loss=loss_fn):
    params = mlp_params() if params is None else params
    state = tx.init(params)
    step = fx.train_step(loss, tx, donate=donate)
    for batch in data:
        params, state, metrics = step(params, state, batch)
    return params, state, metrics


def counting(inner):
    """``inner`` with a list that records every call of its kernel."""
    calls = []
    k = fx._base.kernel(inner)

    def update(updates, state, params=None):
        calls.append(1)
        return k(updates, state, params)

    return fx.with_traits(fx.GradientTransformation(inner.init, update), wrap_loss=inner.wrap_loss), calls


OPTIMIZERS = {
    "sgd": lambda: fx.sgd(0.1, momentum=0.9),
    "adam": lambda: fx.adam(1e-2),
    "clip+adamw": lambda: fx.chain(fx.clip_by_global_norm(0.05), fx.adamw(1e-2, weight_decay=1e-2)),
}


# --- the seeds' check and Optax's semantics ---------------------------------------------------------------

@pytest.mark.parametrize("donate", [True, False], ids=["donated", "pure"])
def test_params_change_only_on_every_kth_call(donate):
    k = 4
    tx = fx.accumulate(fx.sgd(0.1), every=k)
    params = mlp_params()
    state = tx.init(params)
    step = fx.train_step(loss_fn, tx, donate=donate)
    for i, batch in enumerate(batches(3 * k, 5)):
        before = fx.tree.clone(params)
        versions = [p._version for p in fx.tree.leaves(params)]
        params, state, metrics = step(params, state, batch)
        if (i + 1) % k:
            assert_trees_close(params, before, rtol=0, atol=0)
            # Nothing written into the params at all: no zero update was applied.
            assert [p._version for p in fx.tree.leaves(params)] == versions
        else:
            assert all(not torch.equal(a, b) for a, b in zip(fx.tree.leaves(params), fx.tree.leaves(before)))
        assert int(metrics["emitted"]) == (i + 1) // k
        assert params["frozen"] is None


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_k_micro_batches_equal_one_big_batch(name, k):
    micro = batches(3 * k, 5)
    p_acc, s_acc, m_acc = run(fx.accumulate(OPTIMIZERS[name](), every=k), micro)
    # chain(...): the same foreach kernels as inside accumulate (train_step runs a bare sgd/adam as torch's
    # fused kernel, which rounds differently, ~1e-7: not what this test is about).
    p_big, (s_big,), m_big = run(fx.chain(OPTIMIZERS[name]()), big(micro, k))
    assert_trees_close(p_acc, p_big, rtol=1e-6, atol=1e-7)
    assert_trees_close(s_acc.inner_state, s_big, rtol=1e-6, atol=1e-7)
    if "grad_norm" in m_big:  # clipping acted on the accumulated gradient, as on the big batch
        assert math.isclose(float(m_acc["grad_norm"]), float(m_big["grad_norm"]), rel_tol=1e-6)
        assert float(m_big["grad_norm"]) > 0.05  # the clip was active


def test_inner_transform_runs_once_per_emitted_update():
    inner, calls = counting(fx.sgd(0.1, momentum=0.9))
    tx = fx.accumulate(inner, every=3)
    params = mlp_params()
    state = tx.init(params)
    for i, batch in enumerate(batches(9, 5)):
        trace_before = fx.tree.clone(state.inner_state)
        params, state, _ = fx.train_step(loss_fn, tx)(params, state, batch)
        assert len(calls) == (i + 1) // 3
        if (i + 1) % 3:  # the inner state is bit-identical on held calls
            assert_trees_close(state.inner_state, trace_before, rtol=0, atol=0)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_held_calls_cost_one_accumulation_pass():
    tx = fx.accumulate(fx.adam(1e-2), every=4)
    params = mlp_params()
    state = tx.init(params)
    seen = []
    for i in range(4):
        grads = fx.tree.map(torch.ones_like, params)
        with _Ops() as mode:
            updates, state = fx.update_(tx, grads, state, params)  # the donated kernel, as train_step runs it
        seen.append([op for op in mode.ops if op != "_local_scalar_dense"])  # the CPU counter reads
    assert seen[0] == ["add_"]  # the window's first call: the gradient buffers become the accumulator
    assert seen[1] == seen[2] == ["_foreach_add_", "add_"]  # one pass over the gradients, the counter
    assert "_foreach_add_" in seen[3] and len(seen[3]) > 10  # emitted: the sum, then adam


@pytest.mark.parametrize("mean", [True, False])
def test_mean_or_sum(mean):
    tx = fx.accumulate(fx.scale(-1.0), every=3, mean=mean)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    for g in ([1.0, 2.0], [3.0, 4.0]):
        u, state = tx.update({"w": torch.tensor(g)}, state, params)
        assert u["w"].tolist() == [0.0, 0.0]  # held: zeros, as Optax's MultiSteps
    u, state = tx.update({"w": torch.tensor([5.0, 9.0])}, state, params)
    expected = [-3.0, -5.0] if mean else [-9.0, -15.0]
    assert u["w"].tolist() == expected


def test_every_as_schedule_of_the_emitted_count():
    tx = fx.accumulate(fx.scale(1.0), every=lambda emitted: emitted + 1)  # windows of 1, 2, 3 calls
    params = {"w": torch.zeros(1)}
    state = tx.init(params)
    pattern = []
    for i in range(6):
        u, state = tx.update({"w": torch.tensor([float(i)])}, state, params)
        pattern.append(None if int(state.mini_step) else u["w"].item())  # held calls leave mini_step > 0
        assert int(state.mini_step) == 0 or u["w"].item() == 0.0  # held: a zero update (Optax)
    assert pattern == [0.0, None, 1.5, None, None, 4.0]  # the mean of each window
    tx = fx.accumulate(fx.scale(1.0), every=fx.piecewise_constant_schedule(1, {1: 2.0}))  # 1, then 2
    state = tx.init(params)
    held = []
    for _ in range(6):
        u, state = tx.update({"w": torch.ones(1)}, state, params)
        held.append(u["w"].item() == 0.0)
    assert held == [False, True, False, True, False, True]


@pytest.mark.parametrize(
    "every", [0, -2, 2.5, "4", True, None, torch.tensor(2)], ids=["0", "neg", "float", "str", "bool", "None", "tensor"]
)
def test_bad_every_is_a_value_error_naming_it(every):
    with pytest.raises(ValueError, match=r"accumulate: every"):
        fx.accumulate(fx.sgd(0.1), every=every)


def test_schedule_below_one_is_a_value_error():
    with pytest.raises(ValueError, match=r"accumulate: every\(0\)"):
        fx.accumulate(fx.sgd(0.1), every=lambda n: 0)
    with pytest.raises(ValueError, match=r"accumulate: every\(0\) returned"):
        fx.accumulate(fx.sgd(0.1), every=lambda n: "two")


def test_repr_and_state():
    tx = fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-3)), every=4)
    assert repr(tx) == "accumulate(every=4, chain(clip_by_global_norm(1.0), adamw(0.001)))"
    assert repr(fx.accumulate(fx.sgd(0.1), 2, mean=False)) == "accumulate(every=2, mean=False, sgd(0.1))"
    state = tx.init(mlp_params())
    assert isinstance(state, fx.AccumulateState)
    assert state.mini_step.device.type == "cpu" and state.emitted.dtype == torch.int32
    assert state.acc["frozen"] is None and state.acc["l1"]["w"].shape == (4, 8)
    assert all(x is None for x in fx.tree.flatten(fx.accumulate(fx.sgd(0.1), 1).init(mlp_params()).acc)[0])


@pytest.mark.parametrize("frozen", [True, False], ids=["with-None", "no-None"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_pure_donated_equal_structure_stable(dtype, frozen):
    """The conformance checks, on accumulate (held and emitting calls)."""
    tx = fx.accumulate(fx.sgd(0.1, momentum=0.9), every=2)
    params = mlp_params(dtype=dtype)
    if not frozen:
        del params["frozen"]
    state = tx.init(params)
    spec = fx.tree.structure(state)
    for i in range(4):
        grads = fx.tree.map(lambda p: torch.randn_like(p), params)
        g0, s0 = fx.tree.clone(grads), fx.tree.clone(state)
        with torch.no_grad():  # bit-exact: under no_grad the pure update runs the donated kernel on copies
            u, new_state = tx.update(grads, state, params)
        c_u, c_state = tx.update(grads, state, params)  # the composable path: out of place, to rounding
        assert_trees_close(grads, g0, rtol=0, atol=0)
        assert_trees_close(state, s0, rtol=0, atol=0)
        du, ds = fx.update_(tx, fx.tree.clone(grads), fx.tree.clone(state), params)
        if i % 2 == 0:  # held: zeros from the pure update (Optax), None from the donated kernel (no add)
            assert all(x is None for x in fx.tree.flatten(du)[0])
            assert all(not x.any() for x in fx.tree.leaves(u)) and fx.tree.structure(u) == fx.tree.structure(grads)
            du = fx.tree.map(torch.zeros_like, u)
        assert_trees_close(du, u, rtol=0, atol=0)
        assert_trees_close(ds, new_state, rtol=0, atol=0)
        tol = {"rtol": 2e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-7}
        assert_trees_close(c_u, u, **tol)
        assert fx.tree.structure(c_state) == fx.tree.structure(new_state)
        assert_trees_close((c_state.inner_state, c_state.mini_step), (new_state.inner_state, new_state.mini_step),
                           **tol)
        assert fx.tree.structure(new_state) == spec
        assert u.get("frozen") is None
        assert all(x.dtype == dtype for x in fx.tree.leaves(u))
        state, params = new_state, fx.apply_updates(params, u)


def test_accumulator_dtype():
    micro = [fx.tree.map(lambda p: torch.randn_like(p, dtype=torch.float32), mlp_params()) for _ in range(8)]
    exact = fx.tree.map(lambda *gs: torch.stack([g.double() for g in gs]).mean(0), *micro)
    errors = {}
    for acc_dtype in (None, torch.float32, "float32"):
        tx = fx.accumulate(fx.identity(), every=8, accumulator_dtype=acc_dtype)
        params = mlp_params(dtype=torch.bfloat16)
        state = tx.init(params)
        if acc_dtype is not None:
            assert state.acc["l1"]["w"].dtype == torch.float32
        for g in micro:
            u, state = fx.update_(tx, fx.tree.cast(g, torch.bfloat16), state, params)
        assert u["l1"]["w"].dtype == torch.bfloat16
        errors[acc_dtype] = max(float((a.double() - e).abs().max()) for a, e in
                                zip(fx.tree.leaves(u), fx.tree.leaves(exact)))
    # float32 sums round once, into bfloat16, at the end: within half an ulp of bf16 (2**-8 relative)
    assert errors[torch.float32] == errors["float32"] <= errors[None]
    assert errors[torch.float32] < 2 ** -8 * 3
    with pytest.raises(TypeError, match="accumulate: accumulator_dtype"):
        fx.accumulate(fx.identity(), every=2, accumulator_dtype="float99")


class _Count(NamedTuple):
    n: torch.Tensor


def test_wrap_loss_sees_the_inner_state():
    seen = []

    def wrap(fn, state):
        seen.append(int(state.n))
        return fn

    # A NamedTuple state: fx._base.report caches per treespec, and a bare-leaf state's spec ("*") is shared
    # with any other single-leaf state (test_step's Counting): the cache would hide that one's report().
    inner = fx.with_traits(fx.GradientTransformation(lambda p: _Count(torch.zeros((), dtype=torch.int32)),
                                                     lambda u, s, p=None: (u, _Count(s.n + 1))), wrap_loss=wrap)
    tx = fx.accumulate(inner, every=2)
    run(tx, batches(6, 3))
    assert seen == [0, 0, 1, 1, 2, 2]  # the inner state moves once per window
    assert fx.accumulate(fx.sgd(0.1), every=2).wrap_loss is None


@pytest.mark.skipif(not hasattr(fx, "amp_cast"), reason="fx.amp_cast not built yet")
def test_amp_cast_inside_one_scale_per_window_and_overflow_skips_the_window():
    scale = fx.DynamicLossScale(init_scale=2.0 ** 10, growth_interval=1000)
    tx = fx.accumulate(fx.amp_cast(fx.sgd(0.1), "p=f32,c=f16,o=f32", loss_scale=scale), every=3)
    params = mlp_params()
    state = tx.init(params)
    step = fx.train_step(loss_fn, tx)
    data = batches(9, 4)
    data[4] = (torch.full((4, 4), 1e5), data[4][1])  # overflows float16 in the second window's forward pass
    log = []
    for batch in data:
        before = fx.tree.clone(params)
        params, state, m = step(params, state, batch)
        log.append((float(m["loss_scale"]), int(m["skipped"]), not all(
            torch.equal(a, b) for a, b in zip(fx.tree.leaves(params), fx.tree.leaves(before)))))
    assert [x[0] for x in log] == [1024.0] * 5 + [512.0] * 4  # backed off once, at the window's end
    assert [x[1] for x in log] == [0, 0, 0, 0, 0, 1, 1, 1, 0]
    assert [x[2] for x in log] == [False, False, True, False, False, False, False, False, True]


# --- Optax ------------------------------------------------------------------------------------------

@pytest.mark.optax
@pytest.mark.parametrize("every,mean", [(3, True), ("schedule", False)])
def test_matches_optax_multisteps(every, mean):
    import jax
    import optax

    from fxtrain.testing import from_jnp, to_jnp

    k_fx = (lambda n: n + 2) if every == "schedule" else every
    k_ox = (lambda n: n + 2) if every == "schedule" else every
    params = {k: v for k, v in mlp_params().items() if v is not None}
    ref = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=k_ox, use_grad_mean=mean)
    tx = fx.accumulate(fx.adam(1e-2), every=k_fx, mean=mean)
    o_state, state = ref.init(to_jnp(params)), tx.init(params)
    update = jax.jit(ref.update)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        grads = fx.tree.map(lambda p: torch.randn(p.shape, generator=g), params)
        o_updates, o_state = update(to_jnp(grads), o_state, to_jnp(params))
        updates, state = tx.update(grads, state, params)
        assert_trees_close(updates, from_jnp(o_updates), rtol=1e-5, atol=1e-7)  # zeros on held calls, both
        params = fx.apply_updates(params, updates)
        assert int(state.mini_step) == int(o_state.mini_step)
        assert int(state.emitted) == int(o_state.gradient_step)
    adam, o_adam = state.inner_state[0], from_jnp(o_state.inner_opt_state[0])
    assert int(adam.count) == int(o_adam.count)
    assert_trees_close((adam.mu, adam.nu), (o_adam.mu, o_adam.nu), rtol=1e-5, atol=1e-7)


# --- composing with torch.func -----------------------------------------------------------------------------

def _stack(trees):
    return fx.tree.map(lambda *xs: torch.stack(xs), *trees)


def _member(t, i):
    return fx.tree.map(lambda x: x[i], t)


def test_vmap_over_an_ensemble_equals_separate_runs():
    # 3 models with their own params, gradients and inner state; the CPU counters stay unbatched (the
    # emit decision, taken on the host, is common to the ensemble).
    tx = fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adam(1e-2)), every=3)
    members = [{k: v for k, v in mlp_params(seed).items() if v is not None} for seed in range(3)]
    g = torch.Generator().manual_seed(7)
    grads = [[fx.tree.map(lambda p: torch.randn(p.shape, generator=g), members[0]) for _ in range(3)]
             for _ in range(7)]
    runs = []
    for i, params in enumerate(members):
        state, history = tx.init(params), []
        for step in grads:
            u, state = tx.update(step[i], state, params)
            history.append(u)
            params = fx.apply_updates(params, u)
        runs.append((history, params, state))

    states = [tx.init(p) for p in members]
    state = _stack(states)._replace(mini_step=states[0].mini_step, emitted=states[0].emitted)
    dims = fx.AccumulateState(mini_step=None, emitted=None, acc=0, inner_state=0)
    update = torch.func.vmap(tx.update, in_dims=(0, dims, 0), out_dims=(0, dims))
    params = _stack(members)
    for t, step in enumerate(grads):
        u, state = update(_stack(step), state, params)
        params = fx.apply_updates(params, u)
        for i, (history, _, _) in enumerate(runs):
            assert_trees_close(_member(u, i), history[t], rtol=1e-6, atol=1e-6)
        assert int(state.emitted) == (t + 1) // 3
    for i, (_, p_ref, s_ref) in enumerate(runs):
        assert_trees_close(_member(params, i), p_ref, rtol=1e-6, atol=1e-6)
        assert_trees_close(_member(state.inner_state, i), s_ref.inner_state, rtol=1e-6, atol=1e-6)


# Batched counters (each member its own window position, from vmap(tx.init)): decided on device, as Optax.

ENSEMBLE, CALLS, EVERY = 3, 10, 3


def _ensemble(seed: int = 7) -> tuple[list, list]:
    """``ENSEMBLE`` members' params and ``CALLS`` calls' gradients (one per member per call)."""
    members = [{k: v for k, v in mlp_params(seed).items() if v is not None} for seed in range(ENSEMBLE)]
    g = torch.Generator().manual_seed(seed)
    grads = [[fx.tree.map(lambda p: torch.randn(p.shape, generator=g), members[0]) for _ in range(ENSEMBLE)]
             for _ in range(CALLS)]
    return members, grads


def _separate_runs(tx, members, grads, states=None) -> list:
    """Each member on its own (unbatched counters, the host-decided path): (updates per call, state)."""
    runs = []
    for i, params in enumerate(members):
        state, history = tx.init(params) if states is None else states[i], []
        for step in grads:
            u, state = tx.update(step[i], state, params)
            history.append(u)
            params = fx.apply_updates(params, u)
        runs.append((history, state))
    return runs


@pytest.mark.parametrize("mean", [True, False])
def test_vmap_with_batched_counters_equals_separate_runs(mean):
    tx = fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adam(1e-2)), every=EVERY, mean=mean)
    members, grads = _ensemble()
    runs = _separate_runs(tx, members, grads)
    params = _stack(members)
    state = torch.func.vmap(tx.init)(params)
    assert state.mini_step.shape == (ENSEMBLE,)  # batched: the counters cannot be read on the host
    update = torch.func.vmap(tx.update)
    for t, step in enumerate(grads):
        u, state = update(_stack(step), state, params)
        params = fx.apply_updates(params, u)
        for i, (history, _) in enumerate(runs):
            assert_trees_close(_member(u, i), history[t], rtol=1e-6, atol=1e-7)  # zeros on held calls, both
        assert state.mini_step.tolist() == [(t + 1) % EVERY] * ENSEMBLE
        assert state.emitted.tolist() == [(t + 1) // EVERY] * ENSEMBLE
        assert state.mini_step.dtype == state.emitted.dtype == torch.int32
        if (t + 1) % EVERY == 0:  # the accumulator is reset after an emission (Optax)
            assert all(not x.any() for x in fx.tree.leaves(state.acc))
    for i, (_, s_ref) in enumerate(runs):
        assert_trees_close(_member(state.inner_state, i), s_ref.inner_state, rtol=1e-6, atol=1e-7)
    assert fx.tree.structure(state) == fx.tree.structure(runs[0][1])


def test_batched_counters_at_different_window_positions():
    # Member i has made i host-decided calls before the ensemble is stacked: each member holds and emits on
    # its own calls, and a state whose mini_step is 0 after an emission (acc left as is there) reads as empty.
    tx = fx.accumulate(fx.sgd(0.1, momentum=0.9), every=EVERY)
    members, grads = _ensemble()
    states = []
    for i, params in enumerate(members):
        state = tx.init(params)
        for step in grads[:i + EVERY - 1]:  # 2, 3, 4 calls: window positions 2, 0 (just emitted), 1
            _, state = tx.update(step[i], state, params)
        states.append(state)
    runs = _separate_runs(tx, members, grads, states)
    state, params = _stack(states), _stack(members)
    update = torch.func.vmap(tx.update)
    for t, step in enumerate(grads):
        u, state = update(_stack(step), state, params)
        params = fx.apply_updates(params, u)
        for i, (history, _) in enumerate(runs):
            assert_trees_close(_member(u, i), history[t], rtol=1e-6, atol=1e-7)
    for i, (_, s_ref) in enumerate(runs):
        assert int(state.mini_step[i]) == int(s_ref.mini_step) and int(state.emitted[i]) == int(s_ref.emitted)
        assert_trees_close(_member(state.inner_state, i), s_ref.inner_state, rtol=1e-6, atol=1e-7)


def test_batched_counters_keep_dtypes_every_one_and_pure_train_step():
    members, grads = _ensemble()
    # bfloat16 params and gradients, a float32 accumulator: the same leaf dtypes as the host path.
    tx = fx.accumulate(fx.adam(1e-2), every=2, accumulator_dtype=torch.float32)
    params = fx.tree.cast(_stack(members), torch.bfloat16)
    state = torch.func.vmap(tx.init)(params)
    for step in grads[:4]:
        u, state = torch.func.vmap(tx.update)(fx.tree.cast(_stack(step), torch.bfloat16), state, params)
        assert all(x.dtype == torch.bfloat16 for x in fx.tree.leaves(u))
        assert all(x.dtype == torch.float32 for x in fx.tree.leaves(state.acc))
    # every=1: nothing to select, every call emits. (Its accumulator is None leaves, which torch.func.vmap
    # cannot take or return batched: the members' states stacked, the accumulator passed with dim None.)
    tx = fx.accumulate(fx.sgd(0.1), every=1)
    runs = _separate_runs(tx, members, grads[:3])
    state, params = _stack([tx.init(p) for p in members]), _stack(members)
    dims = fx.AccumulateState(mini_step=0, emitted=0, acc=None, inner_state=0)
    update = torch.func.vmap(tx.update, in_dims=(0, dims, 0), out_dims=(0, dims))
    for t, step in enumerate(grads[:3]):
        u, state = update(_stack(step), state, params)
        for i, (history, _) in enumerate(runs):
            assert_trees_close(_member(u, i), history[t], rtol=1e-6, atol=1e-7)
    assert state.emitted.tolist() == [3] * ENSEMBLE
    # The pure train_step under vmap: an ensemble of models trained with accumulation in one call.
    tx = fx.accumulate(fx.adam(1e-2), every=EVERY)
    data = batches(2 * EVERY, 5)
    refs = [run(tx, data, donate=False, params=p)[0] for p in members]
    step = torch.func.vmap(fx.train_step(loss_fn, tx, donate=False), in_dims=(0, 0, None))
    params = _stack(members)
    state = torch.func.vmap(tx.init)(params)
    for batch in data:
        params, state, metrics = step(params, state, batch)
    assert metrics["emitted"].tolist() == [2] * ENSEMBLE
    for i, ref in enumerate(refs):
        assert_trees_close(_member(params, i), ref, rtol=1e-5, atol=1e-6)


def test_schedule_with_batched_counters_is_a_value_error_naming_it():
    tx = fx.accumulate(fx.sgd(0.1), every=lambda emitted: emitted + 2)
    members, grads = _ensemble()
    params = _stack(members)
    state = torch.func.vmap(tx.init)(params)
    with pytest.raises(ValueError, match=r"accumulate: every=<lambda> is a schedule.*batched.*integer every"):
        torch.func.vmap(tx.update)(_stack(grads[0]), state, params)
    # Unbatched counters (in_dims=None): the schedule is evaluated on the host, as without vmap.
    state = state._replace(mini_step=state.mini_step[0], emitted=state.emitted[0])
    dims = fx.AccumulateState(mini_step=None, emitted=None, acc=0, inner_state=0)
    u, state = torch.func.vmap(tx.update, in_dims=(0, dims, 0), out_dims=(0, dims))(_stack(grads[0]), state, params)
    assert int(state.mini_step) == 1 and not any(x.any() for x in fx.tree.leaves(u))
    # A stacked state outside vmap: counters that are not 0-dim are named, not broadcast against the leaves.
    tx = fx.accumulate(fx.sgd(0.1), every=2)
    with pytest.raises(ValueError, match=r"accumulate: the counters .* must be 0-dim.*\(3,\)"):
        tx.update(_stack(grads[0]), _stack([tx.init(p) for p in members]), params)


@pytest.mark.optax
@pytest.mark.parametrize("mean", [True, False])
def test_vmap_with_batched_counters_matches_optax_multisteps_under_jax_vmap(mean):
    import jax
    import optax

    from fxtrain.testing import from_jnp, to_jnp

    tx = fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adam(1e-2)), every=EVERY, mean=mean)
    ref = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), every_k_schedule=EVERY,
                           use_grad_mean=mean)
    members, grads = _ensemble()
    params = _stack(members)
    state, o_state = torch.func.vmap(tx.init)(params), jax.vmap(ref.init)(to_jnp(params))
    o_update = jax.jit(jax.vmap(ref.update))
    for step in grads:
        o_updates, o_state = o_update(to_jnp(_stack(step)), o_state, to_jnp(params))
        u, state = torch.func.vmap(tx.update)(_stack(step), state, params)
        assert_trees_close(u, from_jnp(o_updates), rtol=1e-5, atol=1e-7)
        params = fx.apply_updates(params, u)
        assert state.mini_step.tolist() == o_state.mini_step.tolist()
        assert state.emitted.tolist() == o_state.gradient_step.tolist()
    adam, o_adam = state.inner_state[1][0], from_jnp(o_state.inner_opt_state[1][0])  # chain(clip, chain(adam..))
    assert adam.count.tolist() == o_adam.count.tolist() == [CALLS // EVERY] * ENSEMBLE
    assert_trees_close((adam.mu, adam.nu), (o_adam.mu, o_adam.nu), rtol=1e-5, atol=1e-7)


@pytest.mark.optax
def test_grad_through_a_window_with_batched_counters_matches_jax_grad():
    """d(a function of the ensemble's params after 7 calls, every=3) / d(every gradient, the learning rate),
    the counters batched inside (vmap of init and update): torch.func.grad against jax.grad."""
    import jax
    import jax.numpy as jnp
    import optax

    from fxtrain.testing import from_jnp, to_jnp

    members, grads = _ensemble(seed=11)
    grads = [_stack(step) for step in grads[:7]]
    params = _stack(members)
    g = torch.Generator().manual_seed(12)
    weights = fx.tree.map(lambda p: torch.randn(p.shape, generator=g), params)

    def objective(grads, lr):
        tx = fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adam(lr)), every=EVERY)
        p = params
        state = torch.func.vmap(tx.init)(p)
        for gs in grads:
            u, state = torch.func.vmap(tx.update)(gs, state, p)
            p = fx.apply_updates(p, u)
        return sum((w * x).sum() for w, x in zip(fx.tree.leaves(weights), fx.tree.leaves(p)))

    def o_objective(grads, lr):
        otx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)), every_k_schedule=EVERY)
        p = to_jnp(params)
        state = jax.vmap(otx.init)(p)
        for gs in grads:
            u, state = jax.vmap(otx.update)(gs, state, p)
            p = optax.apply_updates(p, u)
        return sum(jnp.sum(w * x) for w, x in zip(jax.tree.leaves(to_jnp(weights)), jax.tree.leaves(p)))

    d_grads, d_lr = torch.func.grad(objective, argnums=(0, 1))(grads, torch.tensor(0.05))
    # jitted: op by op, JAX's grad through 7 MultiSteps updates took about 18 s.
    o_grads, o_lr = jax.jit(jax.grad(o_objective, argnums=(0, 1)))(to_jnp(grads), jnp.float32(0.05))
    assert_trees_close(d_grads, from_jnp(o_grads), rtol=1e-4, atol=1e-6)
    assert math.isclose(float(d_lr), float(o_lr), rel_tol=1e-4)
    # Not a detached or zero gradient: the learning rate and every member's first gradients matter; the
    # 7th call's gradients never reach the params (held, not emitted), and where() gives them exactly 0.
    assert float(d_lr) != 0
    assert all(float(x[i].abs().max()) > 1e-4 for x in fx.tree.leaves(d_grads[0]) for i in range(ENSEMBLE))
    assert all(not x.any() for x in fx.tree.leaves(d_grads[6]))


@pytest.mark.optax
def test_grad_through_updates_matches_optax():
    """d(a function of the params after 7 accumulated calls) / d(every gradient, the learning rate)."""
    import jax
    import jax.numpy as jnp
    import optax

    from fxtrain.testing import from_jnp, to_jnp

    params = {k: v for k, v in mlp_params().items() if v is not None}
    g = torch.Generator().manual_seed(11)
    grads = [fx.tree.map(lambda p: torch.randn(p.shape, generator=g), params) for _ in range(7)]
    weights = fx.tree.map(lambda p: torch.randn(p.shape, generator=g), params)

    def objective(grads, lr):
        tx = fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adam(lr)), every=3)
        p, state = params, tx.init(params)
        for gs in grads:
            u, state = tx.update(gs, state, p)
            p = fx.apply_updates(p, u)
        return sum((w * x).sum() for w, x in zip(fx.tree.leaves(weights), fx.tree.leaves(p)))

    def o_objective(grads, lr):
        otx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)), every_k_schedule=3)
        p = to_jnp(params)
        state = otx.init(p)
        for gs in grads:
            u, state = otx.update(gs, state, p)
            p = optax.apply_updates(p, u)
        return sum(jnp.sum(w * x) for w, x in zip(jax.tree.leaves(to_jnp(weights)), jax.tree.leaves(p)))

    d_grads, d_lr = torch.func.grad(objective, argnums=(0, 1))(grads, torch.tensor(0.05))
    # jitted: op by op, JAX's grad through 7 MultiSteps updates took about 18 s.
    o_grads, o_lr = jax.jit(jax.grad(o_objective, argnums=(0, 1)))(to_jnp(grads), jnp.float32(0.05))
    assert_trees_close(d_grads, from_jnp(o_grads), rtol=1e-4, atol=1e-6)
    assert math.isclose(float(d_lr), float(o_lr), rel_tol=1e-4)
    assert float(d_lr) != 0 and any(float(x.abs().max()) > 1e-3 for x in fx.tree.leaves(d_grads))
    # Plain autograd sees the same graph (a learning rate that requires grad, gradients as leaves).
    lr = torch.tensor(0.05, requires_grad=True)
    leaves = [x.clone().requires_grad_() for x in fx.tree.leaves(grads)]
    spec = fx.tree.structure(grads)
    (a_lr,) = torch.autograd.grad(objective(fx.tree.unflatten(spec, leaves), lr), [lr])
    assert math.isclose(float(a_lr), float(d_lr), rel_tol=1e-5)


# --- split_backward ----------------------------------------------------------------------------------------

def test_split_backward_gives_the_gradient_of_the_whole_batch():
    (batch,) = batches(1, 10)
    for n in (1, 3, 4, 10):  # 10 examples in 4 pieces: sizes 3, 3, 2, 2 weighted by size
        p_full, _, m_full = run(fx.sgd(0.5), [batch] * 2)
        p_micro, _, m_micro = run(fx.sgd(0.5), [batch] * 2, loss=fx.split_backward(loss_fn, n))
        assert_trees_close(p_micro, p_full, rtol=1e-6, atol=1e-7)
        assert math.isclose(float(m_micro["loss"]), float(m_full["loss"]), rel_tol=1e-6)


def test_split_backward_aux_evaluation_and_errors():
    def with_aux(params, batch):
        loss = loss_fn(params, batch)
        return loss, {"loss": loss, "n": torch.tensor(batch[0].shape[0]), "name": "mlp"}

    (batch,) = batches(1, 8)
    params = mlp_params()
    loss, aux = fx.split_backward(with_aux, 4)(params, batch)  # no gradients asked: a plain weighted mean
    assert not loss.requires_grad
    assert math.isclose(float(loss), float(loss_fn(params, batch)), rel_tol=1e-6)
    assert math.isclose(float(aux["loss"]), float(loss), rel_tol=1e-6)
    assert int(aux["n"]) == 8 and aux["name"] == "mlp"
    step = fx.train_step(fx.split_backward(with_aux, 2), fx.sgd(0.1), has_aux=True)
    _, _, m = step(params, fx.sgd(0.1).init(params), batch)
    assert int(m["aux"]["n"]) == 8 and math.isclose(float(m["aux"]["loss"]), float(m["loss"]), rel_tol=1e-6)
    with pytest.raises(ValueError, match="split_backward: n=0"):
        fx.split_backward(loss_fn, 0)
    with pytest.raises(ValueError, match="cannot be split into n=9"):
        fx.split_backward(loss_fn, 9)(params, batch)
    with pytest.raises(ValueError, match="differ in size along dim 0"):
        fx.split_backward(loss_fn, 2)(params, (batch[0], batch[1][:4]))


@pytest.mark.skipif(not hasattr(fx, "amp_cast"), reason="fx.amp_cast not built yet")
def test_split_backward_under_amp_cast():
    (batch,) = batches(1, 8)
    tx = lambda: fx.amp_cast(fx.sgd(0.5), "p=f32,c=bf16,o=f32")  # noqa: E731
    p_full, _, _ = run(tx(), [batch])
    p_micro, _, _ = run(tx(), [batch], loss=fx.split_backward(loss_fn, 4))
    assert all(p.dtype == torch.float32 for p in fx.tree.leaves(p_micro))
    assert_trees_close(p_micro, p_full, rtol=2e-2, atol=2e-3)  # bf16 forward passes on different pieces


def test_split_backward_under_accumulate():
    micro = batches(4, 6)
    p_acc, _, _ = run(fx.accumulate(fx.adam(1e-2), every=2), micro, loss=fx.split_backward(loss_fn, 3))
    p_big, _, _ = run(fx.chain(fx.adam(1e-2)), big(micro, 2))  # foreach kernels, as inside accumulate
    assert_trees_close(p_acc, p_big, rtol=1e-6, atol=1e-7)


def test_split_backward_under_torch_func_grad_and_vmap():
    # Under a torch.func transform the loss is the weighted sum of the micro-batch losses (no backward inside).
    (batch,) = batches(1, 10)
    members = _stack([{k: v for k, v in mlp_params(seed).items() if v is not None} for seed in range(3)])
    split = fx.split_backward(loss_fn, 4)
    one = _member(members, 0)
    assert_trees_close(torch.func.grad(split)(one, batch), torch.func.grad(loss_fn)(one, batch),
                       rtol=1e-6, atol=1e-7)
    ensemble = torch.func.vmap(torch.func.grad(split), in_dims=(0, None))(members, batch)
    for i in range(3):
        assert_trees_close(_member(ensemble, i), torch.func.grad(loss_fn)(_member(members, i), batch),
                           rtol=1e-6, atol=1e-7)
    # Plain autograd: a higher-order gradient through the split backward is refused, not returned as zero.
    w = fx.tree.map(lambda v: v.clone().requires_grad_(), one)
    with pytest.raises(RuntimeError, match="split_backward: higher-order gradients"):
        torch.autograd.grad(split(w, batch), fx.tree.leaves(w), create_graph=True)


# --- microbatch: Optax's function transform, against optax.microbatching.microbatch under JAX -------------

def _optax_microbatch(fun_jax, args, **kwargs):
    """``optax.microbatching.microbatch(fun_jax, **kwargs)(*args)`` on the same numbers, back as torch."""
    import jax
    import jax.numpy as jnp
    import optax

    def to_optax(x):
        names = {"SUM", "MEAN", "RUNNING_MEAN", "CONCAT"}
        return optax.microbatching.AccumulationType[x.name] if getattr(x, "name", None) in names else x

    acc = kwargs.pop("accumulator", None)
    if acc is not None:
        kwargs["accumulator"] = jax.tree.map(to_optax, acc, is_leaf=lambda x: isinstance(x, fx.AccumulationType))
    out = optax.microbatching.microbatch(fun_jax, **kwargs)(*[jnp.asarray(a.numpy()) for a in args])
    return jax.tree.map(lambda x: torch.from_numpy(__import__("numpy").asarray(x).copy()), out)


@pytest.mark.optax
@pytest.mark.parametrize("case", ["concat_sum", "mean_in_axes_1", "running_mean_real_3", "grad_mean"])
def test_microbatch_matches_optax(case):
    import jax
    import jax.numpy as jnp

    x, w = torch.randn(12, 3, dtype=torch.float32), torch.randn(3)
    xt = x.T.contiguous()  # batch on axis 1
    A = fx.AccumulationType
    if case == "concat_sum":  # Optax's docstring example on floats: rows back in order, and a total
        ours = fx.microbatch(lambda x: (x @ w.unsqueeze(1) + 1, (3 * x).sum()), 0, 4, (A.CONCAT, A.SUM))(x)
        ref = _optax_microbatch(lambda x: (x @ jnp.asarray(w.numpy())[:, None] + 1, (3 * x).sum()), (x,),
                                argnums=0, microbatch_size=4, accumulator=(A.CONCAT, A.SUM))
    elif case == "mean_in_axes_1":
        ours = fx.microbatch(lambda w, xt: {"m": torch.tanh(w @ xt).mean()}, 1, 3, A.MEAN, in_axes=1)(w, xt)
        ref = _optax_microbatch(lambda w, xt: {"m": jnp.tanh(w @ xt).mean()}, (w, xt), argnums=1,
                                microbatch_size=3, accumulator=A.MEAN, in_axes=1)
    elif case == "running_mean_real_3":  # only 3 of the 4 micro-batches run
        ours = fx.microbatch(lambda x: (x ** 2).mean(0), 0, 3, A.RUNNING_MEAN, num_real_microbatches=3)(x)
        ref = _optax_microbatch(lambda x: (x ** 2).mean(0), (x,), argnums=0, microbatch_size=3,
                                accumulator=A.RUNNING_MEAN, num_real_microbatches=3)
    else:  # the gradient of a mean loss, micro-batch by micro-batch, with the loss as aux
        def loss(w, x):
            return (torch.tanh(x @ w) ** 2).mean()

        def loss_jax(w, x):
            return (jnp.tanh(x @ w) ** 2).mean()

        ours = fx.microbatch(torch.func.grad_and_value(loss), 1, 6, A.MEAN)(w, x)
        ref = _optax_microbatch(jax.value_and_grad(loss_jax), (w, x), argnums=1, microbatch_size=6,
                                accumulator=A.MEAN)[::-1]
        assert_trees_close(ours, (torch.func.grad(loss)(w, x), loss(w, x)), rtol=1e-5, atol=1e-6)
    assert_trees_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_microbatch_accumulators_keywords_and_errors():
    A = fx.AccumulationType
    x = torch.arange(8.0)
    # argnames, a custom Accumulator (the max) next to a built-in one, microbatch_size=None: fun itself
    peak = fx.Accumulator(lambda v: torch.full_like(v, -torch.inf), lambda c, v, i: torch.maximum(c, v),
                          lambda c: c, lambda v: v.amax(0))
    f = fx.microbatch(lambda *, x: {"max": x.max(), "n": torch.tensor(x.numel())}, (), 2,
                      {"max": peak, "n": A.SUM}, argnames="x")
    assert {k: int(v) for k, v in f(x=x).items()} == {"max": 7, "n": 8}
    fun = lambda x: x  # noqa: E731
    assert fx.microbatch(fun, 0, None) is fun
    with pytest.raises(ValueError, match="batch_size=8 must be divisible by microbatch_size=3"):
        fx.microbatch(fun, 0, 3)(x)
    with pytest.raises(ValueError, match="equal-size batch axes, found \\[8, 4\\]"):
        fx.microbatch(lambda a, b: a, (0, 1), 2)(x, x[:4])
    with pytest.raises(ValueError, match="MEAN and RUNNING_MEAN accumulators require floating-point"):
        fx.microbatch(lambda a: a.sum(), 0, 2, A.MEAN)(torch.arange(8))
    with pytest.raises(ValueError, match="microbatch_size=0 must be an int >= 1"):
        fx.microbatch(fun, 0, 0)
    # composable: grad through it, vmap over an ensemble of weights
    w = torch.randn(3, 2)
    xs = torch.randn(6, 3)
    g = torch.func.grad(lambda w: fx.microbatch(lambda xs: (xs @ w).square().sum(), 0, 2)(xs))(w)
    assert_trees_close(g, torch.func.grad(lambda w: (xs @ w).square().sum())(w), rtol=1e-5, atol=1e-6)
    ws = torch.randn(4, 3, 2)
    out = torch.func.vmap(lambda w: fx.microbatch(lambda xs: xs @ w, 0, 3, A.CONCAT)(xs))(ws)
    assert_trees_close(out, torch.einsum("nd,kdo->kno", xs, ws),
                       rtol=1e-5, atol=1e-6)


# Optax's CallingConventionTest (optax/microbatching/_microbatching_test.py): argnums and argnames name the
# function's parameters, however the call passes them. (fun, argnums, argnames, call) each.
def _named_fun(a, b, c):
    return (a + b + c).sum(0)


def _kwonly_fun(a, b, *, c):
    return (a + b + c).sum(0)


def _wrapped_fun(*args, **kwargs):
    return _named_fun(*args, **kwargs)


def _mixed_fun1(*args, b, **kwargs):
    return (b + sum(args) + sum(kwargs.values())).sum(0)


def _mixed_fun2(a, *args, **kwargs):
    return (a + sum(args) + sum(kwargs.values())).sum(0)


CALLING_CONVENTIONS = [
    (_named_fun, (0, 1), ("c",), lambda f, a, b, c: f(a, b, c)),
    (_named_fun, (0, 1), ("c",), lambda f, a, b, c: f(a, b, c=c)),
    (_named_fun, (0, 1), ("c",), lambda f, a, b, c: f(a, b=b, c=c)),
    (_named_fun, (0, 1), ("c",), lambda f, a, b, c: f(a=a, b=b, c=c)),
    (_named_fun, (), ("a", "b", "c"), lambda f, a, b, c: f(a, b, c)),
    (_named_fun, (), ("a", "b", "c"), lambda f, a, b, c: f(a=a, b=b, c=c)),
    (_kwonly_fun, (0, 1), ("c",), lambda f, a, b, c: f(a, b, c=c)),
    (_kwonly_fun, (0, 1), ("c",), lambda f, a, b, c: f(a=a, b=b, c=c)),
    (_kwonly_fun, (), ("a", "b", "c"), lambda f, a, b, c: f(a, b, c=c)),
    (_wrapped_fun, (0, 1, 2), (), lambda f, a, b, c: f(a, b, c)),
    (_wrapped_fun, (0,), ("b", "c"), lambda f, a, b, c: f(a, b=b, c=c)),
    (_wrapped_fun, (), ("a", "b", "c"), lambda f, a, b, c: f(a=a, b=b, c=c)),
    (_mixed_fun1, (0,), ("b", "c"), lambda f, a, b, c: f(a, b=b, c=c)),
    (_mixed_fun1, (0, 1), ("b",), lambda f, a, b, c: f(a, c, b=b)),
    (_mixed_fun1, (), ("a", "b", "c"), lambda f, a, b, c: f(a=a, b=b, c=c)),
    (_mixed_fun2, (0, 1, 2), (), lambda f, a, b, c: f(a, b, c)),
    (_mixed_fun2, (0, 1), ("c",), lambda f, a, b, c: f(a, b, c=c)),
    (_mixed_fun2, (), ("a", "b", "c"), lambda f, a, b, c: f(a=a, b=b, c=c)),
    (_mixed_fun2, (0,), ("b", "c"), lambda f, a, b, c: f(a=a, b=b, c=c)),
]


@pytest.mark.optax
@pytest.mark.parametrize("i", range(len(CALLING_CONVENTIONS)))
def test_microbatch_calling_conventions_match_optax(i):
    """Each of Optax's 19 calling conventions (7 crashed: argnums/argnames were read off the call, not the
    signature) gives the unsplit function's value, the one Optax's own test asserts under JAX; where the
    installed Optax binds that convention (current Optax binds all), also Optax's microbatch value."""
    pytest.importorskip("optax")
    import jax.numpy as jnp
    import optax

    fun, argnums, argnames, call = CALLING_CONVENTIONS[i]
    a, b, c = (torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in range(3))
    ours = call(fx.microbatch(fun, argnums=argnums, argnames=argnames, microbatch_size=2), a, b, c)
    ja, jb, jc = (jnp.asarray(x.numpy()) for x in (a, b, c))
    expected = torch.tensor(np.asarray(jnp.sum(ja + jb + jc, axis=0)))  # Optax's test: _named_fun(a, b, c)
    assert_trees_close(ours, expected, rtol=1e-6, atol=1e-6)
    try:
        theirs = call(optax.microbatching.microbatch(fun, argnums=argnums, argnames=argnames, microbatch_size=2),
                      ja, jb, jc)
    except (KeyError, IndexError):  # an Optax older than its signature binding (0.2.8 has the bug fixed here)
        return
    assert_trees_close(ours, torch.tensor(np.asarray(theirs)), rtol=1e-6, atol=1e-6)


def test_microbatch_binds_defaults_and_names_a_missing_batch_argument():
    """A batch argument left at its default is not split (Optax's binding drops defaults and crashes there);
    a positional parameter skipped before one given by keyword keeps its position."""
    def fun(x, y=None, *, z=1.0):
        return (x * z).sum(0) if y is None else (x * y * z).sum(0)

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    assert_trees_close(fx.microbatch(fun, 0, 2, argnames="y")(x), fun(x), rtol=1e-6, atol=1e-6)
    assert_trees_close(fx.microbatch(fun, (), 2, argnames=("x", "y"))(x=x, y=y), fun(x, y), rtol=1e-6, atol=1e-6)

    def late(x, w=None, s=None):
        return (x * s).sum(0)

    assert_trees_close(fx.microbatch(late, 0, 2, argnames="s")(x, s=y), late(x, s=y), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="microbatch: the batch argument 'x' .* is not in this call"):
        fx.microbatch(lambda **kw: kw["y"].sum(0), (), 2, argnames="x")(y=y)


def test_microbatch_empty_batch_as_optax():
    """A batch of size 0 runs no micro-batch (Optax's test_zero_batch_size_microbatch*): SUM gives zeros of the
    output's shape, MEAN 0/0 = NaN, CONCAT an empty batch; fun's output shape comes from one micro-batch."""
    A = fx.AccumulationType
    empty = torch.zeros(0, 4)
    total = fx.microbatch(lambda x: x.sum(0), 0, 2, A.SUM)(empty)
    assert total.shape == (4,) and bool((total == 0).all())
    mean = fx.microbatch(lambda x: x.mean(0), 0, 2, A.MEAN)(empty)
    assert mean.shape == (4,) and bool(mean.isnan().all())
    assert fx.microbatch(lambda x: x * 2, 0, 2, A.CONCAT)(empty).shape == (0, 4)


# --- data parallel: 2 gloo ranks, one spawn (tests/_worlds.py) ----------------------------------------------

WORLD, K, B = 2, 3, 4  # ranks, micro-batches per window, examples per rank per micro-batch
TIMEOUT_S = 180
CASES, case = _worlds.registry(worlds=(WORLD,))


@case()
def case_data_parallel(world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))

    def comms(fn):
        with CommDebugMode() as mode:
            out = fn()
        counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
        return counts, out

    def all_reduces(counts):  # c10d's in-place all-reduce and the functional one (DTensor's)
        return counts.get("allreduce_", 0) + counts.get("all_reduce", 0)

    def dp_loss(params, batch):  # batch: this rank's plain rows; sharded on dim 0 here (no communication)
        x, y = (DTensor.from_local(t, mesh, [Shard(0)]) for t in batch)
        h = torch.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
        return ((h @ params["l2"]["w"] + params["l2"]["b"] - y) ** 2).mean().full_tensor()

    def local(batch):
        return tuple(t[rank * B:(rank + 1) * B] for t in batch)

    def replicated(params):
        return fx.tree.map(lambda p: DTensor.from_local(p.clone(), mesh, [Replicate()]), params)

    inner = lambda: fx.chain(fx.clip_by_global_norm(0.05), fx.sgd(0.1, momentum=0.9))  # noqa: E731
    micro = batches(3 * K, WORLD * B, seed=5)  # global micro-batches, the same on every rank

    # 1. accumulate: Partial sums kept locally, no gradient collective on held calls, one packed reduce.
    tx = fx.accumulate(inner(), every=K)
    params = replicated(mlp_params())
    state = tx.init(params)
    step = fx.train_step(dp_loss, tx)
    forward_only, _ = comms(lambda: dp_loss(params, local(micro[0])))
    for i, batch in enumerate(micro):
        counts, (params, state, metrics) = comms(lambda: step(params, state, local(batch)))
        if (i + 1) % K:
            assert counts == forward_only, (i, counts, forward_only)  # the loss value's reduction only
            acc = state.acc["l1"]["w"]
            assert acc.placements[0].is_partial(), acc.placements  # the accumulator says what it holds
        else:  # one packed all-reduce of the gradients (not one per leaf), one of clip's scalars
            assert all_reduces(counts) == all_reduces(forward_only) + 2, counts
    p_ref, _, _ = run(inner(), big(micro, K))
    assert_trees_close(params, p_ref, rtol=1e-5, atol=1e-6)
    assert all(p.placements == (Replicate(),) for p in fx.tree.leaves(params))

    # The kernel alone, on Partial gradients (rank r holds (r + 1) * base): no communication on held calls,
    # one packed all-reduce when emitting; an accumulator_dtype keeps the Partial placements too.
    for acc_dtype in (None, torch.float64):
        tx_id = fx.accumulate(fx.identity(), every=K, accumulator_dtype=acc_dtype)
        state = tx_id.init(params)
        bases = [fx.tree.map(lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)), params)
                 for i in range(K)]
        for i, base in enumerate(bases):
            grads = fx.tree.map(lambda b: DTensor.from_local((rank + 1) * b, mesh, [Partial()]), base)
            counts, (updates, state) = comms(lambda: fx.update_(tx_id, grads, state, params))
            assert all_reduces(counts) == (0 if i < K - 1 else 1) and len(counts) <= 1, (acc_dtype, i, counts)
            if i < K - 1:
                assert state.acc["l2"]["w"].placements[0].is_partial()
        expected = fx.tree.map(lambda *bs: sum(bs) * (1 + 2) / K, *bases)
        assert_trees_close(updates, expected, rtol=1e-6, atol=1e-6)
        assert updates["l1"]["w"].placements == (Replicate(),) and updates["l1"]["w"].dtype == torch.float32

    # 2. Without accumulate the step reduces Partial gradients at once, packed: one all-reduce, not one per leaf.
    step = fx.train_step(dp_loss, inner())
    params = replicated(mlp_params())
    state = inner().init(params)
    for batch in big(micro, K):
        counts, (params, state, _) = comms(lambda: step(params, state, local_rows(batch, rank)))
        assert all_reduces(counts) == all_reduces(forward_only) + 2, counts
    assert_trees_close(params, p_ref, rtol=1e-5, atol=1e-6)

    # 3. split_backward on this rank's rows: Partial gradients summed locally, then the same update.
    step = fx.train_step(fx.split_backward(dp_loss, 2), fx.accumulate(inner(), every=K))
    params = replicated(mlp_params())
    state = fx.accumulate(inner(), every=K).init(params)
    for batch in micro:
        params, state, _ = step(params, state, local(batch))
    assert_trees_close(params, p_ref, rtol=1e-5, atol=1e-6)


def local_rows(batch, rank):
    """Rank ``rank``'s rows of a window batch laid out as K global micro-batches of WORLD*B rows each."""
    return tuple(torch.cat([t[j * WORLD * B + rank * B: j * WORLD * B + (rank + 1) * B] for j in range(K)])
                 for t in batch)


test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])


# --- Optax's MultiSteps cases (optax/transforms/_accumulation_test.py), inputs and expected numbers ------------

def _reads_value_tx():
    return wrappers_cases.reads_value()


def test_optax_multi_steps_computes_mean():
    # Optax: MultiSteps(scale(1.0), 4) on gradients 1, 2, 3, 4 emits 2.5; the held calls return zeros.
    tx = fx.accumulate(fx.scale(1.0), every=4)
    params = {"a": torch.zeros(())}
    state = tx.init(params)
    for i in (1.0, 2.0, 3.0):
        u, state = tx.update({"a": torch.tensor(i)}, state, params)
        assert isinstance(u["a"], torch.Tensor) and u["a"].item() == 0.0  # zeros, never None (parity bug 2)
        assert not (int(state.mini_step) == 0 and int(state.emitted) > 0)  # MultiSteps.has_updated
    u, state = tx.update({"a": torch.tensor(4.0)}, state, params)
    assert u["a"].item() == 2.5 and int(state.mini_step) == 0 and int(state.emitted) == 1


def test_optax_multi_steps_every_k_schedule():
    # Optax: every_k_schedule = 1 for the first two updates, 3 after; has_updated after each emission.
    tx = fx.accumulate(fx.sgd(1e-4), every=lambda step: torch.where(torch.tensor(step) < 2, 1, 3))
    params, grad = {"a": torch.zeros(())}, {"a": torch.zeros(())}
    state = tx.init(params)

    def has_updated(s):
        return int(s.mini_step) == 0 and int(s.emitted) > 0

    for _ in range(2):
        _, state = tx.update(grad, state, params)
        assert has_updated(state)
    for _ in range(5):
        for _ in range(2):
            _, state = tx.update(grad, state, params)
            assert not has_updated(state)
        _, state = tx.update(grad, state, params)
        assert has_updated(state)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_optax_multi_steps_mixed_precision_zeros_of_the_updates_dtype(grad_dtype, param_dtype):
    # Optax: MultiSteps(adam(0.1), 4) returns updates of the inner optimizer's dtype on every call, held
    # ones included (fxtrain's updates keep the gradients' dtype); parity bug 2: zeros, not None.
    inner = fx.adam(0.1)
    tx = fx.accumulate(inner, every=4)
    params = fx.tree.map(lambda p: p.to(param_dtype), mlp_params())
    state, inner_state = tx.init(params), inner.init(params)
    for _ in range(5):
        g = fx.tree.map(lambda p: torch.ones_like(p, dtype=grad_dtype), params)
        u, state = tx.update(g, state, params)
        ref, inner_state = inner.update(g, inner_state, params)
        for a, b in zip(fx.tree.flatten(u)[0], fx.tree.flatten(ref)[0]):
            assert (a is None) == (b is None) and (a is None or a.dtype == b.dtype == grad_dtype)
        assert all(x.dtype == param_dtype for x in fx.tree.leaves(fx.apply_updates(params, u)))


def test_pure_update_returns_zeros_where_the_donated_kernel_returns_none():
    # The donated kernel skips the add between emissions (train_step writes nothing into the params); the pure
    # update, as Optax's, returns zeros there (parity bug 2).
    tx = fx.accumulate(fx.sgd(0.1), every=2)
    params = mlp_params()
    g = fx.tree.map(torch.ones_like, params)
    u, _ = tx.update(g, tx.init(params), params)
    with torch.no_grad():
        u_ng, _ = tx.update(g, tx.init(params), params)
    d, _ = fx.update_(tx, fx.tree.clone(g), tx.init(params), params)
    for x in (u, u_ng):
        assert all(isinstance(t, torch.Tensor) and not t.any() for t in fx.tree.leaves(x))
        assert x["frozen"] is None
    assert all(t is None for t in fx.tree.flatten(d)[0])


def test_optax_skip_not_finite_and_skip_large_updates():
    step = torch.zeros((), dtype=torch.int32)
    for bad in (float("inf"), -float("inf"), float("nan")):
        skip, info = fx_acc.skip_not_finite([torch.tensor(bad), torch.zeros(())], step, None)
        assert bool(skip) and bool(info["should_skip"]) and int(info["num_not_finite"]) == 1
    skip, info = fx_acc.skip_not_finite([torch.tensor(11.0), torch.zeros(())], step, None)
    assert not bool(skip) and int(info["num_not_finite"]) == 0 and info["num_not_finite"].dtype == torch.int32

    def large(x):
        return fx_acc.skip_large_updates([torch.tensor(x), torch.zeros(())], step, None, 100.0)

    skip, info = large(float("inf"))
    assert bool(skip) and float(info["norm_squared"]) == float("inf")
    skip, info = large(float("nan"))
    assert bool(skip) and math.isnan(float(info["norm_squared"]))
    skip, info = large(11.0)
    assert bool(skip) and float(info["norm_squared"]) == 121.0
    skip, info = large(0.0)
    assert not bool(skip) and float(info["norm_squared"]) == 0.0


@pytest.mark.parametrize("path", ["pure", "donated"])
def test_optax_multi_steps_skip_not_finite(path):
    # Optax: MultiSteps(sgd(1.0), 2, should_skip_update_fn=skip_not_finite): inf and NaN calls change nothing.
    tx = fx.accumulate(fx.sgd(1.0), every=2, should_skip_update_fn=fx_acc.skip_not_finite)
    params = {"a": torch.zeros(())}
    state = tx.init(params)
    assert state.skip_state["num_not_finite"].item() == 0

    def step(x):
        nonlocal params, state
        g = {"a": torch.tensor(x)}
        u, state = fx.update_(tx, g, state, params) if path == "donated" else tx.update(g, state, params)
        params = fx.apply_updates(params, u)

    step(1.0)
    assert int(state.mini_step) == 1
    step(1.0)
    assert int(state.mini_step) == 0 and params["a"].item() == -1.0
    for bad in (float("inf"), float("nan")):
        step(bad)
        assert int(state.mini_step) == 0 and params["a"].item() == -1.0
        assert bool(state.skip_state["should_skip"]) and int(state.skip_state["num_not_finite"]) == 1
    step(1.0)
    assert int(state.mini_step) == 1
    step(1.0)
    assert int(state.mini_step) == 0 and params["a"].item() == -2.0 and int(state.emitted) == 2


def test_should_skip_update_fn_errors():
    with pytest.raises(ValueError, match="accumulate: should_skip_update_fn must return a 0-dim bool tensor"):
        tx = fx.accumulate(fx.sgd(1.0), every=2, should_skip_update_fn=lambda u, n, p: (torch.zeros(2), ()))
        tx.init({"a": torch.zeros(())})
    with pytest.raises(ValueError, match=r"accumulate: every=<lambda> is a schedule.* pass an integer every"):
        fx.accumulate(fx.sgd(1.0), every=lambda n: 2, should_skip_update_fn=fx_acc.skip_not_finite)


@pytest.mark.optax
def test_should_skip_update_fn_matches_optax_multisteps_over_20_steps():
    import functools

    import jax
    import optax

    from fxtrain.testing import from_jnp, nested_params, to_jnp
    from tests._parity import STEPS, grads as parity_grads, noise, run_fx

    params = nested_params()
    norms = [float(fx.tree.norm(parity_grads(params, k))) ** 2 for k in range(6)]
    limit = sorted(norms)[3]  # some calls are skipped, some are not
    skip = functools.partial(fx_acc.skip_large_updates, max_squared_norm=limit)
    oskip = functools.partial(optax.skip_large_updates, max_squared_norm=limit)
    tx = fx.accumulate(fx.sgd(0.1, momentum=0.9), every=3, should_skip_update_fn=skip)
    otx = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=3, should_skip_update_fn=oskip)
    ours, p_ours, state = run_fx(tx, params)
    donated, _, _ = run_fx(tx, params, donate=True)

    @jax.jit  # one compile: op by op, MultiSteps' lax.cond compiles on every call
    def ostep(p, s, n):
        u, s = otx.update(jax.tree.map(lambda x, y: 0.5 * x + y, p, n), s, p)
        return optax.apply_updates(p, u), s, u

    p, ostate = to_jnp(params), jax.jit(otx.init)(to_jnp(params))
    for k in range(STEPS):
        p, ostate, u = ostep(p, ostate, to_jnp(noise(k)))
        assert_trees_close(ours[k], from_jnp(u), rtol=1e-5, atol=1e-6)
        assert_trees_close(donated[k], ours[k], rtol=1e-6, atol=1e-7)
    assert_trees_close(p_ours, from_jnp(p), rtol=1e-5, atol=1e-6)
    assert int(state.emitted) == int(ostate.gradient_step) and int(state.mini_step) == int(ostate.mini_step)
    assert 0 < int(state.emitted) < 6  # calls were skipped
    assert float(state.skip_state["norm_squared"]) == pytest.approx(float(ostate.skip_state["norm_squared"]), rel=1e-5)


def test_extra_args_reach_the_inner_transform():
    inner = _reads_value_tx()
    assert fx.traits(fx.accumulate(inner, every=1)).extra_args
    assert not fx.traits(fx.accumulate(fx.sgd(0.1), every=1)).extra_args
    params = {"a": torch.zeros(2)}
    for every in (1, 2):
        tx = fx.accumulate(fx.chain(fx.scale(1.0), inner), every=every)
        state = tx.init(params)
        for _ in range(every):
            u, state = tx.update({"a": torch.ones(2)}, state, params, value=torch.tensor(3.0))
        assert u["a"].tolist() == [4.0, 4.0]
        u, _ = fx.update_(tx, {"a": torch.ones(2)}, tx.init(params), params, value=torch.tensor(3.0))
        if every == 1:
            assert u["a"].tolist() == [4.0, 4.0]
