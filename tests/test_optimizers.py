"""Optimizers (fxtrain/optimizers.py): Optax's signatures, states and numbers; errors; dtypes. And every optimizer
of the catalogue (fxtrain/optimizers.py, fxtrain/transforms/, fxtrain/contrib/) inside the recommended stack."""

import inspect

import numpy as np

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from tests import cases
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, ndim_mask
from tests.cases.core import OPTIMIZER_VARIANTS as CASES

NAMES = ["sgd", "adam", "adamw", "lion", "rmsprop", "adagrad"]


def _sched(count):
    return 0.1 * 0.9 ** count


@pytest.mark.optax
def test_chains_match_optax():
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.add_decayed_weights(1e-2, ndim_mask), fx.sgd(_sched, momentum=0.9, nesterov=True))
    otx = optax.chain(optax.add_decayed_weights(1e-2, ndim_mask), optax.sgd(_sched, momentum=0.9, nesterov=True))
    assert_parity(tx, otx)


@pytest.mark.optax
@pytest.mark.parametrize("name", NAMES + ["scale", "scale_by_learning_rate", "scale_by_schedule", "scale_by_adam",
                                          "scale_by_rms", "scale_by_stddev", "scale_by_rss", "scale_by_lion",
                                          "trace", "add_decayed_weights"])
def test_signature_is_optax(name):
    optax = pytest.importorskip("optax")
    ours, theirs = inspect.signature(getattr(fx, name)), inspect.signature(getattr(optax, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


@pytest.mark.optax
def test_masking_signatures_are_optax():
    """Extra update arguments exist (issue 18), so Optax's ``mask_compatible_extra_args`` does too."""
    optax = pytest.importorskip("optax")
    for name in ("masked", "partition"):
        assert list(inspect.signature(getattr(fx, name)).parameters) == \
            list(inspect.signature(getattr(optax, name)).parameters)


@pytest.mark.parametrize("name,args,kwargs", CASES.values(), ids=CASES.keys())
def test_pure_dtypes_and_none_leaves(name, args, kwargs):
    tx = getattr(fx, name)(*args, **kwargs)
    assert_pure(tx)
    assert_dtypes(tx)
    if not isinstance(kwargs.get("mask"), dict):
        assert_none_passthrough(tx)


def test_optimizers_accept_tensor_hyperparameters():
    """What inject_hyperparams passes: 0-dim tensors for every numeric argument."""
    t = torch.tensor
    params = {"w": torch.ones(3), "b": torch.ones(1)}
    for tx in [fx.sgd(t(0.1), t(0.9)), fx.adam(t(0.1), t(0.9), t(0.99), t(1e-8), t(0.0)),
               fx.adamw(t(0.1), weight_decay=t(0.1)), fx.lion(t(0.1), t(0.9), t(0.99), weight_decay=t(0.1)),
               fx.rmsprop(t(0.1), t(0.9), t(1e-8), t(0.1), momentum=t(0.9), centered=True),
               fx.adagrad(t(0.1), t(0.1), t(1e-7))]:
        u, _ = tx.update(params, tx.init(params), params)
        assert all(torch.isfinite(x).all() for x in fx.tree.leaves(u))


def test_repr():
    assert repr(fx.adamw(1e-3, weight_decay=0.1)) == "adamw(0.001, weight_decay=0.1)"
    assert repr(fx.sgd(0.1, momentum=0.9, nesterov=True)) == "sgd(0.1, momentum=0.9, nesterov=True)"
    assert repr(fx.rmsprop(_sched, centered=True)) == "rmsprop(_sched, centered=True)"


def test_elementwise():
    assert all(fx.is_elementwise(getattr(fx, n)(0.1)) for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_negative_learning_rate_names_the_optimizer(name):
    with pytest.raises(ValueError, match=rf"{name}: learning_rate=-0.1 must be >= 0"):
        getattr(fx, name)(-0.1)


@pytest.mark.parametrize("name,kwargs", [("sgd", {"momentum": -0.9}), ("adam", {"b1": -0.9}), ("adamw", {"eps": -1.0}),
                                         ("adamw", {"weight_decay": -0.1}), ("lion", {"b2": -0.5}),
                                         ("rmsprop", {"decay": -0.9}), ("rmsprop", {"momentum": -0.9}),
                                         ("adagrad", {"eps": -1.0})])
def test_negative_hyperparameters_raise_naming_them(name, kwargs):
    (arg, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"{arg}={value} must be >= 0"):
        getattr(fx, name)(0.1, **kwargs)


def test_dtensor_leaves_give_the_plain_numbers(tmp_path):
    """Without sharded_apply the optimizers also run on DTensor leaves (a world of one process here)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = {"w": torch.randn(4, 3), "b": torch.randn(3)}
        sharded = {"w": distribute_tensor(plain["w"], mesh, [Shard(0)]),
                   "b": distribute_tensor(plain["b"], mesh, [Replicate()])}
        for tx in [fx.sgd(0.1, 0.9, accumulator_dtype=torch.bfloat16),
                   fx.adamw(0.1, weight_decay=0.1, mask={"w": True, "b": False}),
                   fx.adam(_sched, nesterov=True, mu_dtype=torch.bfloat16), fx.lion(0.1),
                   fx.rmsprop(0.1, centered=True, momentum=0.9), fx.adagrad(0.1)]:
            results = []
            for params in (plain, sharded):
                state = tx.init(params)
                for _ in range(2):
                    u, state = fx.update_(tx, fx.tree.map(lambda x: 0.1 * x, params), state, params)
                results.append(u)
            assert type(results[1]["w"]).__name__ == "DTensor"
            assert_trees_close(results[1], results[0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lion", "rmsprop", "adagrad"])
def test_learning_rate_none_is_refused_not_an_ascent(name):
    # Issue 15, finding 4: fx.adam(None) used to apply the raw direction (+update, step size 1).
    with pytest.raises(ValueError, match=f"{name}: learning_rate=None"):
        getattr(fx, name)(None)


# --- complex parameters (issue 18): Optax's alias_test.test_optimization targets, complex64 -------------
# Optax: parabola from [-1, 10, 1] to (1 + 1j) * [1, -1, 1]; Rosenbrock with a = 1 + 1j, b = 100, from 0.
# Gradients: torch's autograd of the real objective is already the conjugate JAX's test applies.

def _parabola():
    final = torch.tensor([1.0, -1.0, 1.0], dtype=torch.complex64) * (1 + 1j)
    return torch.tensor([-1.0, 10.0, 1.0], dtype=torch.complex64), final, lambda p: ((p - final).abs() ** 2).sum()


def _rosenbrock():
    a, b = 1 + 1j, 100.0
    final = torch.tensor([a, a ** 2], dtype=torch.complex64)
    return (torch.zeros(2, dtype=torch.complex64), final,
            lambda p: (a - p[0]).abs() ** 2 + b * (p[1] - p[0] ** 2).abs() ** 2)


COMPLEX_OPTIMIZERS = {"adam": {"learning_rate": 1e-1}, "adamw": {"learning_rate": 1e-1},
                      "adagrad": {"learning_rate": 1.0}, "rmsprop": {"learning_rate": 5e-3},
                      "rmsprop_momentum": {"learning_rate": 5e-3, "momentum": 0.9},
                      "sgd": {"learning_rate": 1e-3, "momentum": 0.9}}


def _complex_run(name, kwargs, target, steps):
    init, final, objective = target()
    tx = getattr(fx, name.removesuffix("_momentum"))(**kwargs)
    p = {"w": init}
    state = tx.init(p)
    for _ in range(steps):
        w = p["w"].clone().requires_grad_()
        (g,) = torch.autograd.grad(objective(w), w)
        u, state = fx.update_(tx, {"w": g}, state, p)
        p = fx.apply_updates_(p, u)
    return p["w"], final


@pytest.mark.parametrize("target", [_parabola, _rosenbrock], ids=["parabola", "rosenbrock"])
@pytest.mark.parametrize("name", COMPLEX_OPTIMIZERS)
def test_complex_parameters_follow_optax(name, target):
    """100 steps (Rosenbrock: 30) on complex64 against Optax's jitted run of the same objective (its test conjugates JAX's
    gradient; the optimum is reached by both as in Optax's 10000-step test, checked on the parabola below)."""
    jax, jnp = pytest.importorskip("jax"), pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    kwargs = COMPLEX_OPTIMIZERS[name]
    steps = 100 if target is _parabola else 30  # Rosenbrock's valley amplifies rounding differences
    ours, _ = _complex_run(name, kwargs, target, steps=steps)
    init, final, _ = target()
    fin = jnp.asarray(final.numpy())
    objective = ((lambda p: jnp.sum(jnp.abs(p - fin) ** 2)) if target is _parabola else
                 (lambda p: jnp.abs((1 + 1j) - p[0]) ** 2 + 100.0 * jnp.abs(p[1] - p[0] ** 2) ** 2))
    otx = getattr(optax, name.removesuffix("_momentum"))(**kwargs)

    @jax.jit
    def step(p, s):
        u, s = otx.update(jax.grad(objective)(p).conj(), s, p)
        return optax.apply_updates(p, u), s

    p = jnp.asarray(init.numpy())
    s = otx.init(p)
    for _ in range(steps):
        p, s = step(p, s)
    torch.testing.assert_close(ours, torch.from_numpy(np.array(p)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["adam", "adagrad", "rmsprop"])
def test_complex_parabola_reaches_the_optimum(name):
    """Optax's own criterion: within 3e-2 of (1 + 1j) * [1, -1, 1] (Optax runs 10000 steps)."""
    ours, final = _complex_run(name, COMPLEX_OPTIMIZERS[name], _parabola, steps=3000)
    torch.testing.assert_close(ours, final, rtol=3e-2, atol=3e-2)


def test_complex_adam_first_update_is_optax():
    """The issue's one step with g = 1 + 2j: Optax's adam(0.1) update is -0.0447 - 0.0894j (|g|^2 in the second
    moment); g * g gave -0.1 + 0j."""
    tx = fx.adam(0.1)
    g = {"w": torch.tensor([1 + 2j], dtype=torch.complex64)}
    u, _ = tx.update(g, tx.init(g))
    torch.testing.assert_close(u["w"], torch.tensor([-0.1 * (1 + 2j) / 5 ** 0.5], dtype=torch.complex64))


@pytest.mark.parametrize("name", ["adam", "adamw", "nadam"])
def test_float64_bias_correction_matches_torch_optim(name):
    """Adam's bias correction runs in the params' precision: float64 params equal torch.optim's float64 Adam
    (the correction in float32 left 1.3e-5 relative at step 1)."""
    torch.manual_seed(0)
    p, g = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    w = p.clone().requires_grad_()
    kind = torch.optim.AdamW if name == "adamw" else (torch.optim.NAdam if name == "nadam" else torch.optim.Adam)
    extra = {"weight_decay": 1e-4} if name == "adamw" else {}  # fx.adamw's default
    if name == "nadam":
        pytest.skip("torch's NAdam uses a momentum decay schedule, not Dozat's NAdam as Optax")
    opt = kind([w], lr=0.1, foreach=False, **extra)
    w.grad = g.clone()
    opt.step()
    tx = getattr(fx, name)(0.1)
    u, _ = tx.update({"w": g}, tx.init({"w": p}), {"w": p})
    torch.testing.assert_close(p + u["w"], w.detach(), rtol=1e-14, atol=0)


# --- every optimizer inside the recommended stack (issue 18: a test per optimizer inside it) ---------------------
#
# For each optimizer of the catalogue (tests/cases/*.py ``OPTIMIZERS``) and of the core:
#
# * ``accumulate(opt, every=2)`` emits ``opt``'s update of the mean of two micro-batch gradients, and zeros
#   between emissions (Optax's MultiSteps);
# * ``amp_cast(opt, "p=f32,c=f32,o=f32", loss_scale=2**10)`` fed the gradients of the scaled loss gives ``opt``'s
#   update of the true gradients, bit for bit (a power-of-two scale is exact);
# * ``sharded_apply(opt)`` equals ``opt`` on plain leaves when ``opt`` is elementwise, and otherwise is refused with
#   a message naming it;
# * the whole stack, ``accumulate(amp_cast(chain(clip_by_global_norm(1.0), opt')), every=2)`` with ``opt'`` the
#   optimizer in ``sharded_apply`` where it is elementwise, trained by ``fx.train_step`` (donated) for 3 emitted
#   steps, equals ``chain(clip_by_global_norm(1.0), opt)`` on the mean gradient of each window.

CORE = {
    "sgd": lambda: fx.sgd(0.1, momentum=0.9),
    "adam": lambda: fx.adam(1e-2),
    "adamw": lambda: fx.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: fx.lion(1e-3),
    "rmsprop": lambda: fx.rmsprop(1e-2),
    "adagrad": lambda: fx.adagrad(1e-2),
}
OPTIMIZERS = {**CORE, **cases.merged("OPTIMIZERS")}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _extra(tx) -> dict:
    """``value=`` for optimizers that read it (polyak_sgd...), as train_step passes the loss."""
    return {"value": torch.tensor(0.5)} if fx.traits(tx).extra_args else {}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_accumulate_emits_the_update_of_the_mean_gradient(name):
    opt = OPTIMIZERS[name]()
    tx = fx.accumulate(OPTIMIZERS[name](), every=2)
    params = _params()
    s, ref_s = tx.init(params), opt.init(params)
    for window in range(2):
        g1, g2 = _params(10 + 2 * window), _params(11 + 2 * window)
        held, s = tx.update(g1, s, params, **_extra(tx))
        assert len(fx.tree.leaves(held)) == len(fx.tree.leaves(params))  # zeros, not None (Optax's MultiSteps)
        for u in fx.tree.leaves(held):
            assert u.dtype == torch.float32 and not u.any()
        u, s = tx.update(g2, s, params, **_extra(tx))
        mean = fx.tree.map(lambda a, b: (a + b) / 2, g1, g2)
        ref, ref_s = opt.update(mean, ref_s, params, **_extra(opt))
        assert_trees_close(u, ref, **TOL)
        params = fx.apply_updates(params, ref)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_amp_cast_unscales_to_the_optimizer_on_true_gradients(name):
    opt = OPTIMIZERS[name]()
    tx = fx.amp_cast(OPTIMIZERS[name](), policy="p=f32,c=f32,o=f32", loss_scale=fx.StaticLossScale(2.0 ** 10))
    params = _params()
    s, ref_s = tx.init(params), opt.init(params)
    for step in range(3):
        g = _params(20 + step)
        u, s = tx.update(fx.tree.map(lambda x: x * 2.0 ** 10, g), s, params, **_extra(tx))
        ref, ref_s = opt.update(g, ref_s, params, **_extra(opt))
        assert_trees_close(u, ref, rtol=0, atol=0)
        params = fx.apply_updates(params, ref)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_apply_runs_elementwise_optimizers_and_refuses_the_others(name):
    opt = OPTIMIZERS[name]()
    if not fx.is_elementwise(opt):
        with pytest.raises(ValueError, match=rf"sharded_apply: .*{name}\(.* is not elementwise"):
            fx.sharded_apply(opt)
        return
    tx = fx.sharded_apply(OPTIMIZERS[name]())
    params = _params()
    s, ref_s = tx.init(params), opt.init(params)
    for step in range(3):
        g = _params(30 + step)
        u, s = tx.update(g, s, params, **_extra(tx))
        ref, ref_s = opt.update(g, ref_s, params, **_extra(opt))
        assert_trees_close(u, ref, rtol=0, atol=0)
        params = fx.apply_updates(params, ref)


def _loss(params, batch):
    x, y = batch
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_recommended_stack_trains_like_the_optimizer_on_window_means(name):
    inner = OPTIMIZERS[name]()
    inner = fx.sharded_apply(inner) if fx.is_elementwise(inner) else inner
    tx = fx.accumulate(fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), inner), policy="p=f32,c=f32,o=f32",
                                   loss_scale=fx.StaticLossScale(2.0 ** 4)), every=2)
    ref_tx = fx.chain(fx.clip_by_global_norm(1.0), OPTIMIZERS[name]())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(6)]
    step = fx.train_step(_loss, tx)
    params, ref = _params(), _params()
    state, ref_state = tx.init(params), ref_tx.init(ref)
    for k in range(0, len(batches), 2):
        losses = []
        for b in batches[k:k + 2]:
            params, state, metrics = step(params, state, b)
            losses.append(metrics["loss"])
        grads = [torch.func.grad(_loss)(ref, b) for b in batches[k:k + 2]]
        mean = fx.tree.map(lambda a, c: (a + c) / 2, *grads)
        extra = {"value": losses[-1]} if fx.traits(ref_tx).extra_args else {}
        u, ref_state = ref_tx.update(mean, ref_state, ref, **extra)
        ref = fx.apply_updates(ref, u)
        assert_trees_close(params, ref, **TOL)
