"""Every public transform through the same checks.

pure under direct ``update`` (inputs unchanged), donated kernel gives the same numbers, state structure
stable across steps, dtype preserved (float32 and bfloat16 leaves), ``None`` leaves pass through, repr
readable. A public factory without a case here fails ``test_every_public_transform_has_a_case``.
"""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, nested_params
from tests import cases


def _sched(count):
    return 0.1 * 0.9 ** count


# name -> builder. Builders are lambdas so this file imports while modules are still landing.
CASES = {
    "scale": lambda: fx.scale(0.5),
    "identity": lambda: fx.identity(),
    "chain": lambda: fx.chain(fx.scale(2.0), fx.identity()),
    "named_chain": lambda: fx.named_chain(("a", fx.scale(2.0)), ("b", fx.identity())),
    "stateless": lambda: fx.stateless(lambda u, p: fx.tree.map(torch.neg, u)),
    "scale_by_learning_rate": lambda: fx.scale_by_learning_rate(0.1),
    "scale_by_schedule": lambda: fx.scale_by_schedule(_sched),
    "scale_by_adam": lambda: fx.scale_by_adam(nesterov=True),
    "scale_by_rms": lambda: fx.scale_by_rms(),
    "scale_by_stddev": lambda: fx.scale_by_stddev(),
    "scale_by_rss": lambda: fx.scale_by_rss(),
    "scale_by_lion": lambda: fx.scale_by_lion(),
    "trace": lambda: fx.trace(decay=0.9, nesterov=True),
    "add_decayed_weights": lambda: fx.add_decayed_weights(1e-2),
    "clip": lambda: fx.clip(0.1),
    "clip_by_global_norm": lambda: fx.clip_by_global_norm(0.5),
    "masked": lambda: fx.masked(fx.scale(3.0), lambda p: fx.tree.map(lambda x: x.ndim > 1, p)),
    "partition": lambda: fx.partition(
        {"matrix": fx.scale(2.0), "other": fx.identity()},
        lambda p: fx.tree.map(lambda x: "matrix" if x.ndim > 1 else "other", p),
    ),
    "inject_hyperparams": lambda: fx.inject_hyperparams(fx.adamw)(learning_rate=_sched, weight_decay=1e-2),
    "apply_if_finite": lambda: fx.apply_if_finite(fx.sgd(0.1, momentum=0.9), max_consecutive_errors=2),
    "accumulate": lambda: fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adam(1e-2)), every=2),
    "amp_cast": lambda: fx.amp_cast(fx.sgd(0.1), policy="p=f32,c=f16,o=f32", loss_scale="dynamic"),
    "sgd": lambda: fx.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: fx.adam(1e-2),
    "adamw": lambda: fx.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: fx.lion(1e-3),
    "rmsprop": lambda: fx.rmsprop(1e-2, centered=True, momentum=0.9),
    "adagrad": lambda: fx.adagrad(1e-2),
    "sharded_apply": lambda: fx.sharded_apply(fx.adamw(1e-2, weight_decay=1e-2)),  # plain leaves: the inner
}

CASES.update(cases.merged("CONFORMANCE"))  # issue 18's catalogue, one module per family (tests/cases/)


def test_every_public_transform_has_a_case():
    registered = {id(f) for f in fx._base.factories().values()}
    public = {n for ns in (fx, fx.contrib) for n in dir(ns) if id(getattr(ns, n)) in registered}
    missing = public - set(CASES)
    assert not missing, f"public transforms without a conformance case: {sorted(missing)}"


def _grads(dtype, with_none):
    g = nested_params(seed=1, dtype=dtype)
    if with_none:
        g["blocks"][1] = (None, g["blocks"][1][1])
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_conformance(name, dtype):
    tx = CASES[name]()
    r = repr(tx)
    assert r.startswith(name + "("), r
    assert "<function" not in r and "object at 0x" not in r, r

    params = nested_params(seed=0, dtype=dtype)
    params["blocks"][1] = (None, params["blocks"][1][1])  # an absent parameter
    state = tx.init(params)
    spec0 = fx.tree.structure(state)
    for step in range(3):
        grads = _grads(dtype, with_none=True)
        g_before, s_before = fx.tree.clone(grads), fx.tree.clone(state)
        # The composable path (autograd recording: out of place, one torch op per leaf).
        c_updates, c_state = tx.update(grads, state, params)
        # The pure path under no_grad: the in-place kernel on copies.
        with torch.no_grad():
            updates, new_state = tx.update(grads, state, params)
        # Pure: inputs untouched, by either path.
        assert_trees_close(grads, g_before, rtol=0, atol=0)
        assert_trees_close(state, s_before, rtol=0, atol=0, equal_nan=True)
        # The donated kernel gives the same numbers as the same kernel on copies, bit for bit...
        d_updates, d_state = fx.update_(tx, fx.tree.clone(grads), fx.tree.clone(state), params)
        # A donated kernel may return None for updates it leaves untouched (accumulate between
        # emissions: the step skips the add); the pure update returns zeros there, as Optax does.
        d_updates = fx.tree.map(lambda u, d: torch.zeros_like(u) if d is None else d, updates, d_updates)
        assert_trees_close(d_updates, updates, rtol=0, atol=0)
        assert_trees_close(d_state, new_state, rtol=0, atol=0, equal_nan=True)
        # ...and the out-of-place ops the same to rounding: foreach and per-tensor kernels may round a
        # Python scalar differently (bfloat16 mul), i.e. within a couple of ulps of the leaf dtype.
        tol = {"rtol": 2e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
        assert_trees_close(c_updates, updates, **tol)
        assert_trees_close(c_state, new_state, equal_nan=True, **tol)
        assert fx.tree.structure(c_state) == fx.tree.structure(new_state)
        # Structure stable, None passes, dtype preserved.
        assert fx.tree.structure(new_state) == spec0, f"state structure changed at step {step}"
        assert updates["blocks"][1][0] is None
        for u, g in zip(fx.tree.leaves(updates), fx.tree.leaves(grads)):
            assert u.dtype == g.dtype and u.shape == g.shape
        state = new_state
        params = fx.apply_updates(params, updates)
