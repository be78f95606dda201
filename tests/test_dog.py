"""fxtrain/contrib/_dog.py: DoG and DoWG, Optax's examples, the default init under vmap and grad."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close

C = fx.contrib


def _quadratic(tx, steps):
    params = torch.tensor([1.0, 2.0, 3.0])
    state, values = tx.init(params), []
    for _ in range(steps):
        u, state = tx.update(2 * params, state, params, value=(params ** 2).sum())  # extra args are ignored
        params = fx.apply_updates(params, u)
        values.append(float((params ** 2).sum()))
    return values


def test_optax_examples():  # the examples of Optax's dog and dowg docstrings
    assert _quadratic(C.dowg(), 5) == pytest.approx([13.925367, 13.872763, 13.775433, 13.596172, 13.268837],
                                                    rel=1e-6)
    assert all(13.99 < v < 14.0 for v in _quadratic(C.dog(), 5))


def test_dog_default_init_under_vmap_and_grad():
    """Issue 25: dog's default init (the heuristic r_eps = a (1 + |x_0|)) took the norm through the packed
    kernel, which vmap cannot batch and which under grad raised an error about DTensor leaves."""
    tx = C.dog()
    members = [{"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(i), dtype=torch.float64),
                "b": torch.full((2,), 0.1 * i, dtype=torch.float64)} for i in range(3)]
    batched = torch.func.vmap(tx.init)(fx.tree.map(lambda *xs: torch.stack(xs), *members))
    for i, p in enumerate(members):
        assert_trees_close(fx.tree.map(lambda x: x[i], batched), tx.init(p), rtol=1e-15, atol=0)

    def loss(w):
        p = {"w": w, "b": torch.ones(2, dtype=torch.float64)}
        state = tx.init(p)
        for _ in range(3):
            u, state = tx.update(fx.tree.map(lambda x: x ** 3 + x, p), state, p)
            p = fx.apply_updates(p, u)
        return sum((x ** 2).sum() for x in fx.tree.leaves(p))

    w0 = members[1]["w"]
    by_grad = torch.func.grad(loss)(w0)
    h, fd = 1e-6, torch.zeros_like(w0)
    for i in range(w0.numel()):
        e = torch.zeros(w0.numel(), dtype=torch.float64)
        e[i] = h
        fd.view(-1)[i] = (loss(w0 + e.view_as(w0)) - loss(w0 - e.view_as(w0))) / (2 * h)
    torch.testing.assert_close(by_grad, fd, rtol=1e-6, atol=1e-9)
