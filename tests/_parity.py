"""Runs an fxtrain transform and the same Optax transform side by side (parity tests' shared driver).

Both start from :func:`fxtrain.testing.nested_params` and take gradients ``0.5 * params + noise_k``
(noise fixed per step), so errors would compound through the params over the steps.

Also the checks every transform test runs (purity, dtypes, ``None`` leaves) and a reference ``trace``
for the tests of wrappers (``apply_if_finite``, ``inject_hyperparams``) that must not depend on
fxtrain's own optimizers.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import optree
import torch

import fxtrain as fx
from fxtrain import tree
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp, to_numpy

STEPS = 20


def noise(step: int, dtype: torch.dtype = torch.float32) -> dict:
    return nested_params(seed=1000 + step, dtype=dtype)


def grads(params: Any, step: int) -> Any:
    return tree.map(lambda p, n: (0.5 * p + n).to(p.dtype), params, noise(step, params_dtype(params)))


def params_dtype(params: Any) -> torch.dtype:
    return tree.leaves(params)[0].dtype


def run_fx(tx: fx.GradientTransformation, params: Any, steps: int = STEPS, *, donate: bool = False):
    """(updates per step, final params, final state); ``donate`` runs the in-place kernel."""
    state, history = tx.init(params), []
    for k in range(steps):
        g = grads(params, k)
        u, state = fx.update_(tx, g, state, params) if donate else tx.update(g, state, params)
        history.append(u)
        params = fx.apply_updates(params, u)
    return history, params, state


def run_optax(otx: Any, params: Any, steps: int = STEPS, *, jit: bool = True):
    """Optax's run on the same inputs; ``jit``: its update compiled once (op by op, a 20-step run of a large
    transform took seconds; XLA's float32 fusions agree with the eager ops well within the parity tolerance).
    Op by op is the cheaper of the two once a process has run similar transforms (JAX keeps each op's
    compiled kernel per shape, and the parity inputs have the same shapes): tests/test_optax_parity.py's
    155 cases spent 45 s of CPU in Optax op by op, 88 s compiled (one compile per case)."""
    import jax
    import optax

    p, history = to_jnp(params), []
    state = otx.init(p)
    # XLA keeps low-precision intermediates in float32 inside a fusion, where the eager ops (and fxtrain,
    # like JAX's weak typing) round each step: states held in bfloat16/float16 run op by op.
    low = any(getattr(x, "dtype", None) in (jax.numpy.bfloat16, jax.numpy.float16) for x in jax.tree.leaves(state))
    update = jax.jit(otx.update) if jit and not low else otx.update
    for k in range(steps):
        g = jax.tree.map(lambda x, n: 0.5 * x + n, p, to_jnp(noise(k)))
        u, state = update(g, state, p)
        history.append(from_jnp(u))
        p = optax.apply_updates(p, u)
    return history, from_jnp(p), state


def state_leaves_close(ours: Any, theirs: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """The two states hold the same leaves in the same order (Optax's layout), with close values."""
    import jax

    a = tree.leaves(ours)
    b = jax.tree.leaves(theirs)
    assert len(a) == len(b), f"state has {len(a)} leaves, Optax's {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        x_np, y_np = to_numpy(x), to_numpy(y)
        assert x_np.shape == y_np.shape, f"state leaf {i}: shape {x_np.shape} vs {y_np.shape}"
        np.testing.assert_allclose(x_np, y_np, rtol=rtol, atol=atol, err_msg=f"state leaf {i}")


def assert_parity(tx: fx.GradientTransformation, otx: Any, *, steps: int = STEPS, rtol: float = 1e-5,
                  atol: float = 1e-6, check_state: bool = True, jit: bool = True) -> None:
    """Every step's updates, the final params and the final state agree with Optax; pure and donated
    runs give the same numbers (to float32 rounding, rtol 1e-5 as against Optax: the pure run here is the
    out-of-place, composable path, one torch op per leaf, against the donated foreach kernels, and their
    arithmetic may differ where differentiability asks for it, e.g. Adam's m / d against 1 / (d / m), which
    optimistic_adam amplifies to 7e-6 relative over its steps). ``jit``: :func:`run_optax`'s."""
    params = nested_params()
    ours, p_ours, s_ours = run_fx(tx, params, steps)
    donated, p_donated, _ = run_fx(tx, params, steps, donate=True)
    theirs, p_theirs, s_theirs = run_optax(otx, params, steps, jit=jit)
    for k in range(steps):
        try:
            assert_trees_close(ours[k], theirs[k], rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"updates differ from Optax's at step {k}: {e}") from None
        assert_trees_close(donated[k], ours[k], rtol=1e-5, atol=1e-7)
    assert_trees_close(p_ours, p_theirs, rtol=rtol, atol=atol)
    assert_trees_close(p_donated, p_ours, rtol=1e-5, atol=1e-7)
    if check_state:
        state_leaves_close(s_ours, s_theirs, rtol=rtol, atol=atol)


# A mask with the full structure of nested_params (a bool per leaf).
TREE_MASK = {"dense": {"w": True, "b": False}, "blocks": [True, (False, True)], "scalar": False}


def ndim_mask(params: Any) -> Any:
    """Works on torch and jax trees alike: True for matrices and up (what weight decay usually hits)."""
    return optree.tree_map(lambda x: x.ndim >= 2, params)


def assert_dtypes(tx: fx.GradientTransformation, dtype: torch.dtype = torch.bfloat16, *,
                  state_dtypes: dict[str, torch.dtype] | None = None, steps: int = 3) -> None:
    """With ``dtype`` params, updates stay in ``dtype`` and so do the floating state leaves, except
    those under a state field named in ``state_dtypes`` (e.g. ``{"mu": torch.float32}``)."""
    params = nested_params(dtype=dtype)
    for donate in (False, True):
        history, _, state = run_fx(tx, params, steps, donate=donate)
        for path, u in zip(tree.paths(history[-1]), tree.flatten(history[-1])[0]):
            assert u.dtype == dtype, f"update at '{path}' is {u.dtype}, expected {dtype}"
        accessors = optree.tree_accessors(state, none_is_leaf=True, namespace="fxtrain")
        for acc, x in zip(accessors, tree.flatten(state)[0]):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                fields = {getattr(e, "field", None) for e in acc}  # NamedTuple field names on the way
                expected = next((d for k, d in (state_dtypes or {}).items() if k in fields), dtype)
                assert x.dtype == expected, f"state at {acc} is {x.dtype}, expected {expected}"


def assert_none_passthrough(tx: fx.GradientTransformation) -> None:
    """A ``None`` param stays ``None`` in the state and the updates; a frozen param (``None`` gradient)
    keeps its state untouched."""
    params = nested_params()
    params["dense"]["b"] = None
    state = tx.init(params)
    g = grads(params, 0)
    u, state = tx.update(g, state, params)
    assert u["dense"]["b"] is None
    for path, x in zip(tree.paths(state), tree.flatten(state)[0]):
        assert not path.endswith("dense.b") or x is None, f"state at '{path}' should be None"
    full = nested_params()
    state = tx.init(full)
    before = tree.clone(state)
    g = grads(full, 0)
    g["blocks"][0] = None
    u, state = fx.update_(tx, g, state, full)
    assert u["blocks"][0] is None
    for path, a, b in zip(tree.paths(state), tree.flatten(state)[0], tree.flatten(before)[0]):
        if path.split(".")[-2:] == ["blocks", "0"]:
            assert torch.equal(a, b), f"frozen state at '{path}' changed"


def assert_pure(tx: fx.GradientTransformation) -> None:
    """``tx.update`` leaves its inputs untouched."""
    params = nested_params()
    state = tx.init(params)
    _, state = tx.update(grads(params, 0), state, params)  # a non-trivial state
    g = grads(params, 1)
    copies = tree.clone((g, state, params))
    tx.update(g, state, params)
    assert_trees_close((g, state, params), copies, rtol=0, atol=0)


def assert_pure_and_donated_agree(tx: fx.GradientTransformation, grads_of: Callable[[int], Any], steps: int, *,
                                  equal_nan: bool = False) -> None:
    """Over ``steps`` updates on ``grads_of(step)``: ``tx.update`` leaves its inputs untouched on both of its
    paths, and the donated kernel (on copies) gives bit-identical updates and state to the pure update
    under ``no_grad`` (the same kernel) and close ones to the composable, out-of-place path."""
    params = nested_params()
    state = tx.init(params)
    for step in range(steps):
        g = grads_of(step)
        g0, s0 = tree.clone(g), tree.clone(state)
        cu, cnew = tx.update(g, state, params)
        with torch.no_grad():
            u, new = tx.update(g, state, params)
        assert_trees_close(g, g0, rtol=0, atol=0, equal_nan=equal_nan)
        assert_trees_close(state, s0, rtol=0, atol=0, equal_nan=equal_nan)
        du, dnew = fx.update_(tx, tree.clone(g), tree.clone(state), params)
        assert_trees_close(du, u, rtol=0, atol=0, equal_nan=equal_nan)
        assert_trees_close(dnew, new, rtol=0, atol=0, equal_nan=equal_nan)
        assert_trees_close(cu, u, rtol=1e-6, atol=1e-7, equal_nan=equal_nan)
        assert_trees_close(cnew, new, rtol=1e-6, atol=1e-7, equal_nan=equal_nan)
        state = new


# --- a reference transform, independent of fxtrain's optimizers -------------------------------------

def growing_grads(step: int) -> dict:
    """Gradients for wrapper tests: fresh random leaves per step, scaled by ``1 + 0.1 * step``."""
    return tree.map(lambda x: x * (1.0 + 0.1 * step), nested_params(seed=step + 1))


class TraceState(NamedTuple):
    trace: Any


@fx.transform(elementwise=True)
def reference_trace(decay: float) -> fx.GradientTransformation:
    """Optax's ``trace`` (no Nesterov), written here so wrapper tests do not depend on fxtrain's optimizers.

    Written with the op layer, so it needs ``@fx.transform`` for a pure ``update`` (the bare kernel writes
    into its inputs when run in place)."""
    def init_fn(params):
        return TraceState(tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        g, t = tree.align(updates, state.trace)
        t = tree.add_(tree.scale_(t, decay), g)
        g = tree.copy_(g, t)
        return tree.put(updates, updates, g), TraceState(tree.put(state.trace, updates, t))

    return fx.GradientTransformation(init_fn, update_fn)
