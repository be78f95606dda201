"""Tests for fxtrain/contrib/_reduce_on_plateau.py: Optax's cases, parity over a value sequence, no host sync."""

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.contrib import ReduceLROnPlateauState
from fxtrain.testing import assert_trees_close, nested_params, to_jnp
from tests._parity import grads, state_leaves_close
from tests._runner import isolate, run_main  # noqa: F401 - isolate: autouse (Hydra's state, logging, the directory)

# Optax's test setup (optax/contrib/_reduce_on_plateau_test.py)
PATIENCE, COOLDOWN = 5, 5


def _optax_setup():
    return fx.contrib.reduce_on_plateau(factor=0.1, patience=PATIENCE, rtol=1e-4, atol=0.0, cooldown=COOLDOWN,
                                        accumulation_size=1, min_scale=0.01)


def _state(dtype, *, best_value, plateau_count, scale, cooldown_count):
    i32 = torch.int32
    return ReduceLROnPlateauState(scale=torch.tensor(scale, dtype=dtype), best_value=torch.tensor(best_value, dtype=dtype),
                                  plateau_count=torch.tensor(plateau_count, dtype=i32),
                                  cooldown_count=torch.tensor(cooldown_count, dtype=i32),
                                  count=torch.tensor(0, dtype=i32), avg_value=torch.tensor(0.0, dtype=dtype))


def _check(state, *, scale, best_value, plateau_count, cooldown_count=None):
    assert state.scale.item() == pytest.approx(scale)
    assert state.best_value.item() == pytest.approx(best_value)
    assert state.plateau_count.item() == plateau_count
    if cooldown_count is not None:
        assert state.cooldown_count.item() == cooldown_count


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])  # Optax: x64 off/on


@DTYPES
def test_reduced_after_patience_then_cooldown_counts_down(dtype):
    tx = _optax_setup()
    g = {"params": torch.tensor(1.0, dtype=dtype)}
    state = tx.init(g["params"])
    for _ in range(PATIENCE + 1):
        updates, state = tx.update(g, state, value=torch.tensor(1.0, dtype=dtype))
    _check(state, scale=0.1, best_value=1.0, plateau_count=0, cooldown_count=COOLDOWN)
    assert updates["params"].item() == pytest.approx(0.1)
    _, state = tx.update(updates, state, value=torch.tensor(1.0, dtype=dtype))
    _check(state, scale=0.1, best_value=1.0, plateau_count=0, cooldown_count=COOLDOWN - 1)


@DTYPES
def test_improvement_resets_the_plateau_count(dtype):
    state = _state(dtype, best_value=1.0, plateau_count=3, scale=0.1, cooldown_count=0)
    _, state = _optax_setup().update({"params": torch.tensor(1.0, dtype=dtype)}, state, value=0.1)
    _check(state, scale=0.1, best_value=0.1, plateau_count=0)


@DTYPES
def test_not_reduced_during_cooldown(dtype):
    state = _state(dtype, best_value=1.0, plateau_count=0, scale=0.1, cooldown_count=3)
    _, state = _optax_setup().update({"params": torch.tensor(1.0, dtype=dtype)}, state, value=2.0)
    _check(state, scale=0.1, best_value=1.0, plateau_count=0, cooldown_count=2)


@DTYPES
def test_not_reduced_below_min_scale(dtype):
    tx, g = _optax_setup(), {"params": torch.tensor(1.0, dtype=dtype)}
    state = _state(dtype, best_value=1.0, plateau_count=0, scale=0.01, cooldown_count=0)
    for _ in range(PATIENCE + 1):
        updates, state = tx.update(g, state, value=0.1)
    _check(state, scale=0.01, best_value=0.1, plateau_count=0, cooldown_count=COOLDOWN)
    assert updates["params"].item() == pytest.approx(0.01)


# --- against Optax over a value sequence --------------------------------------------------------

# A loss that improves, stalls, improves a little (less than rtol), jumps, and stalls again.
VALUES = [1.0, 0.9, 0.95, 0.91, 0.92, 0.8, 0.8, 0.79995, 0.81, 0.7, 0.75, 0.72, 0.71, 0.71, 0.5, 0.6,
          0.55, 0.52, 0.51, 0.51, 0.53, 0.49, 0.5, 0.5]
CONFIGS = {
    "defaults": dict(),
    "short_patience": dict(factor=0.5, patience=2, cooldown=1),
    # means of 3 improve by more than atol five times, then twice by less: 0.3, then 0.09 floored at 0.1
    "accumulated_atol": dict(factor=0.3, patience=1, rtol=0.0, atol=0.05, accumulation_size=3, min_scale=0.1),
    "no_cooldown_min_scale": dict(patience=1, min_scale=0.02, rtol=1e-3),
}


def _run_fx(tx, donate):
    params = nested_params()
    state, history = tx.init(params), []
    for k, v in enumerate(VALUES):
        g = grads(params, k)
        value = torch.tensor(v)
        u, state = fx.update_(tx, g, state, params, value=value) if donate else tx.update(g, state, params, value=value)
        history.append(u)
        params = fx.apply_updates(params, u)
    return history, state


def _run_optax(otx):
    import jax
    import optax

    from fxtrain.testing import from_jnp
    from tests._parity import noise

    p, history = to_jnp(nested_params()), []
    state, update = otx.init(p), jax.jit(otx.update)  # compiled once: op by op, lax.cond is slow
    for k, v in enumerate(VALUES):
        g = jax.tree.map(lambda x, n: 0.5 * x + n, p, to_jnp(noise(k)))
        u, state = update(g, state, p, value=np.float32(v))
        history.append(from_jnp(u))
        p = optax.apply_updates(p, u)
    return history, state


@pytest.mark.optax
@pytest.mark.parametrize("config", CONFIGS)
def test_value_sequence_matches_optax(config):
    optax = pytest.importorskip("optax")
    kwargs = CONFIGS[config]
    tx = fx.chain(fx.sgd(0.1), fx.contrib.reduce_on_plateau(**kwargs))
    theirs, t_state = _run_optax(optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(**kwargs)))
    scales = set()
    for donate in (False, True):
        ours, state = _run_fx(tx, donate)
        for k in range(len(VALUES)):
            assert_trees_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
        state_leaves_close(state, t_state)
        scales.add(round(state[1].scale.item(), 6))
    if config != "defaults":  # 24 values are fewer than the default patience needs
        assert scales != {1.0}, "a test of nothing: the scale never moved"


# --- dtypes, batching, no host sync ---------------------------------------------------------------

def test_state_dtypes_follow_optax():
    tx = fx.contrib.reduce_on_plateau()
    mixed = tx.init({"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2)})
    assert (mixed.scale.dtype, mixed.best_value.dtype, mixed.avg_value.dtype) == \
        (torch.bfloat16, torch.float32, torch.float32)
    assert tx.init({}).scale.dtype == torch.float32
    assert mixed.count.dtype == mixed.plateau_count.dtype == mixed.cooldown_count.dtype == torch.int32
    with pytest.raises(ValueError, match="reduce_on_plateau: the params mix"):
        tx.init({"a": torch.zeros(1, dtype=torch.float16), "b": torch.zeros(1, dtype=torch.bfloat16)})


def test_bfloat16_matches_optax():
    # Python hyperparameters meet bfloat16 state rounded to bfloat16, as JAX's weak types do
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp

    kwargs = dict(factor=0.3, patience=1, rtol=1e-2)
    tx, otx = fx.contrib.reduce_on_plateau(**kwargs), optax.contrib.reduce_on_plateau(**kwargs)
    p = torch.ones(3, dtype=torch.bfloat16)
    state, o_state, o_update = tx.init(p), otx.init(jnp.ones(3, jnp.bfloat16)), jax.jit(otx.update)
    for v in [1.0, 0.995, 0.99, 0.98, 0.985, 0.5, 0.6, 0.7]:
        u, state = tx.update(p, state, value=v)
        ou, o_state = o_update(jnp.ones(3, jnp.bfloat16), o_state, value=np.float32(v))
        assert u.dtype == torch.bfloat16
        np.testing.assert_array_equal(u.float().numpy(), np.asarray(ou, np.float32))
    state_leaves_close(state, o_state, rtol=0, atol=0)
    assert state.scale.item() < 0.01  # reduced five times, each in bfloat16


def test_vmap_each_member_decides_on_its_own_value():
    tx = fx.contrib.reduce_on_plateau(patience=1, factor=0.5)
    p = {"w": torch.ones(2)}
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.5, 0.25, 0.1], [1.0, 2.0, 0.1, 0.2]])  # member x step
    states = torch.func.vmap(tx.init, randomness="same")(fx.tree.map(lambda x: x.expand(3, *x.shape), p))
    one_by_one = [tx.init(p) for _ in range(3)]
    for step in range(values.shape[1]):
        us, states = torch.func.vmap(lambda s, v: tx.update(p, s, value=v))(states, values[:, step])
        for m in range(3):
            u, one_by_one[m] = tx.update(p, one_by_one[m], value=values[m, step])
            assert_trees_close(fx.tree.map(lambda x: x[m], us), u, rtol=0, atol=0)
    assert [s.item() for s in states.scale] == [0.125, 1.0, 0.25]


def test_no_host_sync():
    # on the meta device a tensor has no value: reading one on the host, or branching on it, would raise
    tx = fx.chain(fx.sgd(0.1), fx.contrib.reduce_on_plateau(patience=1))
    p = {"w": torch.zeros(3, device="meta")}
    state = tx.init(p)
    u, state = tx.update(p, state, p, value=torch.zeros((), device="meta"))
    u, state = fx.update_(tx, u, state, p, value=torch.zeros((), device="meta"))
    assert u["w"].device.type == "meta" and state[1].scale.device.type == "meta"


def test_gradient_flows_through_the_scale():
    tx = fx.contrib.reduce_on_plateau()
    g = torch.tensor([1.0, -2.0])
    grad = torch.func.grad(lambda g: tx.update(g, tx.init(g), value=1.0)[0].sum())(g)
    assert grad.tolist() == [1.0, 1.0]


def test_report_shows_the_scale():
    from fxtrain._base import report

    tx = fx.chain(fx.sgd(0.1), fx.contrib.reduce_on_plateau())
    assert report(tx.init({"w": torch.ones(1)})) == {"plateau_scale": torch.tensor(1.0)}


# --- errors -------------------------------------------------------------------------------------

def test_update_without_value_says_how():
    tx = fx.chain(fx.sgd(0.1), fx.contrib.reduce_on_plateau())
    p = {"w": torch.ones(1)}
    with pytest.raises(TypeError, match=r"reduce_on_plateau: update needs value=.*tx.update\(grads, state, params, "
                                        r"value=loss\)"):
        tx.update(p, tx.init(p), p)


@pytest.mark.parametrize("kwargs, match", [
    (dict(factor=1.0), r"reduce_on_plateau: factor=1.0 must be in \(0, 1\)"),
    (dict(factor=0.0), r"factor=0.0 must be in \(0, 1\)"),
    (dict(rtol=-1e-4), r"reduce_on_plateau: rtol=-0.0001 must be >= 0"),
    (dict(atol=-1.0), r"atol=-1.0 must be >= 0"),
    (dict(rtol=0.0, atol=0.0), r"rtol and atol are both 0"),
    (dict(rtol=1.5), r"rtol=1.5 must be <= 1"),
    (dict(accumulation_size=0), r"accumulation_size=0 must be >= 1"),
    (dict(patience=-1), r"patience=-1 must be >= 0"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fx.contrib.reduce_on_plateau(**kwargs)


def test_hyperparameters_injected_and_set_mid_run():
    # tensor hyperparameters (inject_hyperparams), one of them changed between updates with fx.tree.set
    tx = fx.inject_hyperparams(fx.contrib.reduce_on_plateau)(factor=0.5, patience=1)
    p = {"w": torch.ones(2)}
    state = tx.init(p)
    for _ in range(3):  # an improvement, then two plateaus
        u, state = tx.update(p, state, p, value=torch.tensor(1.0))
    assert u["w"].tolist() == [0.25, 0.25]
    state = fx.tree.set(state, factor=torch.tensor(0.1))
    u, state = tx.update(p, state, p, value=torch.tensor(1.0))
    assert u["w"].tolist() == pytest.approx([0.025, 0.025])


def test_the_runner_prints_patience_as_the_whole_number_it_is(tmp_path, capsys):
    # The config's patience=11 (a count) was printed patience=11.0 in the stack line: the runner made every int a
    # float where the annotation named a float type (Scalar); counts are annotated Count now, and stay ints.
    assert run_main("trainer.progress=false", "trainer.device=cpu", "trainer.max_steps=2", "model.hidden=[8]",
                    "+optim.chain.reduce_on_plateau._target_=fxtrain.contrib.reduce_on_plateau",
                    "+optim.chain.reduce_on_plateau.patience=11", "+optim.chain.reduce_on_plateau.cooldown=2",
                    "hydra.run.dir=run") == 0
    for shown in (capsys.readouterr().out, (tmp_path / "run" / "train.log").read_text()):
        assert "reduce_on_plateau(patience=11, cooldown=2))" in shown, shown
