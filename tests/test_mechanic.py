"""fxtrain/contrib/_mechanic.py: ``mechanize``, Optax parity, Optax's first-step test, extra arguments and params
passed on."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from tests._parity import assert_parity

C = fx.contrib


MECHANIZE = {
    "sgd": (lambda lib: lib.sgd(1.0, momentum=0.9), {}),
    "adam_all": (lambda lib: lib.adam(lib.linear_schedule(1.0, 0.5, 10)),
                 {"weight_decay": 0.1, "eps": 1e-6, "s_init": 1e-4, "num_betas": 3}),
}


@pytest.mark.optax
@pytest.mark.parametrize("case", MECHANIZE.values(), ids=MECHANIZE.keys())
def test_mechanize_matches_optax(case):
    optax = pytest.importorskip("optax")
    base, kwargs = case
    assert_parity(C.mechanize(base(fx), **kwargs), optax.contrib.mechanize(base(optax), **kwargs))


def test_mechanized_first_step():  # Optax's test_mechanized
    @fx.transform
    def inner(step_size):  # SGD with a state, checking that it gets the params
        def init_fn(params):
            return (fx.tree.zeros_like(params),)

        def update_fn(updates, state, params=None):
            assert fx.tree.structure(params) == fx.tree.structure(updates)
            return fx.tree.map(lambda u: step_size * u, updates), (fx.apply_updates(state[0], updates),)
        return fx.GradientTransformation(init_fn, update_fn)

    params = {"x": torch.tensor(3.0), "y": torch.tensor(-3.0)}
    tx = C.mechanize(inner(-0.1), weight_decay=1e-2, eps=1e-10, s_init=1e-8, num_betas=6)
    u, state = tx.update({"x": torch.tensor(2.0), "y": torch.tensor(-2.0)}, tx.init(params), params)
    torch.testing.assert_close(state.m, torch.full((6,), 1e-10))
    torch.testing.assert_close(state.v, torch.zeros(6))
    torch.testing.assert_close(state.s, torch.full((6,), 1.6666667e-09))
    assert_trees_close(fx.apply_updates(params, u), params)
    assert all(torch.isfinite(x).all() for x in fx.tree.leaves((u, state)))


def test_mechanize_passes_extra_args_and_needs_params():
    tx = C.mechanize(C.momo(0.1))
    p = torch.tensor([1.0, 2.0])
    u, _ = tx.update(2 * p, tx.init(p), p, value=(p ** 2).sum())  # reaches momo
    assert torch.isfinite(u).all()
    with pytest.raises(ValueError, match=r"mechanize needs the params: call update"):
        tx.update(2 * p, tx.init(p))
    with pytest.raises(ValueError, match=r"mechanize: num_betas=0 must be an int >= 1"):
        C.mechanize(fx.sgd(1.0), num_betas=0)
