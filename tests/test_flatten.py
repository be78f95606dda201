"""flatten (fxtrain/transforms/_flatten.py): Optax's case, the same numbers as unflattened, Optax parity."""

import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, nested_params
from tests._parity import assert_dtypes, assert_pure, grads
from tests.cases.wrappers import reads_value


def test_optax_flatten():
    # Optax's _layouts_test: sgd(1e-2) with and without flatten give the same params.
    params = (torch.tensor(2.0), torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    g = (torch.tensor(1.0), torch.tensor([500.0, 5.0]), torch.tensor([300.0, 3.0]))
    plain, flat = fx.sgd(1e-2, 0.0), fx.flatten(fx.sgd(1e-2, 0.0))
    u, _ = plain.update(g, plain.init(params))
    v, _ = flat.update(g, flat.init(params))
    assert_trees_close(fx.apply_updates(params, v), fx.apply_updates(params, u), rtol=1e-7, atol=1e-7)


def test_elementwise_inner_gives_the_unflattened_numbers_with_one_vector_of_state():
    params = nested_params()
    flat, plain = fx.flatten(fx.adam(0.1)), fx.adam(0.1)
    s_flat, s_plain = flat.init(params), plain.init(params)
    n = sum(x.numel() for x in fx.tree.leaves(params))
    assert s_flat[0].mu.shape == (n,)
    for k in range(3):
        g = grads(params, k)
        for donate in (False, True):
            run = (lambda t, s: fx.update_(t, fx.tree.clone(g), fx.tree.clone(s), params)) if donate else \
                (lambda t, s: t.update(g, s, params))
            u, new_flat = run(flat, s_flat)
            v, new_plain = run(plain, s_plain)
            assert_trees_close(u, v, rtol=1e-6, atol=1e-7)
        s_flat, s_plain = new_flat, new_plain
        params = fx.apply_updates(params, u)
    assert fx.is_elementwise(flat) and not fx.is_elementwise(fx.flatten(fx.clip_by_global_norm(1.0)))


def test_pure_dtypes_and_mixed_dtypes():
    tx = fx.flatten(fx.sgd(0.1, momentum=0.9))
    assert_pure(tx)
    assert_dtypes(tx, state_dtypes={"trace": torch.bfloat16})
    # leaves of several dtypes: concatenated in the promoted dtype, updates back in each leaf's dtype
    g = {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(1)}
    u, state = tx.update(g, tx.init(g))
    assert u["a"].dtype == torch.bfloat16 and u["b"].dtype == torch.float32 and state[0].trace.dtype == torch.float32


def test_extra_args_reach_the_inner_transform():
    tx = fx.flatten(reads_value())
    assert fx.traits(tx).extra_args and not fx.traits(fx.flatten(fx.sgd(0.1))).extra_args
    g = {"a": torch.ones(2), "b": torch.ones(1)}
    u, _ = tx.update(g, tx.init(g), value=torch.tensor(2.0))
    assert u["a"].tolist() == [3.0, 3.0] and u["b"].tolist() == [3.0]
