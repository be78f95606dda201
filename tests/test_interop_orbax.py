"""fxtrain/interop/_orbax.py: Orbax checkpoints both ways, checked against a JAX program (Flax linen + Optax).

Acceptance: a tiny MLP trained N steps in JAX (flax.linen, optax.chain(clip_by_global_norm, adamw)), saved
with Orbax, continued N steps in fxtrain on torch equals 2N steps in JAX; and the reverse (N in fxtrain,
saved with save_orbax, N in JAX restoring with Orbax against Optax's own init). float32, the pure step
(tx.update + apply_updates) on the torch side.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxtrain as fx
from fxtrain.interop import from_jax, from_linen, load_orbax, save_orbax, to_jax, to_linen

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
ocp = pytest.importorskip("orbax.checkpoint")
linen = pytest.importorskip("flax.linen")
pytestmark = pytest.mark.jax

LR, WD, CLIP, N = 0.02, 0.1, 0.5, 8
REL = 1e-5  # params within 1e-5 relative to their largest entry (float32)


class FlaxMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        h = jnp.tanh(linen.Dense(16)(x))  # Dense_0: compact names count in creation order
        return linen.Dense(2)(h)


def torch_mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)


def txs():
    return (optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=WD)),
            fx.chain(fx.clip_by_global_norm(CLIP), fx.adamw(LR, weight_decay=WD)))


def jax_steps(params, state, n):
    otx, _ = txs()
    x, y = (to_jax(t.clone()) for t in data())

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.mean((FlaxMLP().apply({"params": p}, x) - y) ** 2))(params)
        updates, state = otx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(n):
        params, state = step(params, state)
    return params, state


def assert_rel_close(got: dict, expected: dict):
    for k in expected:
        err = float((got[k] - expected[k]).abs().max() / expected[k].abs().max())
        assert err <= REL, f"{k}: relative difference {err:.2e}"


def test_jax_checkpoint_continues_in_fxtrain(tmp_path, mse_steps):
    otx, tx = txs()
    params = FlaxMLP().init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    params, state = jax_steps(params, otx.init(params), N)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "jax", {"params": params, "opt_state": state})  # what a JAX program does
    checkpointer.wait_until_finished()
    net = torch_mlp()
    like = {k: p.detach() for k, p in net.named_parameters()}
    p, s = load_orbax(tmp_path / "jax", like, tx, module=net)
    assert int(s[1][0].count) == N and float(s[0].grad_norm) == 0.0  # Optax keeps no norm
    torch.testing.assert_close(s[1][0].nu["0.weight"], from_jax(state[1][0].nu["Dense_0"]["kernel"]).T)
    p, _ = mse_steps(net, tx, p, s, N, data())
    expected, _ = jax_steps(params, state, N)  # the run that never crossed
    assert_rel_close(p, from_linen({"params": expected}, net))


def test_fxtrain_checkpoint_continues_in_jax(tmp_path, mse_steps):
    otx, tx = txs()
    torch.manual_seed(0)
    net = torch_mlp()
    params = {k: p.detach().clone() for k, p in net.named_parameters()}
    params, state = mse_steps(net, tx, params, tx.init(params), N, data())
    save_orbax(tmp_path / "fx", params, state, tx, step=N, module=net)
    # a JAX program restores it against Optax's own init
    target = to_linen(params, net)["params"]
    target = {"params": target, "opt_state": otx.init(target)}
    restored = ocp.StandardCheckpointer().restore(tmp_path / "fx", jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                                                  target))
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    assert ocp.StandardCheckpointer().metadata(tmp_path / "fx").custom_metadata == {"step": N}
    jp, _ = jax_steps(restored["params"], restored["opt_state"], N)
    expected, _ = mse_steps(net, tx, params, state, N, data())  # the run that never crossed
    assert_rel_close(from_linen({"params": jp}, net), expected)


def test_round_trip_without_a_module_and_with_optax_like(tmp_path):
    otx, tx = txs()
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    grads = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    _, state = tx.update(grads, tx.init(params), params)
    save_orbax(tmp_path / "a", params, state, tx)
    p, s = load_orbax(tmp_path / "a", {k: torch.zeros_like(v) for k, v in params.items()}, tx)
    assert all(torch.equal(p[k], params[k]) for k in params)
    assert torch.equal(s[1][0].mu["w"], state[1][0].mu["w"]) and int(s[1][0].count) == 1
    # with Optax's own state as the template: the same checkpoint
    save_orbax(tmp_path / "b", params, state, tx, optax_like=otx.init(to_jax(params)))
    p2, s2 = load_orbax(tmp_path / "b", params, tx)
    assert torch.equal(s2[1][0].nu["b"], state[1][0].nu["b"])


def test_scheduled_hyperparameters_cross_as_optax_stateful_inject(tmp_path):
    # optax.inject_hyperparams with a schedule keeps a WrappedScheduleState(count) per scheduled hyperparameter
    # (Optax >= 0.2.5): save_orbax(schedules=...) writes it, so Optax's own init is the restore target, and
    # load_orbax reads it back as fxtrain's count. The step rides in the checkpoint's metadata (orbax_step).
    from fxtrain.interop._orbax import orbax_step

    shape = fx.linear_schedule(1.0, 0.0, 10)
    tx = fx.inject_hyperparams(fx.adamw)(learning_rate=lambda n: LR * shape(n), weight_decay=WD)
    otx = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(LR, 0.0, 10), weight_decay=WD)
    params, grads = {"w": torch.randn(3, 2)}, {"w": torch.randn(3, 2)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update(grads, state, params)
    save_orbax(tmp_path / "a", params, state, tx, step=3, schedules=("learning_rate",))
    target = {"params": to_jax(params), "opt_state": otx.init(to_jax(params))}
    restored = ocp.StandardCheckpointer().restore(tmp_path / "a", jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
    assert int(restored["opt_state"].hyperparams_states["learning_rate"].count) == 3 == orbax_step(tmp_path / "a")
    assert float(restored["opt_state"].hyperparams["learning_rate"]) == float(state.hyperparams["learning_rate"])
    # what JAX writes (no step recorded) reads back into fxtrain's state, the schedules' counts as its count
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "b", restored)
    checkpointer.wait_until_finished()
    assert orbax_step(tmp_path / "b") is None
    _, back = load_orbax(tmp_path / "b", params, tx)
    assert int(back.count) == 3 and torch.equal(back.inner_state[0].nu["w"], state.inner_state[0].nu["w"])
    # a hyperparameter state that is not a plain schedule's count is refused by its path
    bad = {"params": restored["params"],
           "opt_state": restored["opt_state"]._replace(hyperparams_states={"learning_rate": {"count": 3, "x": 1.0}})}
    checkpointer.save(tmp_path / "c", bad)
    checkpointer.wait_until_finished()
    with pytest.raises(ValueError, match=r"differs at 'opt_state.hyperparams_states.learning_rate': dict where a "
                                         r"WrappedScheduleState\(count\) is"):
        load_orbax(tmp_path / "c", params, tx)


def test_errors_name_the_path(tmp_path):
    _, tx = txs()
    params = {"w": torch.ones(3)}
    save_orbax(tmp_path / "a", params, tx.init(params), tx)
    with pytest.raises(ValueError, match=r"load_orbax: the checkpoint differs at 'opt_state': list where 1 entries"):
        load_orbax(tmp_path / "a", params, fx.chain(fx.adam(0.1)))
    with pytest.raises(ValueError, match=r"differs at 'params.w': shape \(3,\), expected \(4,\)"):
        load_orbax(tmp_path / "a", {"w": torch.ones(4)}, fx.chain(fx.clip_by_global_norm(CLIP),
                                                                   fx.adamw(LR, weight_decay=WD)))
    with pytest.raises(ValueError, match=r"opt_state at '0' is ScaleByAdamState, tx.init\(params\) gives ClipByGlob"):
        save_orbax(tmp_path / "b", params, fx.adam(0.1).init(params), tx)


def test_nnx_naming_restores_into_an_nnx_model(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 16), nn.Linear(16, 2)])

    class NNet(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 16, rngs=rngs), nnx.Linear(16, 2, rngs=rngs)])

    otx, tx = txs()
    torch.manual_seed(0)
    net = Net()
    params = {k: p.detach() for k, p in net.named_parameters()}
    _, state = tx.update({k: torch.randn_like(p) for k, p in params.items()}, tx.init(params), params)
    save_orbax(tmp_path / "nnx", params, state, tx, module=net, naming="nnx")
    model = NNet(nnx.Rngs(0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    target = {"params": pure, "opt_state": otx.init(pure)}
    restored = ocp.StandardCheckpointer().restore(tmp_path / "nnx", jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                                                   target))
    nnx.update(model, restored["params"])
    assert torch.equal(from_jax(model.layers[1].kernel[...]), params["layers.1.weight"].T)
    mu = restored["opt_state"][1][0].mu
    assert torch.equal(from_jax(mu["layers"][0]["kernel"]), state[1][0].mu["layers.0.weight"].T)
    # and back
    p, s = load_orbax(tmp_path / "nnx", params, tx, module=net, naming="nnx")
    assert all(torch.equal(p[k], params[k]) for k in params)
    assert torch.equal(s[1][0].nu["layers.1.bias"], state[1][0].nu["layers.1.bias"])


# --- CheckpointManager layouts: <dir>/<step>/default, checked against Orbax's own manager -------------------------

def manager_saves(directory, trees: dict):
    """What a JAX program's training loop writes: ``manager.save(step, args=StandardSave(tree))`` per step."""
    with ocp.CheckpointManager(directory) as manager:
        for step, tree in trees.items():
            manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()


def test_a_checkpoint_manager_directory_is_read_at_its_newest_or_given_step(tmp_path):
    from fxtrain.interop._orbax import orbax_step

    otx, tx = txs()
    params = FlaxMLP().init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    early = jax_steps(params, otx.init(params), 2)
    late = jax_steps(*early, 3)
    manager_saves(tmp_path / "run", {2: {"params": early[0], "opt_state": early[1]},
                                     5: {"params": late[0], "opt_state": late[1]}})
    net = torch_mlp()
    like = {k: p.detach() for k, p in net.named_parameters()}
    for where, step, (expected, count) in [("run", None, (late, 5)), ("run", 2, (early, 2)), ("run/2", None, (early, 2))]:
        p, s = load_orbax(tmp_path / where, like, tx, step=step, module=net)
        assert int(s[1][0].count) == count == orbax_step(tmp_path / where, step)
        assert all(torch.equal(p[k], v) for k, v in from_linen({"params": expected[0]}, net).items())
        torch.testing.assert_close(s[1][0].mu["2.weight"], from_jax(expected[1][1][0].mu["Dense_1"]["kernel"]).T,
                                   rtol=0, atol=0)


def test_save_orbax_adds_a_step_orbax_s_manager_restores(tmp_path):
    otx, tx = txs()
    torch.manual_seed(0)
    net = torch_mlp()
    params = {k: p.detach().clone() for k, p in net.named_parameters()}
    _, state = tx.update({k: torch.randn_like(p) for k, p in params.items()}, tx.init(params), params)
    save_orbax(tmp_path / "run", params, state, tx, step=10, module=net, manager=True)  # a new manager directory
    target = to_linen(params, net)["params"]
    target = {"params": target, "opt_state": otx.init(target)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    save_orbax(tmp_path / "run", params, tx.init(params), tx, step=20, module=net)  # an existing one: found as such
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        assert list(manager.all_steps()) == [10, 20] and manager.latest_step() == 20
        restored = manager.restore(10, args=ocp.args.StandardRestore(abstract))
        fresh = manager.restore(20, args=ocp.args.StandardRestore(abstract))
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    assert int(restored["opt_state"][1][0].count) == 1 and int(fresh["opt_state"][1][0].count) == 0
    assert torch.equal(from_jax(restored["opt_state"][1][0].nu["Dense_0"]["kernel"]), state[1][0].nu["0.weight"].T)
    with pytest.raises(ValueError, match=r"^save_orbax: '.*run' already holds step 10; pass force=True to replace it$"):
        save_orbax(tmp_path / "run", params, state, tx, step=10, module=net)
    save_orbax(tmp_path / "run", params, tx.init(params), tx, step=10, module=net, force=True)
    assert int(load_orbax(tmp_path / "run", params, tx, step=10, module=net)[1][1][0].count) == 0


@pytest.mark.parametrize("where, step, message", [
    ("nowhere", None, r"load_orbax: '.*nowhere' does not exist; expected an Orbax checkpoint: what "
                      r"StandardCheckpointer\(\).save wrote \(a directory holding _METADATA\), a CheckpointManager "
                      r"directory \(<dir>/<step>/default\) or one of its step directories"),
    ("other", None, r"load_orbax: '.*other' is not an Orbax checkpoint \(it holds notes.txt\); expected an Orbax"),
    ("run", 7, r"load_orbax: '.*run' has no step 7 \(its steps: 1, 3\); pass one of them, or none for the newest"),
    ("run/3", 1, r"load_orbax: '.*run/3' is the step directory of step 3, step=1 asks for another"),
    ("run/3/default", 3, r"load_orbax: '.*default' is one checkpoint, not a CheckpointManager directory: step=3 "
                         r"picks nothing there"),
])
def test_anything_else_is_refused_in_one_line_naming_the_path(tmp_path, where, step, message):
    params, tx = {"w": torch.ones(3)}, fx.sgd(0.1)
    for n in (1, 3):
        save_orbax(tmp_path / "run", params, tx.init(params), tx, step=n, manager=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="^" + message) as raised:
        load_orbax(tmp_path / where, params, tx, step=step)
    assert "\n" not in str(raised.value)


def test_save_orbax_refuses_a_taken_path_before_writing(tmp_path):
    params, tx = {"w": torch.ones(3)}, fx.sgd(0.1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^save_orbax: '.*other' exists and is not an Orbax checkpoint; expected a new "
                                         r"path, a checkpoint to replace \(force=True\) or a CheckpointManager"):
        save_orbax(tmp_path / "other", params, tx.init(params), tx)
    save_orbax(tmp_path / "run", params, tx.init(params), tx, step=1, manager=True)
    with pytest.raises(ValueError, match=r"^save_orbax: '.*run' is a CheckpointManager directory: pass step="):
        save_orbax(tmp_path / "run", params, tx.init(params), tx)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]
