"""apply_every, incremental_update, periodic_update (fxtrain/transforms/_periodic.py): Optax's cases, parity."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure


def test_optax_apply_every():
    # Optax's transform_test: chain(apply_every(4), trace(0), scale(-lr)) moves the params as sgd(lr) every
    # 4th step (4 summed gradients against 4 steps of sgd), zeros in between.
    lr, k = 1e-2, 4
    init = (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    g = (torch.tensor([500.0, 5.0]), torch.tensor([300.0, 3.0]))
    sgd, every = fx.sgd(lr, 0.0), fx.chain(fx.apply_every(k=k), fx.trace(decay=0.0), fx.scale(-lr))
    p_sgd, p_every = init, init
    s_sgd, s_every = sgd.init(p_sgd), every.init(p_every)
    for i in range(12):
        u, s_sgd = sgd.update(g, s_sgd)
        p_sgd = fx.apply_updates(p_sgd, u)
        u, s_every = every.update(g, s_every)
        p_every = fx.apply_updates(p_every, u)
        if i % k == k - 1:
            assert_trees_close(p_every, p_sgd, rtol=1e-5, atol=1e-6)
        else:
            assert_trees_close(u, (torch.zeros(2), torch.zeros(2)), rtol=0, atol=0)


@pytest.mark.optax
@pytest.mark.parametrize("k", [1, 3])
def test_apply_every_matches_optax(k):
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.apply_every(k), fx.adam(0.1)), optax.chain(optax.apply_every(k), optax.adam(0.1)))


def test_apply_every_pure_dtypes_none_and_errors():
    tx = fx.apply_every(3)
    assert_pure(tx)
    assert_dtypes(tx)
    assert_none_passthrough(tx)
    assert fx.is_elementwise(tx) and repr(tx) == "apply_every(k=3)"
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="apply_every: k="):
            fx.apply_every(bad)


def test_optax_incremental_update():
    params_1 = ({"a": torch.ones(3, 2)}, torch.ones(1))
    params_2 = fx.tree.map(lambda t: 2 * t, params_1)
    assert_trees_close(fx.incremental_update(params_2, params_1, 0.5), fx.tree.map(lambda t: 1.5 * t, params_1))
    # a tensor step size, and None (Optax's test_none_argument)
    assert_trees_close(fx.incremental_update(params_2, params_1, torch.tensor(0.25)),
                       fx.tree.map(lambda t: 1.25 * t, params_1))
    assert fx.incremental_update(None, torch.tensor([1.0, 2.0, 3.0]), 1) is None
    assert fx.incremental_update({"a": None}, {"a": torch.ones(1)}, 0.5) == {"a": None}


@pytest.mark.parametrize("tensor_steps", [False, True])
def test_optax_periodic_update(tensor_steps):
    params_1 = ({"a": torch.ones(3, 2)}, torch.ones(1))
    params_2 = fx.tree.map(lambda t: 2 * t, params_1)
    period = 5
    for j in range(3):
        for i in range(1, period):
            steps = j * period + i
            steps = torch.tensor(steps, dtype=torch.int32) if tensor_steps else steps
            assert_trees_close(fx.periodic_update(params_2, params_1, steps, period), params_1, rtol=0, atol=0)
        steps = (j + 1) * period
        steps = torch.tensor(steps, dtype=torch.int32) if tensor_steps else steps
        assert_trees_close(fx.periodic_update(params_2, params_1, steps, period), params_2, rtol=0, atol=0)


def test_incremental_and_periodic_updates_under_torch_func():
    # A target network's average is differentiable and batchable like the rest.
    new, old = {"w": torch.tensor([2.0, 4.0])}, {"w": torch.tensor([1.0, 1.0])}
    grad = torch.func.grad(lambda s: fx.incremental_update(new, old, s)["w"].sum())(torch.tensor(0.5))
    assert grad.item() == pytest.approx(4.0)  # d/ds sum(s * new + (1 - s) * old) = sum(new - old)
    steps = torch.tensor([4, 5])
    out = torch.func.vmap(lambda n: fx.periodic_update(new, old, n, 5)["w"])(steps)
    assert out.tolist() == [[1.0, 1.0], [2.0, 4.0]]
