"""fxtrain/interop/_optax_state.py: a run continues in the other framework and lands on the same params."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain import tree
from fxtrain.interop import from_jax, state_from_optax, state_to_optax, to_jax
from fxtrain.testing import assert_trees_close, nested_params, to_numpy

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytestmark = pytest.mark.jax


def noise(k: int) -> dict:
    return nested_params(seed=1000 + k)


def fx_steps(tx, params, state, ks):
    for k in ks:  # gradients 0.5 * params + noise_k: errors would compound through the params
        g = tree.map(lambda p, n: 0.5 * p + n, params, noise(k))
        u, state = tx.update(g, state, params)
        params = fx.apply_updates(params, u)
    return params, state


def optax_steps(otx, params, state, ks):
    for k in ks:
        g = jax.tree.map(lambda p, n: 0.5 * p + n, params, to_jax(noise(k)))
        u, state = otx.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def schedule_pair():
    return (fx.warmup_cosine_decay_schedule(0.0, 0.1, 3, 10, 0.01),
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 3, 10, 0.01))


def cases():
    fs, os_ = schedule_pair()
    return {
        "adamw": (fx.adamw(0.05, weight_decay=0.1), optax.adamw(0.05, weight_decay=0.1)),
        "sgd_momentum": (fx.sgd(0.05, momentum=0.9), optax.sgd(0.05, momentum=0.9)),
        "lion": (fx.lion(0.01, weight_decay=0.1), optax.lion(0.01, weight_decay=0.1)),
        "clip_adamw_schedule": (fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(fs, weight_decay=0.1)),
                                optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(os_, weight_decay=0.1))),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_five_steps_in_fxtrain_then_five_in_optax_land_on_ten_steps_of_either(name):
    tx, otx = cases()[name]
    p0 = nested_params()
    p, s = fx_steps(tx, p0, tx.init(p0), range(5))
    op, os_ = optax_steps(otx, to_jax(p), state_to_optax(s, otx.init(to_jax(p0))), range(5, 10))
    ref_optax, _ = optax_steps(otx, to_jax(p0), otx.init(to_jax(p0)), range(10))
    ref_fx, _ = fx_steps(tx, p0, tx.init(p0), range(10))
    assert_trees_close(from_jax(op), from_jax(ref_optax), rtol=1e-5, atol=1e-6)
    assert_trees_close(from_jax(op), ref_fx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(cases()))
def test_five_steps_in_optax_then_five_in_fxtrain_land_on_ten_steps_of_either(name):
    tx, otx = cases()[name]
    p0 = nested_params()
    op, os_ = optax_steps(otx, to_jax(p0), otx.init(to_jax(p0)), range(5))
    p = tree.map(torch.clone, from_jax(op))
    p, s = fx_steps(tx, p, state_from_optax(os_, tx.init(p0)), range(5, 10))
    ref_fx, _ = fx_steps(tx, p0, tx.init(p0), range(10))
    ref_optax, _ = optax_steps(otx, to_jax(p0), otx.init(to_jax(p0)), range(10))
    assert_trees_close(p, ref_fx, rtol=1e-5, atol=1e-6)
    assert_trees_close(p, from_jax(ref_optax), rtol=1e-5, atol=1e-6)


def test_continuation_under_a_donated_train_step():
    # The fxtrain side of a continuation is usually train_step (donated, in place): same params.
    tx, otx = cases()["adamw"]
    p0 = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    x = torch.randn(8, 4)

    def loss(p, batch):
        return ((batch @ p["w"] + p["b"]) ** 2).mean()

    def oloss(p, batch):
        return ((batch @ p["w"] + p["b"]) ** 2).mean()

    op, os_ = to_jax(tree.clone(p0)), otx.init(to_jax(p0))
    for _ in range(3):
        g = jax.grad(oloss)(op, to_jax(x))
        u, os_ = otx.update(g, os_, op)
        op = optax.apply_updates(op, u)
    step = fx.train_step(loss, tx)
    p, s = tree.map(torch.clone, from_jax(op)), state_from_optax(os_, tx.init(p0))
    for _ in range(3):
        p, s, _ = step(p, s, x)
    ref, rs = tree.clone(p0), tx.init(p0)
    for _ in range(6):
        ref, rs, _ = step(ref, rs, x)
    assert_trees_close(p, ref, rtol=1e-5, atol=1e-6)


def round_trip_cases():
    params = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    mask = {"w": True, "b": False}
    labels = {"w": "a", "b": "b"}
    fs, os_ = schedule_pair()
    return params, {
        "adamw_masked_decay": (fx.adamw(0.1, mask=mask), optax.adamw(0.1, mask=mask)),
        "masked": (fx.masked(fx.adam(0.1), mask), optax.masked(optax.adam(0.1), mask)),
        "partition": (fx.partition({"a": fx.sgd(0.1, momentum=0.5), "b": fx.adam(0.1)}, labels),
                      optax.partition({"a": optax.sgd(0.1, momentum=0.5), "b": optax.adam(0.1)}, labels)),
        "inject_hyperparams": (fx.inject_hyperparams(fx.adamw)(learning_rate=fs, weight_decay=0.1),
                               optax.inject_hyperparams(optax.adamw)(learning_rate=os_, weight_decay=0.1)),
        "rmsprop_centered_momentum": (fx.rmsprop(0.1, centered=True, momentum=0.9),
                                      optax.rmsprop(0.1, centered=True, momentum=0.9)),
        "scale_by_rms_bias_corrected": (fx.scale_by_rms(bias_correction=True),
                                        optax.scale_by_rms(bias_correction=True)),
        "adagrad": (fx.adagrad(0.1), optax.adagrad(0.1)),
        "apply_if_finite": (fx.apply_if_finite(fx.sgd(0.1), 3), optax.apply_if_finite(optax.sgd(0.1), 3)),
        "named_chain": (fx.named_chain(("clip", fx.clip_by_global_norm(1.0)), ("opt", fx.lion(0.1))),
                        optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("opt", optax.lion(0.1)))),
        "decay_schedule": (fx.adamw(0.1, weight_decay=fs), optax.adamw(0.1, weight_decay=os_)),
    }


@pytest.mark.parametrize("name", list(round_trip_cases()[1]))
def test_states_match_optax_after_steps_and_round_trip(name):
    params, all_cases = round_trip_cases()
    tx, otx = all_cases[name]
    p = tree.map(torch.randn_like, params)
    op = to_jax(p)
    fs, os_ = tx.init(p), otx.init(op)
    for k in range(3):
        g = tree.map(lambda x: torch.randn_like(x), p)
        _, fs = tx.update(g, fs, p)
        _, os_ = otx.update(to_jax(g), os_, op)
    converted = state_to_optax(fs, otx.init(op))
    assert jax.tree.structure(converted) == jax.tree.structure(os_)
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(os_)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-5, atol=1e-6)
    back = state_from_optax(converted, tx.init(p))
    assert tree.structure(back) == tree.structure(fs)
    if name == "named_chain":  # Optax keeps no grad_norm: it comes back as zero
        fs = {**fs, "clip": fx.ClipByGlobalNormState(torch.zeros(()))}
    assert_trees_close(back, fs)


def test_clip_state_grad_norm_is_dropped_and_comes_back_zero():
    p = {"w": torch.ones(3)}
    tx = fx.clip_by_global_norm(1.0)
    _, s = tx.update({"w": torch.full((3,), 4.0)}, tx.init(p))
    assert float(s.grad_norm) > 0
    o = state_to_optax(s, optax.clip_by_global_norm(1.0).init(to_jax(p)))
    assert type(o).__name__ == "EmptyState"
    back = state_from_optax(o, tx.init(p))
    assert type(back) is fx.ClipByGlobalNormState and float(back.grad_norm) == 0.0


def test_accumulate_and_multisteps_convert_mid_window():
    p = {"w": torch.zeros(3)}
    tx = fx.accumulate(fx.sgd(1.0), every=3)
    otx = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=3)
    gs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 0.0, -1.0]), torch.tensor([2.0, 1.0, 1.0])]
    s = tx.init(p)
    for g in gs[:2]:
        _, s = tx.update({"w": g}, s, p)
    o = state_to_optax(s, otx.init(to_jax(p)))
    assert int(o.mini_step) == 2 and o.acc_grads["w"].tolist() == [2.0, 1.0, 1.0]  # Optax keeps the mean
    u, _ = otx.update(to_jax({"w": gs[2]}), o, to_jax(p))
    assert u["w"].tolist() == [-2.0, -1.0, -1.0]
    back = state_from_optax(o, tx.init(p))
    u, _ = tx.update({"w": gs[2]}, back, p)
    assert u["w"].tolist() == [-2.0, -1.0, -1.0]


def test_mismatch_names_the_first_path_that_differs():
    p = {"w": torch.zeros(2), "b": torch.zeros(1)}
    s = fx.adamw(0.1).init(p)
    with pytest.raises(ValueError, match=r"state_to_optax: the states differ at '0': ScaleByAdamState vs ScaleByLionState"):
        state_to_optax(s, optax.lion(0.1).init(to_jax(p)))
    with pytest.raises(ValueError, match=r"differ at '0.mu.b': key 'b' is in one state only"):
        state_to_optax(s, optax.adamw(0.1).init(to_jax({"w": p["w"]})))
    with pytest.raises(ValueError, match=r"differ at '0.mu.w': shape \(2,\) vs \(5,\)"):
        state_to_optax(s, optax.adamw(0.1).init(to_jax({"w": torch.zeros(5), "b": p["b"]})))
    with pytest.raises(ValueError, match=r"state_from_optax: the states differ at '<root>': 3 entries vs 2"):
        state_from_optax(optax.adamw(0.1).init(to_jax(p)), fx.sgd(0.1, momentum=0.9).init(p))


def test_from_optax_copies_leaves_that_would_share_a_buffer():
    p = {"a": torch.zeros(3), "b": torch.zeros(3)}
    shared = jax.numpy.ones(3)
    o = optax.sgd(0.1, momentum=0.9).init(to_jax(p))
    o = (o[0]._replace(trace={"a": shared, "b": shared}), o[1])
    s = state_from_optax(o, fx.sgd(0.1, momentum=0.9).init(p), copy=False)
    assert s[0].trace["a"].data_ptr() != s[0].trace["b"].data_ptr()
    assert s[0].trace["a"].data_ptr() == shared.unsafe_buffer_pointer()  # the first one is not copied


# --- a linen-named Optax state in memory (naming="linen"), against Flax linen + Optax --------------------------

def linen_run():
    """A Flax linen MLP and its torch twin, trained in JAX with Optax: the state names its params Dense_0/kernel."""
    linen = pytest.importorskip("flax.linen")
    jnp = jax.numpy

    class FlaxMLP(linen.Module):
        @linen.compact
        def __call__(self, x):
            h = jnp.tanh(linen.Dense(8)(x))  # Dense_0: compact names count in creation order
            return linen.Dense(2)(h)

    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g)
    otx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.05, weight_decay=0.1))
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(0.05, weight_decay=0.1))
    jx, jy = to_jax(x), to_jax(y)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.mean((FlaxMLP().apply({"params": p}, jx) - jy) ** 2))(params)
        updates, state = otx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def jax_steps(params, state, n):
        for _ in range(n):
            params, state = step(params, state)
        return params, state

    params = FlaxMLP().init(jax.random.key(0), jnp.zeros((1, 3)))["params"]
    return net, tx, otx, (x, y), jax_steps, params


def test_a_linen_named_optax_state_continues_in_fxtrain(mse_steps):
    from fxtrain.interop import from_linen

    net, tx, otx, data, jax_steps, params = linen_run()
    jp, js = jax_steps(params, otx.init(params), 4)
    p = from_linen({"params": jp}, net)
    like = tx.init(p)
    s = state_from_optax(js, like, naming="linen", module=net)
    assert int(s[1][0].count) == 4
    assert torch.equal(s[1][0].nu["0.weight"], from_jax(js[1][0].nu["Dense_0"]["kernel"]).T)  # torch's (out, in)
    p, _ = mse_steps(net, tx, p, s, 4, data)
    expected, _ = jax_steps(jp, js, 4)  # the run that stayed in JAX
    assert_trees_close(p, from_linen({"params": expected}, net), rtol=1e-5, atol=1e-6)


def test_a_wrong_naming_is_one_line_naming_the_names_it_saw():
    net, tx, otx, _, _, params = linen_run()
    like = tx.init({k: v.detach() for k, v in net.named_parameters()})
    state = otx.init(params)
    with pytest.raises(ValueError) as raised:
        state_from_optax(state, like)  # linen names, read as torch's
    assert str(raised.value) == ("state_from_optax: the names differ at '1.0.mu': the Optax state has ['Dense_0', "
                                 "'Dense_1'], the fxtrain one ['0.bias', '0.weight', '2.bias', '2.weight']; a state of "
                                 "Flax params needs naming='linen' (or 'attribute', 'nnx') and module=, the torch module")
    with pytest.raises(ValueError) as raised:
        state_from_optax(state, like, naming="attribute", module=net)  # linen names of a setup module: layers_0...
    assert str(raised.value) == ("state_from_optax: naming='attribute' does not fit the state at '1.0.mu': it has "
                                 "['Dense_0', 'Dense_1'], Sequential's attribute names are ['layers_0', 'layers_2']; "
                                 "pass the naming the state was made with ('torch', 'linen', 'attribute' or 'nnx')")
    with pytest.raises(ValueError, match=r"^state_from_optax: naming='linen' needs module=, the torch module whose"):
        state_from_optax(state, like, naming="linen")
    with pytest.raises(ValueError, match=r"^state_from_optax: naming='flax': expected one of 'torch', 'linen', "):
        state_from_optax(state, like, naming="flax", module=net)
