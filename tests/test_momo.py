"""fxtrain/contrib/_momo.py: MoMo and MoMo-Adam, which read the loss (``value=``): Optax parity over 20 steps, the
minimum, the value required."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests._parity import grads, noise, state_leaves_close
from tests.cases.contrib_b import with_schedules

C = fx.contrib


# Transforms that read the loss (value=): their own 20-step parity loop.
WITH_VALUE = {
    "momo-default": ("momo", {}),
    "momo-all": ("momo", {"learning_rate": "sched", "beta": 0.5, "lower_bound": 0.2, "weight_decay": 0.1}),
    "momo-adapt": ("momo", {"learning_rate": 0.5, "lower_bound": 0.1, "weight_decay": 0.01, "adapt_lower_bound": True}),
    "momo_adam-default": ("momo_adam", {}),
    "momo_adam-all": ("momo_adam", {"learning_rate": "sched", "b1": 0.8, "b2": 0.99, "eps": 1e-6,
                                    "lower_bound": 0.1, "weight_decay": 0.1}),
    "momo_adam-adapt": ("momo_adam", {"learning_rate": 0.1, "lower_bound": 0.5, "adapt_lower_bound": True}),
}


def _loss(params):
    return 0.25 * sum((p * p).sum() for p in fx.tree.leaves(params)) + 1.0


@pytest.mark.optax
@pytest.mark.parametrize("case", WITH_VALUE.values(), ids=WITH_VALUE.keys())
def test_value_reading_transforms_match_optax(case):
    import jax
    optax = pytest.importorskip("optax")
    name, kwargs = case
    tx = getattr(C, name)(**with_schedules(fx, kwargs))
    otx = getattr(optax.contrib, name)(**with_schedules(optax, kwargs))
    params = nested_params()
    jparams = to_jnp(params)
    state, ostate = tx.init(params), otx.init(jparams)
    for k in range(20):
        g, value = grads(params, k), _loss(params)
        u, state = (fx.update_(tx, g, state, params, value=value) if k % 2
                    else tx.update(g, state, params, value=value))
        og = jax.tree.map(lambda x, n: 0.5 * x + n, jparams, to_jnp(noise(k)))
        ou, ostate = otx.update(og, ostate, jparams, value=_loss(from_jnp(jparams)).numpy())
        assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
        params, jparams = fx.apply_updates(params, u), optax.apply_updates(jparams, ou)
    state_leaves_close(state, ostate)


@pytest.mark.parametrize("name", ["momo", "momo_adam"])
def test_momo_reaches_the_minimum_and_needs_the_value(name):
    target = torch.tensor([1.0, -1.0, 1.0])
    params, tx = torch.tensor([-1.0, 10.0, 1.0]), getattr(C, name)(0.1)  # Optax's common test's rate
    state = tx.init(params)
    for _ in range(300):
        u, state = tx.update(2 * (params - target), state, params, value=((params - target) ** 2).sum())
        params = fx.apply_updates(params, u)
    torch.testing.assert_close(params, target, rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match=rf"{name} needs the loss value at update"):
        tx.update(params, state, params)
    assert fx.traits(tx).extra_args and not fx.traits(tx).elementwise
